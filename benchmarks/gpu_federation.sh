#!/usr/bin/env bash
# Issue 34's GPU measurements, in one run of at most about 8 minutes on one H100/H200:
# the FEMNIST-scale round (3,550 clients, 1,000 per round, MLP 784-200-62) against the
# hand-written vmapped reference in the same process, eager and compiled, and the
# 10-client workloads' sequential path against the per-client GPU loop.
#   OUT=/some/folder bash benchmarks/gpu_federation.sh
# Writes $OUT/gpu_scale.md, $OUT/gpu_scale_small.md and $OUT/gpu_overhead.md; paste them
# into benchmarks/results/gpu.md with the device that `nvidia-smi -L` prints
# ($OUT/device.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
export PYTHONUNBUFFERED=1
nvidia-smi -L > "$OUT/device.txt" 2>&1 || true
python benchmarks/overhead.py --scale --accelerator gpu --rounds 5 --per-round 1000 \
    --paths vectorized fused compiled --out "$OUT/gpu_scale.md"
python benchmarks/overhead.py --scale --accelerator gpu --rounds 5 --per-round 1000 \
    --network 20 16 10 --paths vectorized fused --out "$OUT/gpu_scale_small.md"
python benchmarks/overhead.py --accelerator gpu --repeats 2 --out "$OUT/gpu_overhead.md"
