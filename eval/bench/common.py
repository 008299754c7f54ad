"""Shared pieces of the benchmark suite: model shapes, head profiles, random prefills, timers, RSS, sizes.

Every benchmark builds its models from a config (random weights, seeded), so it needs no download
and runs at any length. Decode speed does not depend on the weights' values, so a random-weight
model of a real model's shape times the same as the real one. Caches for a method name come from
the harness's `methods` (`make_cache`; `bench_cache` gives a FlexiCache the capacity of the tokens a case holds).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

# The models of the suite. "smollm2" is SmolLM2-135M's exact shape; "llama8b" keeps Llama-3.1-8B's
# attention *and* per-layer MLP shape but only `layers` decoder layers (and a 32k vocabulary), so
# the ratio of KV bytes to weight bytes per layer is the real model's. "smollm2-tiny" has SmolLM2's
# attention shape (30 layers x 3 KV heads x 64) with a tiny hidden/MLP size, for memory sweeps to 32k.
SHAPES = {
    "smollm2": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5,
    ),
    "llama8b": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-5,
    ),
    "smollm2-tiny": dict(
        vocab_size=256, hidden_size=72, intermediate_size=64, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, tie_word_embeddings=True, rope_theta=100000.0,
    ),
    # Llama-3.1-8B's attention shape (32 / 8 heads x 128) with a tiny hidden/MLP size: `flexicache bench ops`.
    "llama8b-tiny": dict(
        vocab_size=256, hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, rope_theta=500000.0,
    ),
    # For smoke tests only.
    "tiny": dict(
        vocab_size=97, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
    ),
}


def parse_sizes(text: str) -> list[int]:
    """"4k,8k,512" -> [4096, 8192, 512]: a comma list of sizes, "k" meaning 1024."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if part:
            out.append(int(float(part[:-1]) * 1024) if part.endswith("k") else int(part))
    return out


def _shipped_profile() -> Path:
    from fc_hf.profile import PROFILE_DIR  # the checkout's profiles/ or the wheel's fc_hf/profiles

    return Path(PROFILE_DIR) / "smollm2-135m-instruct.json"


def model_config(name: str, max_positions: int = 65536, layers: int | None = None):
    """A `LlamaConfig` of one of `SHAPES`, with room for `max_positions` positions."""
    from transformers import LlamaConfig

    kw = dict(SHAPES[name])
    if layers is not None:
        kw["num_hidden_layers"] = layers
    return LlamaConfig(max_position_embeddings=max_positions, **kw)


