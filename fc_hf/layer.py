"""`FlexiCacheLayer`: one full-attention layer's cache, made of head groups.

Prompt tokens (a prompt, a prefill chunk, a new turn: `prompt_tokens`) return dense K/V for the model's own dense
attention. A decode step appends its token to the pages and returns a placeholder that carries this layer;
FlexiCache's attention function (`attention.py`) finds it there and runs score -> select -> sparse attention. Any other
attention function touching the placeholder raises, so a model not loaded with `attn_implementation="flexicache"` fails
loudly. While recording for speculative decoding, every token after the prompt is a decode step (fc_hf/verify.py).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from . import kernels
from .errors import FlexiCacheError
from .grad_modes import storage_mode
from .head_group import STABLE, STREAMING, UNSTABLE, HeadGroup
from .online import regroup
from .verify import VerifiedDecoding

_METADATA_OPS = {"__get__", "size", "dim", "__repr__", "__format__", "__len__", "numel", "is_floating_point"}

NOT_FLEXICACHE = (
    "FlexiCache decode step reached an attention function other than FlexiCache's (the model's "
    "attn_implementation is {impl!r}). Load the model with attn_implementation='flexicache' after "
    "`fc_hf.register()`, or call `model.set_attn_implementation('flexicache')`."
)

# torch.compile (dynamo) cannot trace the paged store or the placeholder; refuse instead of failing deep inside dynamo.
NO_COMPILE = (
    "FlexiCache does not work under torch.compile (its pages, block tables and tiers live outside the graph). "
    "Run generate on the uncompiled model (do not wrap `model.forward` in torch.compile, and do not combine "
    "FlexiCache with cache_implementation='static'); use StaticCache if you need a compiled decode."
)


class DecodePlaceholder(torch.Tensor):
    """Stands in for a layer's K/V at a decode step; only shape queries are allowed on it."""

    fc_layer: "FlexiCacheLayer"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if torch.compiler.is_compiling():  # dynamo wrapping the placeholder after a graph break
            raise FlexiCacheError(NO_COMPILE)
        if getattr(func, "__name__", "") in _METADATA_OPS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        layer = next((a.fc_layer for a in args if isinstance(a, DecodePlaceholder)), None)
        impl = layer.owner.attn_implementation_hint() if layer is not None else "not 'flexicache'"
        raise FlexiCacheError(NOT_FLEXICACHE.format(impl=impl))


def _placeholder(layer: "FlexiCacheLayer", batch: int, heads: int, length: int, dim: int, like: torch.Tensor):
    base = like.new_empty(()).expand(batch, heads, length, dim)
    ph = torch.Tensor._make_subclass(DecodePlaceholder, base)
    ph.fc_layer = layer
    return ph


