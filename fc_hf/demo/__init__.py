"""`flexicache demo`: a question about a long document, answered with dense attention and with FlexiCache
(`question.py`); `flexicache demo --continue`: the raw-text continuation of a long passage (`continuation.py`)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--continue" in argv:
        from .continuation import main as continuation

        return continuation([a for a in argv if a != "--continue"])
    from .question import main as question

    return question(argv)
