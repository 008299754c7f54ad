"""FlexiCache kernels: page scoring, sparse paged decode attention, promotion planning.

Installed as `fc_hf.kernels` (the repository folder is `kernels/`; see pyproject.toml).
Each public function dispatches to a Triton kernel on CUDA tensors and to the pure-PyTorch
reference in `reference.py` otherwise. `FLEXICACHE_BACKEND=torch|triton` forces either.
"""

from .dispatch import backend_for, force_sink_pages, promotion_plan, score_pages, select_topk, sparse_decode_attention

__all__ = ["backend_for", "force_sink_pages", "promotion_plan", "score_pages", "select_topk", "sparse_decode_attention"]
