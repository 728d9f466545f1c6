"""The project speaks of itself: its pages, comments and docstrings never point at a work session
by its ordinal or at an issue or an item by its number (``HISTORY_WORDS`` spells the patterns).
A reader cannot resolve those; the reason, a date or a commit can be read.

The scan reads README.md, every docs/**/*.md and every *.py under fused_lce/, parallel/, scripts/
and tests/ (this file, which spells the words out, excepted). A phrase wrapped over two lines
("the fourth\\nsession") is caught too: the pattern runs over the whole text, and a hit is
reported at the line where it starts.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HISTORY_WORDS = re.compile(
    r"\b(fourth|fifth|sixth|seventh|eighth|ninth|tenth|first|second|third|this|last|previous|next"
    r"|earlier|later|a|one|each|the)\s+sessions?\b|\bsessions?\s+\d|\bissue[\s-]+\d+|\bitem\s+\d+",
    re.IGNORECASE)


def _scanned() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for folder in ("fused_lce", "parallel", "scripts", "tests"):
        files += sorted((ROOT / folder).rglob("*.py"))
    me = Path(__file__).resolve()
    return [f for f in files if f.resolve() != me]


def _hits(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    where = path.relative_to(ROOT)
    return [f"{where}:{text.count(chr(10), 0, m.start()) + 1}: {' '.join(m.group(0).split())!r}"
            for m in HISTORY_WORDS.finditer(text)]


def test_no_history_words():
    hits = [hit for path in _scanned() for hit in _hits(path)]
    assert not hits, ("session / issue / item words a reader cannot resolve (give the reason, a "
                      "date or a commit instead):\n" + "\n".join(hits))
