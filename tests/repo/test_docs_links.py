"""Every relative link in README.md and docs/**/*.md reaches a file, and every anchor a heading;
every repository path they name in code (`` `scripts/lce_train/megatron_cpu.py` ``) exists.

Anchors follow GitHub's rule for headings: the heading's text (markdown links reduced to their
text) lowercased, every character that is not a letter, a digit, ``_``, ``-`` or a space dropped,
spaces turned into ``-``; a repeated heading gets ``-1``, ``-2``, ... Links inside code (fenced
blocks and inline spans) are text, not links, and are skipped; so are absolute URLs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
# A path in a code span under one of the repository's top-level folders; a placeholder file name
# in capitals (`scripts/X.py`) is not a path.
NAMED_PATH = re.compile(r"`((?:fused_lce|parallel|scripts|configs|tests|docs|\.ci)/[\w./-]+"
                        r"\.(?:py|sh|md|yaml|json|csv|png))`")


def _prose(text: str) -> str:
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in "_- ")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def test_slug_follows_github():
    assert slug("Implementations (`impl=`)") == "implementations-impl"
    assert slug("Gradients in the forward: three GEMMs") == "gradients-in-the-forward-three-gemms"
    assert slug("Measured: predicted vs measured per stage, 4 × H200") == \
        "measured-predicted-vs-measured-per-stage-4--h200"
    assert slug("See [the doc](docs/x.md) now") == "see-the-doc-now"


def _broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{target}: no such file")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{target}: no heading with anchor #{anchor} in {where.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_and_anchors_resolve(page):
    assert not _broken_links(page)


def test_a_broken_anchor_is_caught(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n## Gradients in the forward: how\n")
    (tmp_path / "b.md").write_text("[ok](a.md#gradients-in-the-forward-how) [bad](a.md#nope) "
                                   "[gone](c.md) `[code](c.md)` [web](https://example.com)\n")
    assert _broken_links(tmp_path / "b.md") == [
        "a.md#nope: no heading with anchor #nope in a.md", "c.md: no such file"]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_named_repository_paths_exist(page):
    named = NAMED_PATH.findall(page.read_text())
    missing = [path for path in named
               if not Path(path).stem.isupper() and not (ROOT / path).exists()]
    assert not missing
