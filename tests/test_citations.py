"""The repository stands alone: every `method §N` citation, in code and docs, names a section of
docs/method.md, and nothing cites notes that are not in the repository."""
import os
import re
import subprocess

from tests.paths import ROOT

CITATION = re.compile(r"method §(\d+(?:\.\d+)?)(?:-(\d+))?")


def _tracked(*suffixes):
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [f for f in files if f.endswith(suffixes) and os.path.exists(os.path.join(ROOT, f))]


def _sections() -> set[str]:
    with open(os.path.join(ROOT, "docs", "method.md")) as f:
        return set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", f.read(), re.M))


def test_every_method_citation_names_a_section_of_docs_method():
    sections = _sections()
    assert {"1", "2", "2.1", "3", "3.4", "4.3", "5", "6"} <= sections
    dangling, cited = [], 0
    for path in _tracked(".py", ".md", ".sh"):
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                for first, last in CITATION.findall(line):
                    cited += 1
                    dangling += [f"{path}:{n}: method §{s}" for s in (first, last) if s and s not in sections]
    assert cited > 40 and dangling == []


def test_nothing_cites_notes_outside_the_repository():
    stray = re.compile(r"\bSPEC\b|shared notes|\.\./shared")
    found = []
    for path in _tracked(".py", ".md", ".sh"):
        if path == "tests/test_citations.py":
            continue
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            found += [f"{path}:{n}" for n, line in enumerate(f, 1) if stray.search(line)]
    assert found == []
    with open(os.path.join(ROOT, "README.md")) as f:
        assert "docs/method.md" in f.read()
