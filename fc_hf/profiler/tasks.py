"""Offline long-context, long-generation prompts for profiling (no dataset hub needed).

All tasks are generated here from the King James Bible text (`fc_hf.assets.kjv_text`), seeded by
(task, sample, seed), and wrapped in the model's chat template when it has one. RULER-style tasks
(`ruler-niah`, `ruler-vt`) follow RULER's templates (needles / variable chains in a haystack) but are
built here, not through lm-eval, so they need neither `wonderwords` nor a tokenizer folder.

| task          | what the model is asked to do                                                 |
|---------------|-------------------------------------------------------------------------------|
| kjv-continue  | continue a long passage from where it stops                                   |
| kjv-recall    | repeat, word for word, a passage quoted from early in the document            |
| kjv-summary   | summarise the document chapter by chapter                                     |
| ruler-niah    | list 8 "special magic numbers" (key -> 7-digit value) hidden in the haystack  |
| ruler-vt      | find every variable assigned a value through chains of `VAR X = VAR Y` lines  |
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import torch

TASKS = ("kjv-continue", "kjv-recall", "kjv-summary", "ruler-niah", "ruler-vt")

_KEYS = (
    "amber", "anchor", "badger", "banjo", "beacon", "bramble", "cactus", "canyon", "cobalt", "comet",
    "copper", "cricket", "dolphin", "ember", "falcon", "fjord", "garnet", "glacier", "harbor", "hazel",
    "indigo", "jasper", "juniper", "kettle", "lantern", "lichen", "magnet", "maple", "meadow", "nickel",
    "nutmeg", "orchid", "otter", "pebble", "pepper", "quartz", "quiver", "raven", "saffron", "sparrow",
    "thistle", "tundra", "umber", "velvet", "walnut", "willow", "yarrow", "zephyr", "zinnia", "violet",
)


@dataclass
class Prompt:
    """A built prompt: `input_ids` `[1, T]`, the task, and what a correct answer contains (`answer`)."""

    task: str
    sample: int
    input_ids: torch.Tensor
    answer: str


def _rng(task: str, sample: int, seed: int) -> random.Random:
    digest = hashlib.sha256(f"{task}/{sample}/{seed}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def _wrap(tokenizer, user: str, assistant_prefix: str = "") -> list[int]:
    """Token ids of `user` as a chat turn (plain text when the tokenizer has no chat template)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        ids = list(ids)
        if assistant_prefix:
            ids += tokenizer(assistant_prefix, add_special_tokens=False)["input_ids"]
        return ids
    return tokenizer(user + "\n" + assistant_prefix, add_special_tokens=False)["input_ids"]


def _document(tokenizer, n_tokens: int, rng: random.Random) -> str:
    from fc_hf.assets import kjv_text, long_prompt

    offset = rng.randrange(0, len(kjv_text()))
    return long_prompt(tokenizer, max(n_tokens, 16), offset=offset)


def _insert_at_depths(doc: str, needles: list[str], rng: random.Random) -> str:
    """Insert each needle after a sentence end, at evenly spread depths (10% .. 90%) of `doc`."""
    ends = [i + 1 for i, ch in enumerate(doc) if ch in ".;:" and i + 1 < len(doc) and doc[i + 1] == " "]
    if not ends:
        ends = [len(doc)]
    cuts = []
    for j in range(len(needles)):
        depth = 0.1 + 0.8 * (j + rng.random() * 0.5) / max(len(needles), 1)
        cuts.append(ends[min(int(depth * len(ends)), len(ends) - 1)])
    out, last = [], 0
    for cut, needle in sorted(zip(cuts, needles)):
        out += [doc[last:cut], " " + needle]
        last = cut
    out.append(doc[last:])
    return "".join(out)


def _fit(tokenizer, target: int, make) -> list[int]:
    """Ids of `make(doc_tokens)` with doc_tokens chosen so the whole prompt is about `target` tokens."""
    overhead = len(make(16)) - 16
    ids = make(max(target - overhead, 16))
    return ids


def build_prompt(task: str, tokenizer, prompt_tokens: int, sample: int = 0, seed: int = 0) -> Prompt:
    """Build one prompt of about `prompt_tokens` tokens (within a few percent) for `task`.

    Args:
        task (`str`): one of `TASKS`.
        tokenizer: the model's tokenizer.
        prompt_tokens (`int`): target prompt length, chat template included.
        sample (`int`, *optional*): sample index (different text and needles per sample).
        seed (`int`, *optional*): global seed.

    Returns:
        `Prompt` with `input_ids` `[1, T]`.
    """
    if task not in TASKS:
        raise ValueError(f"unknown profiling task {task!r}; choose from {', '.join(TASKS)}")
    answer = ""

    def rng():  # a fresh generator each time: the overhead probe and the real prompt draw the same
        return _rng(task, sample, seed)

    if task == "kjv-continue":
        def make(n):
            doc = _document(tokenizer, n, rng())
            return _wrap(tokenizer, "Continue the following text from exactly where it stops, in the same style, "
                                    "for several paragraphs.\n\n" + doc)
    elif task == "kjv-recall":
        def make(n):
            r = rng()
            doc = _document(tokenizer, n, r)
            words = doc.split()
            start = int(len(words) * (0.1 + 0.2 * r.random()))
            quote = " ".join(words[start : start + 16])
            return _wrap(tokenizer, doc + "\n\nThe text above contains a passage that begins with the words \""
                         + quote + "\". Repeat that passage word for word, starting with those words, and keep going "
                         "for as long as you can.")
    elif task == "kjv-summary":
        def make(n):
            doc = _document(tokenizer, n, rng())
            return _wrap(tokenizer, doc + "\n\nSummarise the text above in detail, chapter by chapter and in order, "
                                          "naming the people, places and events of each chapter.")
    elif task == "ruler-niah":
        r0 = rng()
        keys = r0.sample(_KEYS, 8)
        values = [str(r0.randrange(1_000_000, 10_000_000)) for _ in keys]
        needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values)]
        answer = " ".join(f"{k}: {v}" for k, v in zip(keys, values))

        def make(n):
            r = _rng(task + "/haystack", sample, seed)
            doc = _insert_at_depths(_document(tokenizer, n, r), needles, r)  # _fit's probe counts the needles
            return _wrap(tokenizer, "Some special magic numbers are hidden inside the following text. Make sure to "
                         "memorize them. I will quiz you about the numbers afterwards.\n\n" + doc + "\n\nWhat are all "
                         "the special magic numbers mentioned in the text above? For each one give its key and its "
                         "number, in the order they appear, and quote the sentence that follows it.",
                         "The special magic numbers mentioned in the text are:")
    else:  # ruler-vt
        r0 = rng()
        value = str(r0.randrange(10_000, 100_000))
        names = ["".join(r0.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(5)]
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 5)]
        answer = " ".join(names)

        def make(n):
            r = _rng(task + "/haystack", sample, seed)
            doc = _insert_at_depths(_document(tokenizer, n, r), chain, r)
            return _wrap(tokenizer, "Memorize and track the chain(s) of variable assignment hidden in the following "
                         "text.\n\n" + doc + f"\n\nQuestion: Find all variables that are assigned the value {value} in "
                         "the text above. Then explain the chain of assignments step by step.",
                         f"According to the chain(s) of variable assignment in the text above, the variables "
                         f"assigned the value {value} are:")

    ids = _fit(tokenizer, prompt_tokens, make)
    return Prompt(task, sample, torch.tensor([ids], dtype=torch.long), answer)
