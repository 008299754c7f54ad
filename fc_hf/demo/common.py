"""What both demos share: quiet output, a clock of generated tokens, teacher-forced agreement, the shipped profile."""

from __future__ import annotations

import argparse
import contextlib
import time
import warnings

import torch
import transformers
from transformers import StoppingCriteria

from ..assets import DEFAULT_MODEL, load_model
from ..attention import register
from ..compat import cache_kwargs
from ..errors import ProfileError
from ..profile import PROFILE_DIR, HeadProfile


@contextlib.contextmanager
def quiet():
    """No Python warnings, no transformers logging below errors, no progress bars; restored afterwards."""
    logging = transformers.utils.logging
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


class StepClock(StoppingCriteria):
    """Records when new tokens are ready and how many there are (the first call comes right after the prefill; a
    verification forward of assisted decoding brings several tokens at once); never stops anything."""

    def __init__(self):
        self.times: list[float] = []
        self.lengths: list[int] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        self.lengths.append(input_ids.shape[1])
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def decode_tokens_per_s(self) -> float:
        """Tokens after the first call over the seconds after it."""
        if len(self.times) < 2:
            return float("nan")
        return (self.lengths[-1] - self.lengths[0]) / (self.times[-1] - self.times[0])


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int:
    """The first index where two token sequences differ (the shorter one's length if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a.tolist(), b.tolist())) if x != y), min(len(a), len(b)))


def divergence_line(first_diff: int, dense_logits: torch.Tensor, agree: int, n: int) -> str:
    """Where two greedy outputs part, and how close dense's own choice was there."""
    if first_diff >= n:
        return f"The two outputs are identical over all {n} tokens."
    top2 = torch.log_softmax(dense_logits[first_diff], dim=-1).topk(2).values
    margin = float(top2[0] - top2[1])
    why = " - a near tie, which any change in attention may flip" if margin < 0.5 else ""
    return (f"They first differ at token {first_diff}, where dense's two likeliest next tokens were {margin:.2f} nats "
            f"apart{why}; from there each continues its own text (teacher-forced on dense's tokens, FlexiCache "
            f"picks dense's token at {agree}/{n} steps).")


def teacher_forced_agreement(model, ids, target, cache) -> int:
    """Feed `ids`, then dense's own continuation `target` token by token; count the steps where the model with
    `cache` predicts dense's next token. Free-running outputs part for good at the first near tie, so this is the
    fair per-token measure."""
    preds = []
    kwargs = cache_kwargs(model, cache)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, **kwargs)
        for t in range(len(target)):
            preds.append(int(out.logits[0, -1].argmax()))
            if t + 1 < len(target):
                out = model(input_ids=target[None, t : t + 1], use_cache=True, **kwargs)
    return sum(int(p == int(y)) for p, y in zip(preds, target))


def shipped_profile(model_name: str, config, path=None) -> tuple[HeadProfile | None, str]:
    """`(profile, note)`: the given or shipped head profile; None (every head unstable: Quest) with the reason when
    it cannot be used, so the demo still runs and says so."""
    profile_path = path or PROFILE_DIR / f"{model_name}.json"
    try:
        profile = HeadProfile.load(profile_path, config)
    except ProfileError as e:
        return None, f"no usable profile ({e}); every head unstable (Quest)"
    shown = path or f"profiles/{model_name}.json"  # not this machine's path
    return profile, f"profile {shown} ({len(profile.unstable)} unstable KV heads)"


def demo_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """The options both demos take: the model, the budget, the profile."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="bundled model name or local folder")
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--profile", default=None, help="head profile JSON (default: the bundled one for the model)")
    return p


def load_demo_model(args):
    """`(model, tokenizer, profile, note)`: the model with FlexiCache's attention, and its profile."""
    register()
    model, tokenizer = load_model(args.model, attn_implementation="flexicache")
    profile, note = shipped_profile(args.model, model.config, args.profile)
    return model, tokenizer, profile, note