class FlexiCacheLayer(VerifiedDecoding, CacheLayerMixin):
    """The FlexiCache store of one full-attention layer (never set `_layer_type` here; see SPEC §3)."""

    is_sliding = False
    is_croppable = True  # crop(-n) restores a mark (speculative decoding)
    is_compileable = False

    def __init__(self, layer_idx: int, num_kv_heads: int, cfg, unstable: set[int], streaming: set[int], owner):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_kv_heads = num_kv_heads
        self.cfg = cfg
        self.owner = owner  # the FlexiCache: decode-step counter, padding-mask cache, timings
        self.groups = self._make_groups(unstable, streaming)
        self.length = 0
        self.steps = 0  # decode steps seen by this layer
        self.pending = False  # a placeholder was handed out and not yet consumed by the attention function
        self.regrouped_after_step: int | None = None  # profile="auto": the step after which the heads were re-split
        self._init_verification()

    def _make_groups(self, unstable: set[int], streaming: set[int]) -> list[HeadGroup]:
        kinds = {
            STREAMING: sorted(streaming),
            UNSTABLE: sorted(unstable - streaming),
            STABLE: sorted(set(range(self.num_kv_heads)) - unstable - streaming),
        }
        return [HeadGroup(kind, heads, self.cfg, self.owner.timings, self.owner.workspace)
                for kind, heads in kinds.items() if heads]

    # -- transformers CacheLayerMixin ------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.shape[1] != self.num_kv_heads:  # else heads would be mis-grouped silently
            raise FlexiCacheError(
                f"FlexiCache layer {self.layer_idx} was built for {self.num_kv_heads} KV heads (the config's "
                f"num_key_value_heads) but the model's attention produced {key_states.shape[1]}. Build the cache "
                "from this model's own config (`FlexiCache(model.config, ...)`); if it already is, this architecture's "
                "attention does not match its config (e.g. multi-query attention under another name) and FlexiCache "
                "cannot serve it. The cache is still empty."
            )
        self.device, self.dtype = key_states.device, key_states.dtype
        self.batch, self.head_dim, self.value_dim = key_states.shape[0], key_states.shape[-1], value_states.shape[-1]
        for group in self.groups:
            group.init_store(self.batch, self.head_dim, self.value_dim, self.dtype, self.device, self.owner.ledger)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if torch.compiler.is_compiling():  # fullgraph=True traces into here
            raise FlexiCacheError(NO_COMPILE)
        t = key_states.shape[2]
        if self.pending:
            raise FlexiCacheError(NOT_FLEXICACHE.format(impl=self.owner.attn_implementation_hint()))
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        else:
            self.check_same_kind(key_states)
        prompt = self.prompt_tokens(t)
        auto = self.owner.auto
        if (auto is not None and prompt < t and self.length > 0 and self.regrouped_after_step is None
                and self.steps == auto.boundary):  # before a decode step: a prefill chunk classifies nothing
            found = auto.decide(self.steps)  # the first layer classifies; None: postponed
            if found is not None:
                regroup(self, auto.unstable_in(self.layer_idx))
        if prompt == t:
            return self._take_prompt(key_states, value_states)
        b, h = key_states.shape[:2]
        if t == 1:  # a decode step: FlexiCache's attention function attends with this layer (`attend`)
            self._decode_token(key_states, value_states)
        else:
            # Several decode steps in one forward (speculative decoding verifies its candidates so): `attend` appends
            # and attends them one at a time. The first forward of that loop starts with the prompt: it is taken now,
            # and its queries attend densely over it (the attention function takes it from the placeholder).
            prompt_kv = None
            if prompt:
                prompt_kv = self._take_prompt(key_states[:, :, :prompt], value_states[:, :, :prompt])
            self._block = (key_states[:, :, prompt:], value_states[:, :, prompt:], prompt_kv)
        self.pending = True
        length = self.length + (0 if self._block is None else self._block[0].shape[2])
        return (
            _placeholder(self, b, h, length, self.head_dim, key_states),
            _placeholder(self, b, h, length, self.value_dim, value_states),
        )

    def prompt_tokens(self, t: int) -> int:
        """How many of `t` new tokens are a prompt (or a prefill chunk, a new turn) that attends densely; the others
        are decode steps. Several tokens are a prompt, and so is one that generate feeds as a prompt (a chunk or a
        turn of one token, `FlexiCache.prefilling`); another single token on a filled cache is a decode step. While
        recording past states for speculative decoding every token after the prompt is a decode step, so each verified
        candidate attends as plain decoding would have (`fc_hf/speculative.py`)."""
        if not self.record_past:
            return t if t > 1 or self.length == 0 or self.owner.prefilling else 0
        end = self.owner.prompt_end
        return min(t, max(0, (self.length if end is None else end) - self.length))

    def _take_prompt(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append tokens that attend densely (a prompt, a chunk, a turn); returns the K/V they attend over."""
        t = key_states.shape[2]
        past = self.length
        if past > 0:
            # Tokens on a filled cache (a prefill chunk, a new turn): they attend exactly, over every earlier token
            # read back from both tiers (this layer only) and over each other; read before the append drops pages.
            key_all, value_all = self._with_past(key_states, value_states)
        self._append(key_states, value_states)
        self.length += t
        if past > 0:
            key_states, value_states = key_all, value_all
        auto = self.owner.auto
        if auto is not None and auto.observing and not auto.done and t > 1:
            # Zero warm-up: the attention function finds this layer on the keys and traces the prompt's last
            # queries (`observe_prefill`; chunk after chunk, the last one's stand); a view, so the tensor it marks is
            # not the model's own.
            key_states = key_states.view_as(key_states)
            key_states.fc_observe = self
        return key_states, value_states  # dense attention over exactly these

    def _decode_token(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Append one decode step's token `[B, H, 1, D]` (marked first while recording, so `crop` can take it back)."""
        if self.record_past:
            self._marks.append(self._mark())
        self._append(key, value, prompt=False)
        self.length += 1
        self.steps += 1

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor, prompt: bool = True) -> None:
        backend = self.cfg.backend
        if len(self.groups) == 1:  # one group holds every head, in order: nothing to pick
            self.groups[0].append(key_states, value_states, prompt, backend=backend)
        elif not prompt and kernels.backend_for(key_states, backend) == "triton":
            for group in self.groups:  # one launch per group picks its heads and writes K and V
                group.append(key_states, value_states, prompt, heads=group.head_index, backend=backend)
        else:  # the heads in group order once, then each group takes its span (a view)
            perm, spans, _ = self._head_order()
            kp = key_states if perm is None else key_states.index_select(1, perm)
            vp = value_states if perm is None else value_states.index_select(1, perm)
            for group, (lo, hi) in zip(self.groups, spans):
                group.append(kp[:, lo:hi], vp[:, lo:hi], prompt, backend=backend)

    def _with_past(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[B, H, L + T, D]` keys and values: the L tokens held (from the device where resident, else the host tier,
        `PagedKV.read_into`) followed by the T new ones, for the model's dense attention. One layer at a time: this
        read-back lives while the layer attends; its bytes count towards the cache's peak (`memory_report`)."""
        b, h, t, _ = key_states.shape
        past = self.length
        keys = key_states.new_empty(b, h, past + t, self.head_dim)
        values = value_states.new_empty(b, h, past + t, self.value_dim)
        keys[:, :, past:] = key_states
        values[:, :, past:] = value_states
        staged = 0
        perm, spans, _ = self._head_order()
        for group, (lo, hi) in zip(self.groups, spans):
            if perm is None:  # the group's heads are a run: its span of the layer's tensors
                staged = max(staged, group.store.read_into(keys[:, lo:hi], values[:, lo:hi]))
            else:  # written into the group's heads of the layer's tensors (no copy of its own)
                staged = max(staged, group.store.read_into(keys, values, heads=group.head_index))
        self.owner.read_back_bytes = keys.numel() * keys.element_size() + values.numel() * values.element_size() + staged
        self.owner.ledger.transient(self.owner.read_back_bytes)
        return keys, values

    def _head_order(self) -> tuple[torch.Tensor | None, list[tuple[int, int]], torch.Tensor | None]:
        """`(perm, spans, inverse)`: the KV heads in group order (None when no reordering is needed), each group's
        span in it, and the inverse permutation (group order back to head order; None with perm).

        When every group's heads are a run of consecutive heads, each group's span is its run in head order itself
        (a view of the model's tensors; no pick of the heads before the groups, none of the output after)."""
        memo = getattr(self, "_order_memo", None)
        if memo is None or memo[0] is not self.groups:
            order = [h for g in self.groups for h in g.heads]
            spans, lo = [], 0
            for g in self.groups:
                spans.append((lo, lo + len(g.heads)))
                lo += len(g.heads)
            perm = inverse = None
            if all(g.heads == list(range(g.heads[0], g.heads[0] + len(g.heads))) for g in self.groups):
                spans = [(g.heads[0], g.heads[0] + len(g.heads)) for g in self.groups]
            elif order != list(range(self.num_kv_heads)):
                perm = torch.tensor(order, device=self.device)
                inverse = torch.tensor(sorted(range(len(order)), key=order.__getitem__), device=self.device)
            memo = (self.groups, perm, spans, inverse)
            self._order_memo = memo
        return memo[1], memo[2], memo[3]

    def check_same_kind(self, key_states: torch.Tensor, device: bool = True) -> None:
        """Refuse tokens of another dtype, batch size or (with `device`) device than this layer holds."""
        if (device and key_states.device != self.device) or key_states.dtype != self.dtype:
            raise FlexiCacheError(
                f"FlexiCache layer {self.layer_idx} holds {self.dtype} on {self.device} but got {key_states.dtype} on "
                f"{key_states.device}. The model's dtype/device changed mid-generation: keep it fixed, or start a new "
                "FlexiCache."
            )
        if key_states.shape[0] != self.batch:
            raise FlexiCacheError(
                f"FlexiCache layer {self.layer_idx} holds batch {self.batch} but got {key_states.shape[0]} sequences; "
                "use a fresh FlexiCache for a new batch."
            )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise FlexiCacheError("FlexiCache cannot be reset in place; create a new FlexiCache instead.")

    def offload(self):  # the host tier is FlexiCache's own; transformers' whole-layer offloading does not apply
        pass

    def prefetch(self):
        pass

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.batch_select_indices(torch.arange(self.batch, device=self.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        with storage_mode():
            self._select_rows(indices)

    def _select_rows(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        if indices.dtype == torch.bool:
            indices = indices.nonzero().flatten()
        self.commit()  # marks hold the old rows
        for group in self.groups:
            group.select_rows(indices)
        if self.owner.auto is not None:
            self.owner.auto.select_rows(self.layer_idx, indices)
        self.batch = int(indices.numel())

    # -- decode attention ------------------------------------------------------------------------
    def attend(self, query: torch.Tensor, attention_mask, scaling: float, softcap: float | None) -> torch.Tensor:
        """Sparse decode attention for this layer's decode steps. `query [B, Hq, T, D]` -> `[B, T, Hq, D]`: one step,
        or the block of decode tokens a verification forward brought (`VerifiedDecoding._attend_verified`)."""
        self.pending = False
        block, self._block = self._block, None
        if block is not None:
            return self._attend_verified(query, block, attention_mask, scaling, softcap)
        if query.shape[2] != 1:
            raise FlexiCacheError(f"FlexiCache decode expects one query token, got {query.shape[2]}.")
        return self._attend_step(query, attention_mask, scaling, softcap)

    def _attend_step(self, query: torch.Tensor, attention_mask, scaling: float, softcap: float | None) -> torch.Tensor:
        """One decode step's attention, its token appended already. `query [B, Hq, 1, D]` -> `[B, 1, Hq, D]`."""
        b, hq, _, d = query.shape
        groups = hq // self.num_kv_heads
        q = query.reshape(b, self.num_kv_heads, groups, d)
        token_valid, page_valid_full = self.owner.padding_info(attention_mask, self.length, self.cfg.page_size)
        check = self.owner.residency_check_for(self.device)
        # One pick of the heads in group order; each group reads its span of it and writes its output into its span of
        # one buffer in that order (in place at batch 1), which one pick puts back in head order.
        perm, spans, inverse = self._head_order()
        q = q if perm is None else q.index_select(1, perm)
        out = query.new_empty(b, self.num_kv_heads, groups, self.value_dim)
        for group, (lo, hi) in zip(self.groups, spans):
            hg = hi - lo
            page_valid = None
            if page_valid_full is not None:
                page_valid = page_valid_full[:, None].expand(b, hg, -1).reshape(b * hg, -1)
            og = group.attend(q[:, lo:hi].reshape(b * hg, groups, d), self.steps, token_valid, page_valid, scaling,
                              softcap, check, out=out[0, lo:hi] if b == 1 else None)
            if b > 1:
                out[:, lo:hi] = og.view(b, hg, groups, self.value_dim)
        if inverse is not None:
            out = out.index_select(1, inverse)
        auto = self.owner.auto
        if auto is not None and self.regrouped_after_step is None:  # warm-up: one group, every head unstable
            warm = self.groups[0]
            auto.record_step(self.layer_idx, self.steps, warm.sel, warm.store.num_pages, page_valid_full, b)
        return out.view(b, hq, self.value_dim).unsqueeze(1)

    # -- profile="auto" (online.py) -----------------------------------------------------------------
    def observe_prefill(self, query: torch.Tensor, attention_mask) -> None:
        """Zero warm-up: hand the prefill queries `[B, Hq, T, D]` to the online classifier."""
        _, page_valid = self.owner.padding_info(attention_mask, self.length, self.cfg.page_size)
        self.owner.auto.observe_prefill(self.layer_idx, query, self.groups[0].store, page_valid)

    # -- accounting ------------------------------------------------------------------------------
    def stores(self):
        return [g.store for g in self.groups if g.store is not None]

    def dense_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's K/V `[B, H, L, D]`, assembled from both tiers (for tests and inspection)."""
        k = torch.empty(self.batch, self.num_kv_heads, self.length, self.head_dim, dtype=self.dtype, device=self.device)
        v = torch.empty(self.batch, self.num_kv_heads, self.length, self.value_dim, dtype=self.dtype, device=self.device)
        for group in self.groups:
            gk, gv = group.store.dense()
            k[:, group.head_index] = gk
            v[:, group.head_index] = gv
        return k, v
