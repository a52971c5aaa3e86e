"""The front page stays a front page: short, one line per capability, each with the doc and the test behind it.

README.md is read in two minutes (≤ 1,000 words, no line or paragraph over 400 characters); every line of its
feature list links to a page of ``docs/`` and to a test file; every relative link resolves. The figures live in
``docs/capabilities.md`` and ``benchmarks/README.md``.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")
MAX_WORDS = 1000
MAX_CHARS = 400


def _prose_blocks(text: str) -> list[str]:
    """Paragraphs, list items and table rows outside code fences and HTML comments."""
    blocks, current, fenced = [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("<!--"):
            continue
        if not line.strip() or line.startswith(("- ", "|", "#")):
            if current:
                blocks.append(" ".join(current))
            current = []
            if line.strip():
                blocks.append(line)
            continue
        current.append(line.strip())
    if current:
        blocks.append(" ".join(current))
    return blocks


def _features(text: str) -> list[str]:
    section = text.split("## What it does", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("- ")]


def test_readme_reads_in_two_minutes():
    text = README.read_text(encoding="utf-8")
    assert len(text.split()) <= MAX_WORDS, f"README.md has {len(text.split())} words (at most {MAX_WORDS})"
    long = [block[:80] for block in _prose_blocks(text) if len(block) > MAX_CHARS]
    assert not long, f"README.md blocks over {MAX_CHARS} characters: {long}"


def test_every_feature_links_its_doc_and_its_test():
    features = _features(README.read_text(encoding="utf-8"))
    assert len(features) >= 15
    for line in features:
        targets = [match.group(1) for match in LINK.finditer(line)]
        assert any(t.startswith("docs/") for t in targets), f"no doc linked: {line[:80]}"
        assert any(t.startswith("tests/") and t.endswith(".py") for t in targets), f"no test linked: {line[:80]}"
        words = len(line.split("[doc]")[0].split())
        assert words <= 27, f"{words} words before the links (≤ 25 and the bullet): {line[:80]}"


def test_relative_links_resolve():
    for page in (README, *sorted((ROOT / "docs").glob("*.md"))):
        for match in LINK.finditer(page.read_text(encoding="utf-8")):
            target = match.group(1)
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to a missing {target}"
