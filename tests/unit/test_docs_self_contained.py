"""The project's docs stand on their own: no reference to a design document or seed outside
the repository, and every relative link points at a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_reference_outside_the_repository(doc: Path) -> None:
    text = doc.read_text()
    for pattern in (r"DESIGN\.md", r"\bseed 0\d\d\b", r"\bthe design\b", r"/work/"):
        assert not re.search(pattern, text, re.I), (doc.name, pattern)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc: Path) -> None:
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (doc.parent / target).exists(), (doc.name, target)
