"""`HeadProfile`: which (layer, KV head) pairs are unstable, as a versioned JSON file."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .errors import ProfileError

SCHEMA_VERSION = 1


def _profile_dir() -> Path:
    """Where bundled profiles are: `profiles/` of the checkout, or `fc_hf/profiles` of a wheel."""
    import importlib.util

    spec = importlib.util.find_spec("fc_hf.profiles")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    return Path(__file__).resolve().parent.parent / "profiles"


PROFILE_DIR = _profile_dir()


def attention_shape(config) -> tuple[int, int, int]:
    """(layers, KV heads per layer, head_dim) of a transformers config: the profile's fingerprint."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_attention_heads", None)
    if layers is None or heads is None:
        raise ProfileError(
            f"{type(config).__name__} has no num_hidden_layers/num_attention_heads: FlexiCache needs a decoder "
            "with attention layers."
        )
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return int(layers), int(kv_heads), int(head_dim)


def _readable_json(d: dict) -> str:
    """One line per key (and per key of `extra`), each value compact: reviewable diffs, small files."""

    def block(obj: dict, indent: str) -> str:
        lines = []
        for k, v in obj.items():
            body = block(v, indent + " ") if isinstance(v, dict) and v and k == "extra" else json.dumps(v)
            lines.append(f"{indent}{json.dumps(k)}: {body}")
        return "{\n" + ",\n".join(lines) + "\n" + indent[:-1] + "}"

    return block(d, " ")


@dataclass
class HeadProfile:
    """The model's unstable KV heads, plus how they were found.

    Args:
        num_layers (`int`): decoder layers of the model.
        num_kv_heads (`int`): KV heads per layer.
        unstable (`set[tuple[int, int]]`): (layer, kv_head) pairs re-ranked every step.
        head_dim (`int`, *optional*): head dimension (part of the fingerprint when known).
        model_id (`str`, *optional*): model name or path, and `revision` when known.
        extra (`dict`, *optional*): what the profiler recorded (tasks, per-head TS, overlap matrix, ...).
    """

    num_layers: int
    num_kv_heads: int
    unstable: set[tuple[int, int]]
    head_dim: int | None = None
    model_id: str | None = None
    revision: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self):
        def pair(p):
            if len(p) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in p):
                raise ProfileError(f"HeadProfile.unstable entries must be [layer, kv_head] integer pairs, got {p!r}.")
            return int(p[0]), int(p[1])

        self.unstable = {pair(tuple(p)) for p in self.unstable}
        bad = [(l, h) for l, h in self.unstable if not (0 <= l < self.num_layers and 0 <= h < self.num_kv_heads)]
        if bad:
            raise ProfileError(
                f"HeadProfile lists heads outside the model's {self.num_layers} layers x {self.num_kv_heads} KV heads: "
                f"{sorted(bad)[:5]}"
            )

    @classmethod
    def from_unstable(cls, config, pairs: Iterable[tuple[int, int]], **kwargs) -> "HeadProfile":
        """Build a profile by hand from a model config and a list of unstable (layer, kv_head) pairs."""
        layers, kv_heads, head_dim = attention_shape(config)
        model_id = kwargs.pop("model_id", getattr(config, "_name_or_path", None) or None)
        return cls(layers, kv_heads, set(map(tuple, pairs)), head_dim=head_dim, model_id=model_id, **kwargs)

    def check(self, config) -> None:
        """Raise a clear `ProfileError` unless this profile was made for a model of `config`'s attention shape."""
        layers, kv_heads, head_dim = attention_shape(config)
        mine = (self.num_layers, self.num_kv_heads, self.head_dim or head_dim)
        if mine != (layers, kv_heads, head_dim):
            raise ProfileError(
                f"Head profile for {self.model_id or 'an unknown model'} has (layers, kv_heads, head_dim)={mine}, but "
                f"the model has {(layers, kv_heads, head_dim)}. Use the profile made for this model (see profiles/README.md) "
                "or make one with `flexicache profile --model ...`."
            )

    # -- files ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["unstable"] = sorted([list(p) for p in self.unstable])
        d["fingerprint"] = {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim}
        return d

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_readable_json(self.to_dict()) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path, config=None) -> "HeadProfile":
        """Read a profile file; with `config`, also check it fits that model."""
        path = Path(path)
        if not path.exists() and path.suffix != ".json" and (PROFILE_DIR / f"{path}.json").exists():
            path = PROFILE_DIR / f"{path}.json"  # a bundled profile by name, e.g. "smollm2-135m-instruct"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ProfileError(f"No head profile at {path}. Bundled profiles live in {PROFILE_DIR}.") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ProfileError(f"Head profile {path} is not valid JSON ({e}); regenerate it with `flexicache profile`.") from None
        if not isinstance(raw, dict):
            raise ProfileError(f"Head profile {path} must hold a JSON object, got {type(raw).__name__}.")
        version = raw.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ProfileError(
                f"Head profile {path} has schema_version={version!r}; this FlexiCache reads version {SCHEMA_VERSION}. "
                "Regenerate it with `flexicache profile`."
            )
        try:
            profile = cls(
                num_layers=int(raw["num_layers"]),
                num_kv_heads=int(raw["num_kv_heads"]),
                unstable={tuple(p) for p in raw["unstable"]},
                head_dim=raw.get("head_dim"),
                model_id=raw.get("model_id"),
                revision=raw.get("revision"),
                extra=raw.get("extra") or {},
            )
        except (KeyError, TypeError, ValueError) as e:
            detail = str(e) if isinstance(e, ProfileError) else repr(e)
            raise ProfileError(f"Head profile {path} is missing or has a malformed field: {detail}") from None
        if config is not None:
            profile.check(config)
        return profile
