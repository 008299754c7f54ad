"""FlexiCache kernels: page scoring, sparse paged decode attention, promotion planning.

Installed as `fc_hf.kernels` (the repository folder is `kernels/`; see pyproject.toml).

| module | what it owns |
|---|---|
| `dispatch.py` | the public functions: Triton on CUDA tensors, the PyTorch backend otherwise (`FLEXICACHE_BACKEND=torch|triton` forces either) |
| `torch_backend.py` | the PyTorch implementation: the CPU production path and the reference the Triton kernels are tested against; `GatherWorkspace` (per-cache gather buffers) |
| `score.py`, `decode.py`, `refine.py`, `append.py` | Triton kernels: page scoring, flash-decoding over selected pages, the exact mass of refinement's candidate pages, the decode append |
| `checks.py` | input checks and accepted dtypes shared by the Triton launchers |
| `bruteforce.py` | literal-formula oracles for tests only (never called in production) |
"""

from .dispatch import append_token, backend_for, candidate_mass, force_sink_pages, promotion_plan, score_pages, select_topk, sparse_decode_attention
from .torch_backend import GatherWorkspace

__all__ = [
    "GatherWorkspace", "append_token", "backend_for", "candidate_mass", "force_sink_pages", "promotion_plan", "score_pages", "select_topk",
    "sparse_decode_attention",
]
