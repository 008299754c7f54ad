"""Head-stability profiler: traces of top-K pages during dense decoding, temporal stability, head classes.

    from fc_hf.profiler import collect_trace, temporal_stability, classify_heads
    trace = collect_trace(model, input_ids, new_tokens=256)
    ts = temporal_stability(trace.topk, trace.num_pages, window=16)   # [num_windows, L, H]
    unstable = classify_heads([ts], unstable_fraction=0.25)          # {(layer, kv_head), ...}

`flexicache profile --model ...` runs the whole pipeline and writes a `HeadProfile` (see profiles/README.md).
"""

from .build import analyse, make_profile, profile_excluding
from .metrics import (
    classify_heads,
    count_unstable,
    heldout_recall,
    mean_overlap,
    num_unstable_heads,
    overlap_matrix,
    rco_by_offset,
    select_unstable,
    temporal_stability,
)
from .trace import TRACE_ATTENTION, PageTracer, Trace, collect_trace, register_trace_attention

__all__ = [
    "TRACE_ATTENTION",
    "analyse",
    "make_profile",
    "profile_excluding",
    "PageTracer",
    "Trace",
    "classify_heads",
    "collect_trace",
    "count_unstable",
    "heldout_recall",
    "mean_overlap",
    "num_unstable_heads",
    "overlap_matrix",
    "rco_by_offset",
    "register_trace_attention",
    "select_unstable",
    "temporal_stability",
]