def build_model(config, dtype=torch.float32, device="cpu", seed: int = 0):
    """A random-weight causal LM of `config` in eval mode (FlexiCache's attention registered)."""
    from transformers import AutoModelForCausalLM

    from fc_hf import register

    register()
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def spread_profile(config, fraction: float = 0.25, model_id: str | None = None):
    """A `HeadProfile` marking `round(fraction * layers * kv_heads)` heads unstable, spread evenly.

    Head i of the flattened (layer, kv_head) order is unstable when it is the `floor(j / fraction)`-th
    for some j, so every layer region gets its share and the head index varies from layer to layer.
    """
    from fc_hf import HeadProfile
    from fc_hf.profile import attention_shape

    layers, kv_heads, _ = attention_shape(config)
    total = layers * kv_heads
    count = int(round(fraction * total))
    picks = {min(total - 1, int(j * total / count)) for j in range(count)} if count else set()
    pairs = [(i // kv_heads, i % kv_heads) for i in sorted(picks)]
    return HeadProfile.from_unstable(config, pairs, model_id=model_id or "synthetic-spread",
                                     extra={"source": f"spread_profile(fraction={fraction})"})


def bench_profile(config, fraction: float = 0.25, prefer_shipped: bool = True):
    """The shipped SmolLM2 profile when it exists and fits `config`, else `spread_profile`; plus a label."""
    from fc_hf import HeadProfile
    from fc_hf.errors import ProfileError

    shipped = _shipped_profile()
    if prefer_shipped and shipped.exists():
        try:
            return HeadProfile.load(shipped, config), f"shipped {shipped.name}"
        except ProfileError:
            pass
    prof = spread_profile(config, fraction)
    return prof, f"spread {len(prof.unstable)}/{prof.num_layers * prof.num_kv_heads} heads"


def unstable_share(profile, config) -> float:
    from fc_hf.profile import attention_shape

    layers, kv_heads, _ = attention_shape(config)
    return 1.0 if profile is None else len(profile.unstable) / (layers * kv_heads)


def ingest_random_kv(cache, config, batch: int, length: int, dtype=torch.float32, device="cpu", seed: int = 1):
    """Fill `cache` as a prefill of `length` tokens would, with random K/V, one layer at a time.

    A real prefill calls `cache.update(k, v, layer)` once per layer with `[B, Hkv, L, D]` tensors;
    this does exactly that, without running the model over `length` tokens (minutes on a CPU at 32k).
    Only one layer's K/V exists outside the cache at any time, as in a real prefill.
    """
    from fc_hf.profile import attention_shape

    layers, kv_heads, head_dim = attention_shape(config)
    gen = torch.Generator(device=device).manual_seed(seed)
    for layer in range(layers):
        k = torch.randn(batch, kv_heads, length, head_dim, generator=gen, device=device, dtype=torch.float32).to(dtype)
        v = torch.randn(batch, kv_heads, length, head_dim, generator=gen, device=device, dtype=torch.float32).to(dtype)
        cache.update(k, v, layer)
        del k, v


def bench_cache(method: str, config, budget: int, profile=None, base=None, tokens: int | None = None):
    """A fresh cache of `method` to fill by hand (`methods.make_cache`, a `DynamicCache` for dense), a FlexiCache
    allocated for `tokens` per sequence (`max_cache_len`), as generate sizes it from the prompt and the new tokens.

    A FlexiCache's tensors are sized by its capacity, not by the tokens it holds (`memory_report` counts the
    allocation, and a ranking scores every page of it), so a cache filled outside generate with the default capacity
    (the prompt plus `fc_hf.room.DEFAULT_DECODE_ROOM`) would report and score room it never uses."""
    from fc_hf.cache import FlexiCache

    from ..methods import make_cache, method_config, method_profile

    if method in ("dense", "offload"):
        return make_cache(method, config, budget, profile, base=base, dense_cache=True)
    return FlexiCache(config, method_config(method, budget, config, base), method_profile(method, config, profile),
                      max_cache_len=tokens)


def flexicache_model(model_name: str, tokens: int, layers: int | None = None):
    """A random-weight model of `model_name` (`layers` of them, all with None) set up for FlexiCache, with positions for
    `tokens`: `(config, model, profile, cache keyword)`; the profile is the shipped one for the whole SmolLM2."""
    from fc_hf.compat import cache_kwarg

    from ..methods import prepare_model

    config = model_config(model_name, max_positions=max(8192, tokens + 64), layers=layers)
    model = build_model(config)
    prepare_model(model, "flexicache")
    profile, _ = bench_profile(config, 0.25, prefer_shipped=model_name == "smollm2" and layers is None)
    return config, model, profile, cache_kwarg(model)


def filled_flexicache(config, profile, budget: int, batch: int, length: int, tokens: int):
    """A FlexiCache with room for `tokens` per sequence, `length` random tokens written through `cache.update`."""
    cache = bench_cache("flexicache", config, budget, profile, base=base_config(None, budget), tokens=tokens + 1)
    ingest_random_kv(cache, config, batch, length)
    return cache


def base_config(options: dict | None, budget: int | None = None):
    """The `FlexiCacheConfig` `make_cache` starts from (`base`): the defaults with `options` set, as in ops.py.

    Built at the case's `budget` (unless the options set one), so options checked against the budget (e.g.
    `refine_pages` >= K) are checked against the budget the case runs at."""
    from fc_hf.config import FlexiCacheConfig

    if not options:
        return None
    if budget is not None and "token_budget" not in options:
        options = {**options, "token_budget": int(budget)}
    return FlexiCacheConfig(**options)


def run_worker(entry: str, spec: dict, timeout: int, env: dict | None = None) -> tuple[list[dict], int | str]:
    """Run `python -m fc_hf.eval.bench <entry> <spec as JSON>` in a fresh interpreter: (the JSON lines it printed,
    its return code or "timeout"). Whatever finished before a failure or the timeout is kept."""
    cmd = [sys.executable, "-m", "fc_hf.eval.bench", entry, json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, timeout=timeout, env=env)
        stdout, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:
        stdout, rc = (e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout) or "", "timeout"
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")], rc


def decode_step(model, cache, kwarg: str, token: torch.Tensor, position: int,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """One greedy decode step at absolute `position`; returns the next token `[B, 1]`.

    `attention_mask` (`[B, >= position + 1]`, optional): the padding mask of a left-padded batch; its first
    `position + 1` columns are passed."""
    pos = torch.tensor([position], device=token.device)
    mask = {} if attention_mask is None else {"attention_mask": attention_mask[:, : position + 1]}
    out = model(input_ids=token, use_cache=True, cache_position=pos, logits_to_keep=1, **mask, **{kwarg: cache})
    return out.logits[:, -1:].argmax(-1)


# -- memory -------------------------------------------------------------------------------------
def _status_kb(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def release_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS, so the next case starts clean."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


class PeakRSS:
    """Peak resident memory of a block, relative to the RSS at its start (Linux: VmHWM reset via clear_refs)."""

    def __enter__(self):
        release_memory()
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self.resettable = True
        except OSError:
            self.resettable = False
        self.start_kb = _status_kb("VmRSS")
        self.peak_mb = None
        return self

    def __exit__(self, *exc):
        hwm = _status_kb("VmHWM")
        if self.resettable and hwm is not None and self.start_kb is not None:
            self.peak_mb = (hwm - self.start_kb) / 1024
        return False


# -- timing --------------------------------------------------------------------------------------
def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def now(device) -> float:
    sync(device)
    return time.perf_counter()


def environment() -> dict:
    """Where and how a result was measured."""
    import transformers

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        info["loadavg_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def write_json(path: Path, data) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
