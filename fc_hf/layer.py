"""`FlexiCacheLayer`: one full-attention layer's cache.

Prompt tokens (a prompt, a prefill chunk, a new turn: `prompt_tokens`) are written to the layer's store and attend
densely: over themselves on an empty cache (the model's own K/V), over every token held on a filled one. A decode step
appends its token (`fc_hf/decode.py`) and returns a placeholder that carries this layer; FlexiCache's attention function
(`attention.py`) finds it there and runs rank -> tier move -> sparse attention. Any other attention function touching
the placeholder raises, so a model not loaded with `attn_implementation="flexicache"` fails loudly. While recording for
speculative decoding, every token after the prompt is a decode step (fc_hf/verify.py).
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import CacheLayerMixin

from . import decode
from .errors import FlexiCacheError
from .kernels import dispatch as kernels
from .rows import HeadKinds
from .schedule import phase_of, phase_range, ranked_rows, rows_per_step
from .selection import PageSelector
from .store import PageStore, mark_static, window_pages
from .verify import VerifiedDecoding

_METADATA_OPS = {"__get__", "size", "dim", "__repr__", "__format__", "__len__", "numel", "is_floating_point"}

NOT_FLEXICACHE = (
    "FlexiCache decode step reached an attention function other than FlexiCache's (the model's "
    "attn_implementation is {impl!r}). Load the model with attn_implementation='flexicache' after "
    "`fc_hf.register()`, or call `model.set_attn_implementation('flexicache')`."
)

COMPILED_PROMPT = (
    "FlexiCache takes a prompt (a prefill, a prefill chunk, a new turn) eagerly: only its decode steps compile "
    "(generate compiles just those for a FlexiCache). Under torch.compile(fullgraph=True) of the whole forward, run the "
    "prompt through the uncompiled model first."
)


@torch.compiler.disable(reason=COMPILED_PROMPT)
def _prompt_eagerly(layer: "FlexiCacheLayer", key_states: torch.Tensor, value_states: torch.Tensor):
    """A prompt reaching a compiled forward: taken outside the graph (a graph break), as an eager forward would."""
    if not layer.is_initialized:
        layer.lazy_initialization(key_states, value_states)
    else:
        layer.check_same_kind(key_states)
    return layer._take_prompt(key_states, value_states)


def attn_implementation_of(config) -> str:
    """`config._attn_implementation` (the model's config, shared with it, so current at the time of an error)."""
    impl = getattr(config, "_attn_implementation", None)
    return impl if impl is not None else "unknown (the config names none)"


class DecodePlaceholder(torch.Tensor):
    """Stands in for a layer's K/V at a decode step; only shape queries are allowed on it."""

    fc_layer: "FlexiCacheLayer"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in _METADATA_OPS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        layer = next((a.fc_layer for a in args if isinstance(a, DecodePlaceholder)), None)
        impl = attn_implementation_of(layer.model_config) if layer is not None else "not 'flexicache'"
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

    def __init__(self, layer_idx: int, num_kv_heads: int, cfg, unstable: set[int], streaming: set[int], room,
                 forward, ledger, auto=None, model_config=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_kv_heads = num_kv_heads
        self.cfg = cfg
        # What the cache hands its layers, shared among them: the capacity (`Room`), the forward they run in
        # (`ForwardState`), the device bytes held (`DeviceLedger`), profile="auto"'s classifier (`OnlineClassifier`,
        # else None), and the model's config (the attention function it names, for errors).
        self.room, self.forward, self.ledger, self.auto, self.model_config = room, forward, ledger, auto, model_config
        self.kinds = HeadKinds.split(num_kv_heads, unstable, streaming)
        self.store: PageStore | None = None
        self.selector: PageSelector | None = None
        self.rank_all = False  # the next decode step ranks every stable row (the first after a prompt)
        self.pending = False  # a placeholder was handed out and not yet consumed by the attention function
        self.context: decode.DecodeContext | None = None  # this forward's decode step (set by the cache)
        self.regrouped_after_step: int | None = None  # profile="auto": the step after which the heads were re-split
        self.prompt_end = 0  # tokens held when the last prompt ended
        self.turn_steps: list[int] = []  # decode steps of each earlier turn (stats)
        self.last_ranking = None  # (pages [N_E, K] of the unstable rows) of the last eager decode step (inspection)
        self.host_step: int | None = None  # an eager decode step's step since the last prompt (None when compiled)
        # Inspection (eval tools), off by default: the rows ranked and the pages each row read at the last eager step.
        self.record_reads = False
        self.last_reads: dict | None = None
        self._init_verification()

    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items()})
        if self.store is not None and new.store.near_apart != self.store.near_apart:  # the copy's host tier could not
            new._index_tensors()  # be mapped (`PageStore.__deepcopy__`): its near rows are read from the full tier
        return new

    # -- transformers CacheLayerMixin ------------------------------------------------------------------
    @property
    def is_compileable(self) -> bool:
        """A decode step is static (fixed shapes, no host sync): generate compiles it. Not while recording drafts for
        speculative decoding (a verification forward brings several decode tokens, eagerly), as transformers' own
        linear-attention layers."""
        return not self.record_past

    @property
    def length(self) -> int:
        """Tokens held, as a host number (`PageStore.length`: read from the device once a compiled step was traced)."""
        return 0 if self.store is None else self.store.length

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
        # Loads (the first time: builds) the C++ kernels here, at the prompt, never while a compiled step is traced.
        kernels.backend_for(key_states, self.cfg.backend)
        self.batch, self.head_dim, self.value_dim = key_states.shape[0], key_states.shape[-1], value_states.shape[-1]
        self._build(self.batch, self.room.capacity_for(key_states.shape[2], self.batch))
        self.is_initialized = True

    def _build(self, batch: int, capacity: int) -> None:
        store = PageStore(self.kinds, self.cfg, batch, self.head_dim, self.value_dim, self.dtype, self.device, capacity,
                          host_tier=self.cfg.offload)
        store.traced = self.store is not None and self.store.traced  # a compiled step replays on the new store too
        self.store = store
        self.selector = PageSelector(self.cfg, store.n, self.device)
        self.prompt_end_t = torch.zeros((), dtype=torch.long, device=self.device)  # `prompt_end` on the device
        self._index_tensors()
        self.ledger.resized(0, self.device_bytes())

    def _index_tensors(self) -> None:
        """Index tensors of the decode step, for this batch and capacity (rebuilt when either changes)."""
        store, rows, dev = self.store, self.store.rows, self.device
        self.row_starts = torch.arange(store.n, device=dev) * store.capacity
        self.near_starts = torch.arange(rows.n_near, device=dev) * store.capacity  # used where the near rows are apart
        # The unstable and streaming rows' pages are read from the near tier (the full tier unless apart).
        self.unstable_page_starts = (store.near_index.index_select(0, rows.unstable) * store.pages)[:, None]
        self.streaming_page_starts = (store.near_index.index_select(0, rows.streaming) * store.pages)[:, None]
        self.stable_rows = torch.cat([rows.stable, rows.stable.new_full((1,), store.n)])  # the extra row: padding
        self.stable_all = torch.arange(rows.n_stable, device=dev)
        self.places = torch.arange(rows_per_step(rows.n_stable, self.cfg.rerank_interval), device=dev)
        self.every_row_unstable = rows.n_unstable == store.n
        self.every_row_stable = rows.n_stable == store.n
        k, sink = min(self.cfg.pages_per_head, store.pages), self.cfg.streaming_sink_pages
        self.first_pages = torch.arange(k, device=dev)
        self.recent_offsets = torch.arange(max(0, k - sink), device=dev)
        if getattr(self, "promoted", None) is None:
            self.promoted = torch.zeros((), dtype=torch.long, device=dev)  # pages promoted host -> device so far
        mark_static(store, rows, self.selector, self)
        # Eager steps' ranked rows by span of stable rows (`step_rows`), made now for every span a step can have (the
        # empty one, every stable row, each phase's), so every step of a phase issues the same ops.
        n_s, interval = rows.n_stable, self.cfg.rerank_interval
        spans = {(0, 0), (0, n_s)} | {phase_range(phase_of(j, n_s, interval), n_s, interval) for j in range(n_s)}
        self._step_rows = {}
        for span in spans:
            self._step_rows[span] = self._make_step_rows(span)

    def phase_rows(self, step: int) -> tuple[torch.Tensor | None, tuple[int, int]]:
        """The stable rows (indices among them) an eager decode step `step` ranks: its phase's (None if it has none),
        and their span `[start, end)`. An eager step knows its step on the host, so it ranks no padded place (a compiled
        step pads, `DecodeContext.due`). A phase's rows are contiguous: a view of `stable_all`, whatever `rerank_interval`
        is."""
        start, end = phase_range(step % self.cfg.rerank_interval, self.store.rows.n_stable, self.cfg.rerank_interval)
        return (self.stable_all[start:end] if end > start else None), (start, end)

    def step_rows(self, span: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, slice | None]:
        """The rows an eager decode step ranks: the unstable rows, then the stable rows `[start, end)` (indices among
        them), none padded; as `(rows, real rows, sequences)` for `PageSelector.rank`, and a `slice` where they
        are rows `[first, end)` (a layer of one kind: their queries and carried candidates are views). Made once per
        span."""
        return self._step_rows[span if span[1] > span[0] else (0, 0)]

    def _make_step_rows(self, span: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, slice | None]:
        rows = self.store.rows
        ranked = torch.cat([rows.unstable, rows.stable[span[0] : span[1]]])
        listed = rows.unstable_rows + rows.stable_rows[span[0] : span[1]]  # the same rows, on the host
        contiguous = listed and listed == list(range(listed[0], listed[-1] + 1))
        row_range = slice(listed[0], listed[-1] + 1) if contiguous else None
        return ranked, ranked, rows.batch_of.index_select(0, ranked), row_range

    def grow(self, capacity: int) -> None:
        """Room for `capacity` tokens (outside a decode step)."""
        if self.store is not None and capacity > self.store.capacity:
            before = self.device_bytes()
            self.store.grow(capacity)
            self._index_tensors()
            self.ledger.resized(before, self.device_bytes())

    def device_pages(self, capacity: int, batch: int) -> int:
        """Pages of K/V this layer holds on the device at `capacity` tokens per sequence for `batch` sequences: every
        page of the unstable and streaming heads (and of the stable ones with offload off), the stable rows' windows."""
        pages = capacity // self.cfg.page_size
        device_heads = len(self.kinds.unstable) + len(self.kinds.streaming)
        if not self.cfg.offload:
            device_heads += len(self.kinds.stable)
        windows = (batch * len(self.kinds.stable) + 1) * window_pages(self.cfg, pages) if self.kinds.stable else 0
        return batch * device_heads * pages + windows

    def free(self) -> None:
        """Drop this layer's tensors, their bytes out of the ledger (`FlexiCache.release`, or an empty cache taking a
        batch of another size): a later prompt allocates them anew."""
        self.commit()
        if self.store is not None:
            self.ledger.resized(self.device_bytes(), 0)
        self.store = self.selector = self.context = None
        self.is_initialized = False

    def reset_state(self) -> None:
        """Hold no token, keeping the tensors (`FlexiCache.reset`)."""
        self.commit()
        self.record_past = False
        if self.store is not None:
            self.store.empty()
            self.prompt_end_t.zero_()
            self.selector.forget()
            self.promoted.zero_()
        self.prompt_end, self.turn_steps, self.rank_all, self.pending = 0, [], False, False
        self.last_ranking = None

    def device_bytes(self) -> int:
        if self.store is None:
            return 0
        bytes_ = self.store.tier_bytes()
        return bytes_["device"]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        t = key_states.shape[2]
        if torch.compiler.is_compiling() and self.store is not None:
            self.store.traced = True  # from now on the device's count of tokens is the exact one
        if self.pending:
            raise FlexiCacheError(NOT_FLEXICACHE.format(impl=attn_implementation_of(self.model_config)))
        if torch.compiler.is_compiling() and (t > 1 or not self.is_initialized) and not self.record_past:
            return _prompt_eagerly(self, key_states, value_states)  # a compiled forward brought a prompt
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif not torch.compiler.is_compiling():
            self.check_same_kind(key_states)
        prompt = self.prompt_tokens(t)
        auto = self.auto
        if (auto is not None and prompt < t and self.length > 0 and self.regrouped_after_step is None
                and self.decode_steps() == auto.boundary):  # before a decode step: a prefill chunk classifies nothing
            from .online import regroup  # noqa: PLC0415 - profile="auto" only

            found = auto.decide(self.decode_steps())  # the first layer classifies; None: postponed
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
        length = self.store.capacity
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
            if t == 1 and torch.compiler.is_compiling():
                return 0  # generate compiles decode steps only
            return t if t > 1 or self.length == 0 or self.forward.prefilling else 0
        end = self.forward.loop_prompt_end
        held = self.length
        return min(t, max(0, (held if end is None else end) - held))

    def _take_prompt(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append tokens that attend densely (a prompt, a chunk, a turn); returns the K/V they attend over: the model's
        own on an empty cache, every token held (views of the store) on a filled one."""
        t = key_states.shape[2]
        past = self.length
        if past:
            self.turn_steps.append(past - self.prompt_end)
        self.room.ensure_prompt(past + t)
        self.store.write_prompt(key_states, value_states)  # the store's count is now past + t
        self.prompt_end = past + t
        self.prompt_end_t.fill_(past + t)
        self.rank_all = bool(self.kinds.stable)
        self.store.aim_windows(past + t)  # the next token's window place, until that step's ranking fills them
        self.forward.step_bias(self)  # the decode steps' mask buffers exist before a step (which may be compiled)
        self.selector.forget()  # nothing ranked before these tokens is carried on
        if past:
            key_states, value_states = self.store.dense()
        auto = self.auto
        if auto is not None and auto.observing and not auto.done and t > 1:
            # Zero warm-up: the attention function finds this layer on the keys and traces the prompt's last
            # queries (`observe_prefill`; chunk after chunk, the last one's stand); a view, so the tensor it marks is
            # not the model's own.
            key_states = key_states.view_as(key_states)
            key_states.fc_observe = self
        return key_states, value_states  # dense attention over exactly these

    def _decode_token(self, key: torch.Tensor, value: torch.Tensor, own_context: bool = False) -> None:
        """Append one decode step's token `[B, H, 1, D]` (marked first while recording, so `crop` can take it back).
        `own_context`: a token of a verification block, whose step is its own (not the forward's)."""
        if self.record_past:
            self._marks.append(self._mark())
        if own_context:
            self.context = self.forward.fresh_context(self)
        held = None if torch.compiler.is_compiling() else self.length
        self.host_step = None if held is None else held - self.prompt_end + 1
        decode.append(self, key, value, self.context)
        if held is not None:
            self.store.length = held + 1

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
                "for a new batch, call cache.reset() first or use a fresh FlexiCache."
            )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The whole capacity once the layer holds tokens (a decode step's mask keeps its shape from step to step); the
        query alone on an empty layer, allocated or not (its prompt attends over itself; a reset cache's room is made
        where the prompt is taken, and a batch of another size reallocates there)."""
        if self.store is None:
            return query_length, 0
        if not torch.compiler.is_compiling() and (query_length > 1 or not self.store.traced):
            # Room first (an eager step may grow the cache; reading a traced cache's count is a sync: prompts only).
            held = self.length
            if held == 0:
                return query_length, 0
            self.room.ensure(held + query_length)
        return self.store.capacity, 0

    def get_seq_length(self):
        if self.store is None:
            return 0
        if torch.compiler.is_compiling():
            return self.store.length_t
        return self.length

    def get_max_length(self) -> int:
        return -1 if self.store is None else self.store.capacity

    def reset(self) -> None:
        raise FlexiCacheError("Reset a FlexiCache as a whole (`cache.reset()`), not one of its layers.")

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
        from .grad_modes import storage_mode  # noqa: PLC0415 - a hook outside the decode step

        with storage_mode():
            self._select_rows(indices)

    def _select_rows(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        if indices.dtype == torch.bool:
            indices = indices.nonzero().flatten()
        self.commit()  # marks hold the old rows
        store = self.store
        h = store.heads
        rows = (indices.to(self.device)[:, None] * h + torch.arange(h, device=self.device)).reshape(-1)
        before = self.device_bytes()
        store.select_rows(indices)
        self.selector.select_rows(rows)
        if self.auto is not None:
            self.auto.select_rows(self.layer_idx, indices, self.decode_steps())
        self.batch = store.batch
        self._index_tensors()
        self.ledger.resized(before, self.device_bytes())

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
        out = decode.attend(self, query, self.context, attention_mask, scaling, softcap)
        auto = self.auto
        if auto is not None and self.regrouped_after_step is None and not torch.compiler.is_compiling():
            auto.record_step(self.layer_idx, self.decode_steps(), self.last_ranking, self.context.bias,
                             self.store.batch)
        return out

    def note_ranking(self, ranking, n_unstable: int, ranked: torch.Tensor | None = None) -> None:
        """Keep the unstable rows' chosen pages of an eager step (inspection, `profile="auto"`'s trace); with
        `record_reads`, also the rows ranked."""
        if torch.compiler.is_compiling():
            return
        self.last_ranking = ranking.pages[:n_unstable]
        if self.record_reads:
            self.last_reads = {"ranked": ranked.clone(), "pages": ranking.pages.clone()}

    def note_windows(self) -> None:
        """With `record_reads`: the stable rows' window pages as this step's attention reads them."""
        if self.record_reads and not torch.compiler.is_compiling():
            self.last_reads = dict(self.last_reads or {}, windows=self.store.win_pages[: self.store.rows.n_stable].clone())

    def pages_read(self) -> list[list[int]]:
        """With `record_reads`, per row (`b * H + h`) the pages the last eager decode step attended to: an unstable
        row's ranking, a stable row's window (the pages it holds), a streaming row's sink and recent pages."""
        store, k, p = self.store, self.cfg.pages_per_head, self.cfg.page_size
        page = (store.length - 1) // p
        unstable, stable = store.rows.unstable.tolist(), store.rows.stable.tolist()
        out = []
        for row in range(store.n):
            if row in unstable:
                pages = self.last_ranking[unstable.index(row)].tolist()
            elif row in stable:
                pages = self.last_reads["windows"][stable.index(row)].tolist()
            else:
                pages = list(range(page + 1)) if page < k else list(range(self.cfg.streaming_sink_pages)) + list(
                    range(page + 1 - (k - self.cfg.streaming_sink_pages), page + 1))
            out.append(sorted({x for x in pages if 0 <= x <= page}))
        return out

    def rows_ranked(self) -> set[int]:
        """With `record_reads`, the rows the last eager decode step ranked."""
        return {int(r) for r in self.last_reads["ranked"].tolist() if r < self.store.n}

    # -- profile="auto" (online.py) -----------------------------------------------------------------
    def observe_prefill(self, query: torch.Tensor, attention_mask) -> None:
        """Zero warm-up: hand the prefill queries `[B, Hq, T, D]` to the online classifier."""
        self.auto.observe_prefill(self.layer_idx, query, self.store, attention_mask)

    # -- accounting ------------------------------------------------------------------------------
    def decode_steps(self) -> int:
        """Decode steps since the last prompt."""
        return self.length - self.prompt_end

    def counts(self) -> dict:
        """Rankings and promotions of this layer so far (`FlexiCache.stats`)."""
        steps = self.turn_steps + [self.decode_steps()]
        rows = self.store.rows if self.store is not None else None
        n_e = 0 if rows is None else rows.n_unstable
        n_s = 0 if rows is None else rows.n_stable
        return {
            "decode_steps": sum(steps),
            "unstable_rows_ranked": n_e * sum(steps),
            "stable_rows_ranked": sum(ranked_rows(s, n_s, self.cfg.rerank_interval) for s in steps),
            "pages_promoted": 0 if self.store is None or self.device.type == "meta" else int(self.promoted),
        }

    def dense_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's K/V `[B, H, L, D]` (for tests and inspection)."""
        k, v = self.store.dense()
        return k.clone(), v.clone()
