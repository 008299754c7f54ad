"""Prompt text -> token ids, the same way on both routes: `flexicache eval` and lm-eval's `HFLM`.

A benchmark prompt is built as text (`longbench.prompt_text`, `leval.load_leval(..., tokenizer=...)`),
cut in the middle to a token budget (`cut_middle`), and encoded by `encode_prompt` exactly as lm-eval's
`HFLM` encodes a `generate_until` context: the chat template (when used) renders the text as one user
turn with the generation prompt, and the tokenizer's own special-token rule applies unless the
rendered text already starts with the BOS token. So the lm-eval tasks shipped in `lm_eval_tasks/`
and `flexicache eval longbench|leval` feed the model the same tokens.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["truncate_middle", "cut_middle", "encode_prompt"]


def truncate_middle(ids: Sequence[int], max_tokens: int) -> list[int]:
    """Keep the first `max_tokens // 2` and the last `max_tokens - max_tokens // 2` tokens (LongBench's rule:
    the instruction sits at both ends of a prompt, the middle of a document is the least harmful part to lose)."""
    ids = list(ids)
    if len(ids) <= max_tokens:
        return ids
    half = max_tokens // 2
    return ids[:half] + ids[len(ids) - (max_tokens - half):]


def cut_middle(tokenizer, text: str, max_tokens: int) -> str:
    """`text` unchanged when it has at most `max_tokens` tokens, else its head and tail (`truncate_middle`),
    decoded back to text."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    return tokenizer.decode(truncate_middle(ids, max_tokens))


def encode_prompt(tokenizer, text: str, chat: bool = True) -> list[int]:
    """Token ids of a prompt, as lm-eval's HFLM encodes it (with `--apply_chat_template` when `chat`).

    The chat template, when `chat` and the tokenizer has one, wraps `text` as a user turn followed by
    the assistant's generation prompt.
    """
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    bos = getattr(tokenizer, "bos_token", None)
    kwargs = {"add_special_tokens": False} if bos and text.startswith(bos) else {}
    return list(tokenizer(text, **kwargs)["input_ids"])
