#!/usr/bin/env bash
# FlexiCache GPU benchmark for one device lease (what it measures and in which order: eval/bench/gpu.py).
#
# Device command (the `run` tool, from the repository root; carry nothing: it needs only the python3 there, with
# torch 2.11, Triton 3.6 and transformers 5.17; it installs nothing):
#     bash eval/bench/gpu_bench.sh             timeout_s 500   under 8 min: starts no case that would end after
#                                                              7 min (--time-budget-s 420), stops a worker busy 15 s
#                                                              later, hard stop at 7 min 30 s (what finished is kept)
#     bash eval/bench/gpu_bench.sh --quick     timeout_s 300   one small shape, about 3-4 min (hard stop 4 min 30 s)
# Results land under $OUT as the run goes: gpu_bench.json (every number), gpu_bench.md (the table), gpu_bench.log.
#
# CPU rehearsal, which CI runs (tests/test_gpu_script.py) under a python3 that has the dependencies but not the
# project, as on the lent machine; about 1-2 min on 2 shared cores:
#     bash eval/bench/gpu_bench.sh --dry-run
#
# Exit status: 0 done; 1 the sanity check failed (or the dry run did); 2 no CUDA device; 124 stopped at the
# hard limit (the table of what finished is written). PYTHON=... picks another interpreter than python3.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:-$ROOT/results/gpu}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-python3}"
case "$PY" in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac  # a path: absolute (we cd below)

# An import tree in which fc_hf.kernels, fc_hf.eval and fc_hf.profiles are the top-level kernels/, eval/ and
# profiles/ folders, as pyproject.toml maps them when the project is installed.
SHADOW="$(mktemp -d)"
trap 'rm -rf "$SHADOW"' EXIT
mkdir "$SHADOW/fc_hf"
for entry in "$ROOT"/fc_hf/*; do ln -s "$entry" "$SHADOW/fc_hf/$(basename "$entry")"; done
ln -s "$ROOT/kernels" "$SHADOW/fc_hf/kernels"
ln -s "$ROOT/eval" "$SHADOW/fc_hf/eval"
ln -s "$ROOT/profiles" "$SHADOW/fc_hf/profiles"
# Started from a file in the tree, not with `-m` or `-c`: those put the current directory (the checkout, whose
# fc_hf/ has no kernels/ or eval/) first on sys.path, ahead of PYTHONPATH.
cat >"$SHADOW/run_gpu_bench.py" <<'EOF'
import sys

from fc_hf.eval.bench.gpu import main

sys.exit(main())
EOF
export PYTHONPATH="$SHADOW${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

LIMIT=450
for arg in "$@"; do
    case "$arg" in
        --quick) LIMIT=270 ;;
        --dry-run) LIMIT=300 ;;
    esac
done
case " $* " in
    *" --dry-run "*) ;;
    *) nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true ;;
esac
(cd "$SHADOW" && "$PY" -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())")

# SIGINT at the hard limit: the script stops its worker and writes what it measured (timeout then exits 124).
set +e
timeout -s INT -k 20 "$LIMIT" "$PY" "$SHADOW/run_gpu_bench.py" --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_bench.log"
status=${PIPESTATUS[0]}
exit "$status"
