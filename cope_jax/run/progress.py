"""What a run shows on the console (process 0 only): progress bars with live metrics, one-line notes."""
from __future__ import annotations

import sys


class Bar:
    """tqdm bar with the live metrics (success, reward, AF loss, KL, entropy, throughput)."""

    KEYS = (("succ", "succ"), ("score", "rew"), ("af_loss", "af"), ("kl", "kl"), ("entropy", "ent"),
            ("rft_loss", "loss"), ("train_tokens_per_s", "tok/s"), ("env_steps_per_s", "env/s"),
            ("env_faults", "faults"))

    def __init__(self, start: int, total: int, enabled: bool, desc: str = "RL"):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc=desc, dynamic_ncols=True)

    def update(self, record: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix({short: f"{record[k]:.3g}" for k, short in self.KEYS if k in record})
            self.bar.update(1)

    def to(self, n: int) -> None:
        """Moves the bar to n done (a hook for loops that report a count)."""
        if self.bar is not None and n != self.bar.n:
            self.bar.update(n - self.bar.n)

    def note(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def say(line: str, is_main: bool) -> None:
    """One line on stderr, from process 0."""
    if is_main:
        print(line, file=sys.stderr, flush=True)
