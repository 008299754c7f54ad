"""What a `FlexiCache` reports of itself: bytes per tier (`memory`) and counters of its decode (`counters`).

Counted, not estimated: pools, host tiers and metadata by their tensors' sizes, the peak by the cache's ledger
(`fc_hf/ledger.py`), and the bytes a decode step reads by each head group as it reads them (`HeadGroup.counts`).
"""

from __future__ import annotations


def memory(cache) -> dict[str, int]:
    """Bytes actually allocated per tier (not formulas), plus what a DynamicCache would hold.

    `peak_device_kv_bytes` is the most device KV the cache has held at once (`fc_hf.ledger`): page pools, dense
    layers' K/V and the one-layer read-back of a multi-token step on a filled cache; metadata is apart."""
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
            for store in layer.stores():
                report["device_kv_bytes"] += store.device_bytes()
                report["host_kv_bytes"] += store.host_bytes()
                report["metadata_bytes"] += store.metadata_bytes()
                report["device_slots_in_use"] += store.slots_in_use()
            if layer.is_initialized:
                per_token = layer.batch * layer.num_kv_heads * (layer.head_dim + layer.value_dim)
                report["dense_kv_bytes"] += per_token * layer.length * layer.dtype.itemsize
        elif getattr(layer, "keys", None) is not None and layer.keys.numel():
            nbytes = layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
            report["device_kv_bytes"] += nbytes
            report["dense_kv_bytes"] += nbytes
    return report


def counters(cache) -> dict:
    """Counters of the decode so far: re-ranks, promotions, offloads, pages chosen and read, and the bytes decode
    steps read (`bytes_read`: MinMax metadata scored, candidate keys refinement read, K/V pages attention read)."""
    s = {"decode_steps": 0, "reranks_stable": 0, "reranks_unstable": 0, "pages_promoted": 0, "bytes_promoted": 0,
         "pages_offloaded": 0, "bytes_offloaded": 0, "promoted_fraction_per_rerank": []}
    counts = {}
    read = {"metadata": 0, "candidate_keys": 0, "kv": 0}
    for layer in cache.flexi_layers:
        s["decode_steps"] = max(s["decode_steps"], layer.steps)
        for group in layer.groups:
            if group.kind in ("stable", "unstable"):
                s[f"reranks_{group.kind}"] += group.rankings
            s["promoted_fraction_per_rerank"].extend(group.promoted_fractions)
            if group.store is None:
                continue
            for key, value in group.store.counters.items():
                s[key] += value
            for key, bytes_ in bytes_read(group).items():
                read[key] += bytes_
            if group.kind != "streaming":
                for key, value in group.counts.items():
                    counts[key] = counts.get(key, 0) + value
    # Pages a ranked head chose per ranking, and pages a head attended per decode step (its selection plus the pages
    # created since), over every ranked head group.
    s["pages_per_ranking"] = counts["ranked_pages"] / counts["ranked_rows"] if counts.get("ranked_rows") else None
    s["pages_per_step"] = counts["read_pages"] / counts["read_rows"] if counts.get("read_rows") else None
    s["bytes_read"] = read
    s["bytes_read_per_step"] = sum(read.values()) / s["decode_steps"] if s["decode_steps"] else None
    if cache.auto is not None:
        s["reranks_unstable"] += cache.auto.warmup_rankings
        s["auto_profile"] = cache.auto.summary()
    if cache.timings is not None:
        s["timings_s"] = dict(cache.timings)
    return s


def bytes_read(group) -> dict[str, int]:
    """Bytes a head group's decode steps read so far, from its `counts` and its store's shapes: MinMax entries scored
    at rankings, candidate keys refinement read, K/V of the pages attention read (keys only where a ranking's logits
    were not re-used)."""
    store, c = group.store, group.counts
    item, p, d, dv = store.dtype.itemsize, store.page_size, store.head_dim, store.value_dim
    return {"metadata": c["scored_pages"] * store.minmax.subpages * 2 * d * item,
            "candidate_keys": c["candidate_pages"] * p * d * item,
            "kv": (c["read_pages"] * (d + dv) - c["reused_pages"] * d) * p * item}
