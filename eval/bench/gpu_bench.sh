#!/usr/bin/env bash
# FlexiCache GPU benchmark for a 15-minute device lease (see eval/bench/gpu.py).
# Runs from the repository root without installing anything: builds an import tree in which
# fc_hf.kernels and fc_hf.eval point at the top-level kernels/ and eval/ folders (as pyproject.toml
# maps them), then runs the benchmark. Results: $OUT/gpu_bench.json; the table is printed last.
# Exit status 1 when the sanity check (GPU against the CPU reference, eval/bench/gpu.py) fails.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:-$ROOT/results/gpu}"
mkdir -p "$OUT"
SHADOW="$(mktemp -d)"
trap 'rm -rf "$SHADOW"' EXIT
mkdir "$SHADOW/fc_hf"
for entry in "$ROOT"/fc_hf/*; do ln -s "$entry" "$SHADOW/fc_hf/$(basename "$entry")"; done
ln -s "$ROOT/kernels" "$SHADOW/fc_hf/kernels"
ln -s "$ROOT/eval" "$SHADOW/fc_hf/eval"
export PYTHONPATH="$SHADOW${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true
python -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
exec python -m fc_hf.eval.bench.gpu --out "$OUT" "$@"
