"""The repository's documents as the tests read them: the text between two markers of one file.

Tables and code blocks that docs promise (the supported models, the Megatron architectures, the README's
quickstart) are read through here, so every doc-checking test finds its part of a file the same way.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def doc_between(path: str, start: str, end: str) -> str:
    """The text of ``path`` (relative to the repository root) after the first ``start`` and before the next
    ``end``; a missing marker is an error naming it."""
    text = (REPO / path).read_text()
    if start not in text:
        raise ValueError(f"{path} has no {start!r}")
    after = text.split(start, 1)[1]
    if end not in after:
        raise ValueError(f"{path} has no {end!r} after {start!r}")
    return after.split(end, 1)[0]
