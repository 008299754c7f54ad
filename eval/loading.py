"""The model an evaluation runs on: a bundled model name or a local folder, in the dtype the command line names."""

from __future__ import annotations

from pathlib import Path

__all__ = ["DTYPES", "load_model"]

DTYPES = ("float32", "bfloat16", "float16")


def load_model(name: str, dtype: str = "float32"):
    """A bundled model name ("smollm2-135m-instruct", ...) or a local folder -> (model, tokenizer, folder).

    `folder` holds the tokenizer files (lm-eval's RULER generators want a path); the triple is the
    `model_bundle` every `run_*` function accepts instead of a name.
    """
    import torch

    from fc_hf import assets

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    folder = assets.model_path(name) if name in assets.MODELS else Path(name)
    model, tok = assets.load_model(name, dtype=torch_dtype)
    return model, tok, folder
