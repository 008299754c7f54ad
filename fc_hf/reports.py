"""What a `FlexiCache` reports of itself: bytes per tier (`memory`) and counters of its decode (`counters`).

Counted, not estimated: the store's tensors by their sizes (allocated for the capacity, as a `StaticCache` is), the
peak by the cache's ledger (`fc_hf/ledger.py`). Rankings follow from the schedule (`fc_hf/schedule.py`) and the decode
steps each layer took; promotions are counted on the device as the windows are rewritten (`fc_hf/tiers.py`).
"""

from __future__ import annotations


def memory(cache) -> dict[str, int]:
    """Bytes actually allocated per tier (not formulas), plus what a DynamicCache would hold for the tokens held.

    `peak_device_kv_bytes` is the most device KV the cache has held at once (`fc_hf.ledger`): the device tier (every
    page of the unstable and streaming heads, the stable heads' windows), dense layers' K/V and the read-back of a
    prompt on a filled cache where it is a copy; metadata is apart."""
    report = {"device_kv_bytes": 0, "host_kv_bytes": 0, "metadata_bytes": 0, "dense_kv_bytes": 0,
              "device_slots_in_use": 0, "peak_device_kv_bytes": cache.ledger.peak}
    auto = cache.auto
    if auto is not None:  # profile="auto": -1 while warming up; the trace is counted as metadata
        report["auto_classified_after_step"] = -1 if auto.classified_after_step is None else auto.classified_after_step
        report["auto_unstable_heads"] = -1 if auto.unstable is None else len(auto.unstable)
        report["metadata_bytes"] += auto.trace_bytes()
    flexi = set(map(id, cache.flexi_layers))
    for layer in cache.layers:
        if id(layer) in flexi:
            store = layer.store
            if store is None:
                continue
            tiers = store.tier_bytes()
            report["device_kv_bytes"] += tiers["device"]
            report["host_kv_bytes"] += tiers["host"]
            report["metadata_bytes"] += tiers["metadata"]
            report["device_slots_in_use"] += tiers["device"] // store.page_bytes
            per_token = store.batch * store.heads * (store.head_dim + store.value_dim)
            report["dense_kv_bytes"] += per_token * layer.length * store.dtype.itemsize
        elif getattr(layer, "keys", None) is not None and layer.keys.numel():
            nbytes = layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
            report["device_kv_bytes"] += nbytes
            report["dense_kv_bytes"] += nbytes
    return report


def counters(cache) -> dict:
    """Counters of the decode so far: decode steps, rows ranked, promotions, offloads, and the bytes decode steps read
    (`bytes_read`: MinMax metadata scored, candidate keys refinement read, K/V pages attention read)."""
    cfg = cache.cache_config
    s = {"decode_steps": 0, "reranks_stable": 0, "reranks_unstable": 0, "pages_promoted": 0, "bytes_promoted": 0,
         "pages_offloaded": 0, "bytes_offloaded": 0}
    read = {"metadata": 0, "candidate_keys": 0, "kv": 0}
    stable_ranked = 0
    for layer in cache.flexi_layers:
        store = layer.store
        if store is None:
            continue
        counts = layer.counts()
        s["decode_steps"] = max(s["decode_steps"], counts["decode_steps"])
        s["reranks_unstable"] += counts["unstable_rows_ranked"]
        s["reranks_stable"] += counts["stable_rows_ranked"]
        stable_ranked += counts["stable_rows_ranked"]
        s["pages_promoted"] += counts["pages_promoted"]
        s["bytes_promoted"] += counts["pages_promoted"] * store.page_bytes
        if cfg.offload and store.rows.n_stable:  # a stable row's every full page went to the host tier once
            full = layer.length // store.page_size
            s["pages_offloaded"] += full * store.rows.n_stable
            s["bytes_offloaded"] += full * store.rows.n_stable * store.page_bytes
        item, p, d, dv = store.dtype.itemsize, store.page_size, store.head_dim, store.value_dim
        ranked = counts["unstable_rows_ranked"] + counts["stable_rows_ranked"]
        read["metadata"] += ranked * store.pages * store.subpages * 2 * d * item
        read["candidate_keys"] += ranked * cfg.candidate_pages * p * d * item
        steps = counts["decode_steps"]
        k = cfg.pages_per_head
        rows = store.rows
        reused = cfg.candidate_pages > 0  # the unstable rows' attention re-uses the ranking's logits: values only
        read["kv"] += steps * p * item * (rows.n_unstable * k * (dv if reused else d + dv)
                                          + rows.n_stable * store.window * (d + dv)
                                          + rows.n_streaming * k * (d + dv))
    s["pages_per_ranking"] = cfg.pages_per_head
    s["promoted_fraction"] = (s["pages_promoted"] / (stable_ranked * cfg.pages_per_head) if stable_ranked else None)
    s["bytes_read"] = read
    s["bytes_read_per_step"] = sum(read.values()) / s["decode_steps"] if s["decode_steps"] else None
    if cache.auto is not None:
        s["reranks_unstable"] += cache.auto.warmup_rankings
        s["auto_profile"] = cache.auto.summary()
    return s
