"""`FlexiCache`: a transformers `Cache` whose full-attention layers are FlexiCache layers."""

from __future__ import annotations

import copy
import logging

import torch
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import reports
from .compat import call_with_accepted
from .config import FlexiCacheConfig
from .errors import FlexiCacheError
from .grad_modes import storage_mode, stored_kv_output
from .attention import NAME as ATTENTION_NAME
from .forward_state import ForwardState
from .layer import NOT_FLEXICACHE, FlexiCacheLayer
from .ledger import DeviceLedger
from .online import OnlineClassifier, check_auto_config
from .profile import HeadProfile, attention_shape
from .room import Room
from .speculative import assisted_loop, check_auto_profile, check_loop_start, in_prefill

logger = logging.getLogger("fc_hf")

_FULL = ("full_attention",)
_SLIDING = ("sliding_attention", "chunked_attention")


def _dense_bytes(layer) -> int:
    """Bytes of a transformers layer's K/V tensors (0 before its first update)."""
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if keys is None or values is None:
        return 0
    return keys.numel() * keys.element_size() + values.numel() * values.element_size()


def _layer_types(text_config) -> list[str]:
    n = text_config.num_hidden_layers
    types = getattr(text_config, "layer_types", None)
    if types is None:
        window = getattr(text_config, "sliding_window", None)
        if getattr(text_config, "use_sliding_window", True) is False:
            window = None
        types = ["sliding_attention" if window is not None else "full_attention"] * n
    return list(types)


