"""A family's train / test split as a fresh Python process computes it."""
import os
import subprocess
import sys

from tests.paths import ROOT


def digest_in_fresh_interpreter(module: str, hash_seed: str) -> str:
    """The first 16 hex of sha256(repr((train, test))) of `envs.<module>.SPLIT_IDS`, computed by
    another interpreter with PYTHONHASHSEED=`hash_seed` (a split must not hang on set order)."""
    code = (f"import hashlib; from envs.{module} import SPLIT_IDS as s; "
            "print(hashlib.sha256(repr((s['train'], s['test'])).encode()).hexdigest()[:16])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONHASHSEED=hash_seed), check=True)
    return out.stdout.strip()