class FlexiCache(Cache):
    """Stability-aware sparse KV cache with a host tier for stable heads (see SPEC.md §2).

    Args:
        config (`PretrainedConfig`): the model's config (its text config is used).
        cache_config (`FlexiCacheConfig`, *optional*): algorithm settings; defaults to `FlexiCacheConfig()`.
        profile (`HeadProfile` or `"auto"`, *optional*): unstable (layer, kv_head) pairs. None: every head unstable
            (Quest). "auto": classified online from this run's first `warmup_steps` (`fc_hf/online.py`).
        max_cache_len (`int`, *optional*): tokens per sequence the cache holds without growing (like `StaticCache`'s):
            its tensors are allocated for this many at the first prompt, so a decode step never reallocates and
            `generate` can compile it. None (default): what `generate` will need (prompt + `max_new_tokens`), read
            from the call that fills the cache; outside `generate`, the prompt plus `DEFAULT_DECODE_ROOM` tokens. An
            eager step grows the cache when full (new tensors); a compiled step cannot, and raises. Sized by
            `generate` (None), a later prompt in `generate` (a new turn, a reset cache) grows it first to what that
            call will hold.

    Example:
        >>> from fc_hf import FlexiCache, FlexiCacheConfig, register
        >>> register()
        >>> model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="flexicache")
        >>> cache = FlexiCache(model.config, FlexiCacheConfig(token_budget=1024))
        >>> out = model.generate(**inputs, cache=cache, max_new_tokens=64)  # past_key_values=cache before 5.24
    """

    def __init__(self, config, cache_config: FlexiCacheConfig | None = None, profile: HeadProfile | str | None = None,
                 max_cache_len: int | None = None):
        cfg = cache_config or FlexiCacheConfig()
        if not isinstance(cfg, FlexiCacheConfig):
            raise TypeError(f"cache_config must be a FlexiCacheConfig, got {type(cfg).__name__}.")
        if getattr(config, "is_encoder_decoder", False):  # T5, BART, Whisper, ...: cross-attention is not paged
            raise FlexiCacheError(
                f"{type(config).__name__} is an encoder-decoder model; FlexiCache serves decoder-only causal LMs. "
                "Use transformers' EncoderDecoderCache/DynamicCache for this model."
            )
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        num_layers, num_kv_heads, _ = attention_shape(text)
        auto = isinstance(profile, str) and profile == "auto"
        if profile is None or auto:
            unstable = {(l, h) for l in range(num_layers) for h in range(num_kv_heads)}
            if auto:
                check_auto_config(cfg)
            else:
                logger.info("FlexiCache: no head profile given, every head is treated as unstable (Quest behaviour).")
        else:
            if not isinstance(profile, HeadProfile):
                raise TypeError(f"profile must be a HeadProfile, 'auto' or None, got {profile!r}.")
            profile.check(text)
            unstable = profile.unstable
        for l, h in cfg.streaming_heads:
            if not (0 <= l < num_layers and 0 <= h < num_kv_heads):
                raise ValueError(f"streaming head {(l, h)} is outside the model's {num_layers}x{num_kv_heads} KV heads.")

        if max_cache_len is not None and (isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int)
                                          or max_cache_len < 1):
            raise ValueError(f"max_cache_len must be a positive number of tokens or None, got {max_cache_len!r}.")
        self.cache_config = cfg
        self.profile = profile
        self._model_text_config = text
        # What the FlexiCache layers are handed (they never reach back to the cache): the room they share, the forward
        # they run in, the device bytes they hold, and with profile="auto" the classifier they report to.
        self.room = Room(cfg, max_cache_len)
        self.forward = ForwardState(cfg)
        self.ledger = DeviceLedger()  # device KV bytes now and at the peak (`memory_report`)
        kinds = _layer_types(text)
        self.auto: OnlineClassifier | None = None  # profile="auto": the warm-up trace and its classification
        if auto:
            self.auto = OnlineClassifier([i for i, kind in enumerate(kinds) if kind in _FULL], num_kv_heads, cfg)
        layers = []
        for idx, kind in enumerate(kinds):
            if kind in _SLIDING:
                window = getattr(text, "sliding_window", None) or getattr(text, "attention_chunk_size", None)
                layers.append(DynamicSlidingWindowLayer(sliding_window=window))
            elif kind in _FULL:
                layers.append(
                    FlexiCacheLayer(
                        idx,
                        num_kv_heads,
                        cfg,
                        unstable={h for l, h in unstable if l == idx},
                        streaming={h for l, h in cfg.streaming_heads if l == idx},
                        room=self.room,
                        forward=self.forward,
                        ledger=self.ledger,
                        auto=self.auto,
                        model_config=text,
                    )
                )
            else:
                raise FlexiCacheError(
                    f"Layer {idx} of {type(text).__name__} has type {kind!r}; FlexiCache supports full and "
                    "sliding-window attention layers only. Use DynamicCache for this model."
                )
        super().__init__(layers=layers)
        self._first_flexi_idx = next((i for i, l in enumerate(layers) if isinstance(l, FlexiCacheLayer)), None)
        self.room.layers = self.flexi_layers
        if not self.flexi_layers:
            logger.warning("FlexiCache: this model has no full-attention layers; it behaves like DynamicCache.")

    def __deepcopy__(self, memo):
        """An independent cache (`copy.deepcopy` of a prefilled cache per question), its tensors copied without autograd
        and outside inference mode, as the cache's own state always is (fc_hf/grad_modes.py)."""
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        with storage_mode():
            new.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items()})
        return new

    # -- transformers Cache API ------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, cache_kwargs=None, *args, **kwargs):
        if not self.layers:
            raise FlexiCacheError("This FlexiCache was released (cache.release()); create a new FlexiCache for this call.")
        if layer_idx == 0:  # a forward starts: every refusal of FlexiCache's comes now, before any layer writes
            self._start_forward(key_states, cache_kwargs, kwargs)
        layer = self.layers[layer_idx]
        if isinstance(layer, FlexiCacheLayer):
            with storage_mode():  # the pages record no autograd and are no inference tensors (fc_hf/grad_modes.py)
                if layer.is_initialized:
                    if not torch.compiler.is_compiling():  # room for these tokens before the step's context is made
                        self.room.ensure(layer.length + key_states.shape[2])
                    layer.context = self.forward.context(layer)
                keys, values = layer.update(key_states, value_states)
                read_back = keys is not key_states and not layer.pending  # tokens on a filled cache
            if read_back:  # attention over stored K/V: no gradient flows back through them
                observer = getattr(keys, "fc_observe", None)
                keys = stored_kv_output(keys, key_states, value_states)
                values = stored_kv_output(values, key_states, value_states)
                if observer is not None:
                    keys.fc_observe = observer
            return keys, values
        held = _dense_bytes(layer)  # a dense or sliding-window layer: its K/V count towards the device bytes too
        out = super().update(key_states, value_states, layer_idx)
        self.ledger.resized(held, _dense_bytes(layer))
        return out

    def _start_forward(self, key_states: torch.Tensor, cache_kwargs, kwargs) -> None:
        """What a forward's first layer does before anything is written: refuse what FlexiCache cannot serve, and tell
        a prompt from decode steps (one token on a filled cache is a decode step, unless generate feeds it as a prompt,
        `in_prefill`)."""
        self.forward.begin(prefilling=False)
        if torch.compiler.is_compiling():  # a compiled forward is a decode step (`is_compileable`): nothing to check
            return
        self._check_layers_agree()
        self._check_use_cache(cache_kwargs, kwargs)
        first = self._first_flexi_idx
        if first is None:
            return
        layer = self.layers[first]
        t = key_states.shape[2]
        if layer.is_initialized and key_states.shape[0] != layer.batch and layer.length == 0:
            self._free_for_another_batch()
        self.forward.prefilling = t == 1 and layer.is_initialized and layer.length > 0 and in_prefill()
        if layer.is_initialized:
            layer.check_same_kind(key_states, device=False)  # layers may sit on different devices (device_map)
        if layer.prompt_tokens(t) < t:
            self._check_attention_function()

    def _free_for_another_batch(self) -> None:
        """An empty cache (reset, or never filled) takes a batch of another size: every layer holds nothing (checked by
        `_check_layers_agree`), so the FlexiCache layers drop their tensors and allocate them at this prompt for the new
        batch, with a capacity chosen for it (`max_device_pages` depends on the batch)."""
        for layer in self.flexi_layers:
            layer.free()
        self.room.choose_again()
        self.forward.release()

    def _check_attention_function(self) -> None:
        """Decode steps need FlexiCache's attention function: refuse, before anything is written, a model whose config
        names one of transformers' own ("eager", "sdpa", flash, flex, ...). A function registered under another name
        may wrap FlexiCache's (an evaluation's recorder does); if it does not, the decode placeholder refuses."""
        impl = getattr(self._model_text_config, "_attn_implementation", None)
        if not isinstance(impl, str) or impl == ATTENTION_NAME:
            return
        function = ALL_ATTENTION_FUNCTIONS.get(impl) if impl in ALL_ATTENTION_FUNCTIONS else None
        if impl == "eager" or getattr(function, "__module__", "").startswith("transformers."):
            raise FlexiCacheError(NOT_FLEXICACHE.format(impl=impl) + " Nothing was written.")

    def _check_layers_agree(self) -> None:
        """At the start of a forward, refuse a cache whose layers hold different numbers of tokens: a forward that
        raised part-way (after some layers had appended its tokens) left it so, and attending from it would either fail
        deep inside attention or run with the layers a token apart."""
        if torch.compiler.is_compiling():
            return
        lengths = [self._layer_length(layer) for layer in self.layers]
        if len(set(lengths)) > 1:
            runs, start = [], 0
            for i in range(1, len(lengths) + 1):
                if i == len(lengths) or lengths[i] != lengths[start]:
                    runs.append(f"layer {start}: {lengths[start]}" if i - start == 1
                                else f"layers {start}-{i - 1}: {lengths[start]}")
                    start = i
            raise FlexiCacheError(
                f"This FlexiCache's layers hold different numbers of tokens ({'; '.join(runs)}): an earlier forward "
                "raised after some layers had stored its tokens. The cache cannot continue from there; build a new "
                "FlexiCache (or a copy taken before that forward) and run the forward again. Nothing was written."
            )

    def _check_use_cache(self, cache_kwargs, kwargs) -> None:
        """Refuse a forward run with `use_cache=False` on a filled cache (generate re-feeds the whole sequence then,
        which would be stored twice), before any layer writes. transformers 5.24 hands the layer's kwargs over."""
        found = []
        for extra in (cache_kwargs, kwargs.get("kwargs"), kwargs):
            if isinstance(extra, dict) and "use_cache" in extra:
                found.append(extra["use_cache"])
        if found and found[0] is False and self.get_seq_length(self._first_flexi_idx or 0) > 0:
            raise FlexiCacheError(
                f"This forward runs with use_cache=False on a FlexiCache that holds {self.get_seq_length()} tokens: "
                "generate re-feeds the whole sequence each step then, and the cache would store it twice. Keep "
                "use_cache=True (the default) with a FlexiCache, or pass no cache. Nothing was written."
            )

    # -- speculative decoding (`fc_hf/speculative.py`) ---------------------------------------------
    def activate_past_recording(self, recurrent_states_to_keep: int | None = None, **kwargs) -> None:
        """Keep what `crop(-n)` needs to take decode tokens back exactly; transformers' assisted decoding and prompt
        lookup call this before their loop. Until recording ends, every token after the prompt is a decode step,
        however many a forward brings.

        `recurrent_states_to_keep` (transformers >= 5.25) is how many steps of recurrent state a linear-attention layer
        keeps for `crop`. FlexiCache's layers are attention layers: like transformers' own they hold no recurrent state
        (`get_recurrent_states_to_keep` is 0 for them) and mark every decode token, so any number of drafts can be taken
        back; the value is passed on to the other layers (sliding-window ones) as 5.25 does."""
        check_auto_profile(self.auto)
        held = self.get_seq_length(self._first_flexi_idx or 0)
        prompt, mode = assisted_loop()
        if prompt is not None or mode is not None or not held:  # in the loop, or a start on an empty cache
            check_loop_start(prompt, held, mode)
            self.forward.loop_prompt_end = prompt.shape[1]
        extra = dict(kwargs, recurrent_states_to_keep=recurrent_states_to_keep)
        for layer in self.layers:  # sliding-window layers keep their states until `crop`; ours mark
            if hasattr(layer, "activate_past_recording"):
                call_with_accepted(layer.activate_past_recording, extra)

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """Steps of recurrent state a layer keeps while recording (transformers >= 5.25's hook; None: the most of any
        layer): 0 for FlexiCache's attention layers and for every layer not recording."""
        indices = range(len(self.layers)) if layer_idx is None else [layer_idx]
        kept = [getattr(self.layers[i], "recurrent_states_to_keep", 0) or 0 for i in indices
                if getattr(self.layers[i], "record_past", False)]
        return max(kept, default=0)

    def deactivate_past_recording(self) -> None:
        """End recording: the tokens so far stay, and several tokens on a filled cache attend densely again (a new
        turn). `generate` ends it at the start of each call given this cache."""
        for layer in self.layers:
            if isinstance(layer, FlexiCacheLayer):
                layer.commit()
            if hasattr(layer, "record_past"):
                layer.record_past = False
        self.forward.loop_prompt_end = None

    @property
    def _is_user_defined(self) -> bool:
        return self.__dict__.get("_user_defined", False)

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        # transformers' generate sets this on a cache it is given, at the start of every call: an assisted loop before
        # it has ended (transformers leaves recording on after one).
        self.__dict__["_user_defined"] = value
        self.deactivate_past_recording()

    def crop(self, tokens_to_remove: int) -> None:
        """Take back the last `-tokens_to_remove` tokens exactly (transformers' assisted decoding after each
        verification; 0 keeps them all): the cache is then as if it had never seen them. Only decode tokens fed since
        the last crop while recording can be taken back; anything else raises before any layer changes."""
        for layer in self.flexi_layers:
            layer.crop_mark(tokens_to_remove)
        for layer in self.layers:
            if isinstance(layer, FlexiCacheLayer):
                layer.crop(tokens_to_remove)
            else:
                held = _dense_bytes(layer)
                layer.crop(tokens_to_remove)
                self.ledger.resized(held, _dense_bytes(layer))

    @property
    def flexi_layers(self) -> list[FlexiCacheLayer]:
        return [l for l in self.layers if isinstance(l, FlexiCacheLayer)]

    # -- reports (`fc_hf/reports.py`) -------------------------------------------------------------------
    def memory_report(self) -> dict[str, int]:
        """Bytes actually allocated per tier (not formulas), plus what a DynamicCache would hold (`reports.memory`)."""
        return reports.memory(self)

    def stats(self) -> dict:
        """Counters of the decode so far: re-ranks, promotions, offloads, pages read (`reports.counters`)."""
        return reports.counters(self)

    @property
    def observes_prefill(self) -> bool:
        """True when this cache needs the prompt's queries at prefill (profile="auto" with `warmup_steps=0`): K/V
        handed over without the prefill forward (`update` alone) leave it nothing to classify from."""
        return self.auto is not None and self.auto.observing and not self.auto.done

    def profile_found(self) -> HeadProfile | None:
        """The `HeadProfile` `profile="auto"` classified (save it with `.save(path)` to reuse it); None before then."""
        if self.auto is None:
            raise FlexiCacheError('profile_found() is for a FlexiCache built with profile="auto".')
        if self.auto.unstable is None:
            return None
        return HeadProfile.from_unstable(self._model_text_config, self.auto.unstable, extra=self.auto.extra())

    def release(self) -> None:
        """Free every tensor this cache holds; the cache cannot be used afterwards."""
        for layer in self.layers:
            if isinstance(layer, FlexiCacheLayer):
                layer.free()
            else:
                self.ledger.resized(_dense_bytes(layer), 0)
                layer.keys = layer.values = None
        self.layers = self.room.layers = []
        self.forward.release()
        if self.auto is not None:
            self.auto.topk, self.auto.valid = {}, {}

    def reset(self) -> None:
        """Empty the cache for a new batch of prompts, keeping its tensors (same addresses: a compiled decode step is
        reused, not recompiled; a pipeline can pass one cache to every call). A batch of another size is allocated
        afresh at its prompt (and compiled afresh: its shapes are new). The peak device bytes restart from what the
        cache holds now."""
        self.deactivate_past_recording()
        for layer in self.layers:
            if isinstance(layer, FlexiCacheLayer):
                layer.reset_state()
            elif hasattr(layer, "reset"):
                layer.reset()
        self.forward.begin(prefilling=False)
        self.ledger.restart_peak()

    # -- tokens held and room for them -------------------------------------------------------------------
    def _layer_length(self, layer) -> int:
        return layer.get_seq_length() if getattr(layer, "is_initialized", False) else 0

    @property
    def capacity(self) -> int:
        """Tokens per sequence every FlexiCache layer has room for (0: nothing allocated yet; `fc_hf/room.py`)."""
        return self.room.capacity

    @property
    def max_cache_len(self) -> int | None:
        """The capacity asked for (`None`: sized by `generate`). Stored apart: a read-only property of `Cache` on
        transformers 5.17."""
        return self.room.max_cache_len

    @property
    def is_compileable(self) -> bool:
        """generate compiles the decode step of a FlexiCache (its shapes and addresses are fixed, it never syncs):
        not its prompt (asked inside `GenerationMixin._prefill`, prefill chunks run eagerly), not while drafts are
        recorded (speculative decoding), not during `profile="auto"`'s warm-up (it traces on the host), not with
        sliding-window layers (transformers' own are not compileable)."""
        if not self.layers or (self.auto is not None and not self.auto.done):
            return False
        if not torch.compiler.is_compiling() and in_prefill():  # asked from generate's prompt stage
            return False
        return all(getattr(layer, "is_compileable", False) for layer in self.layers)

    def get_seq_length(self, layer_idx: int = 0):
        layer = self.layers[layer_idx] if self.layers else None
        if layer is None:
            return 0
        return layer.get_seq_length()
