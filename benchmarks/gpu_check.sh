#!/usr/bin/env bash
# Everything GPU-side, in one run of at most about 9 minutes on one H100/H200: the GPU test
# mode (issue 35: `pytest --accelerator gpu`, tests/conftest.py), then issue 34's GPU
# benchmarks (benchmarks/gpu_federation.sh) in the time left.
#   OUT=/some/folder bash benchmarks/gpu_check.sh
# Writes $OUT/gpu.md (the mode's report: device, driver, CUDA, torch; counts; failures),
# $OUT/test_gpu.log and the benchmark tables. On a machine that has torch with CUDA,
# Lightning and torchmetrics but not this package: the other requirements come as wheels
# in .gpu_wheels/ (`pip download -d .gpu_wheels jsonargparse[signatures] pyyaml scipy
# networkx pytest pytest-xdist` here; faiss-cpu and opacus too where the tree may grow by
# their size), and the tree is imported in place with callbacks/ and datamodules/ linked
# into lightning_fl/ (what `pip install -e .` maps).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD WANDB_MODE=offline WANDB_SILENT=true PYTHONUNBUFFERED=1
if [ -d .gpu_wheels ]; then
    python -m pip install -q --no-index --find-links .gpu_wheels .gpu_wheels/*.whl
fi
if ! python -c "import lightning_fl.callbacks" 2>/dev/null; then
    ln -sfn ../callbacks lightning_fl/callbacks
    ln -sfn ../datamodules lightning_fl/datamodules
fi
nvidia-smi -L > "$OUT/device.txt" 2>&1 || true
timeout 360 python -m pytest -q -p no:cacheprovider --accelerator gpu -n 8 --dist loadfile \
    --gpu-report "$OUT/gpu.md" --durations=20 > "$OUT/test_gpu.log" 2>&1
echo "pytest exit status $?" >> "$OUT/test_gpu.log"
tail -5 "$OUT/test_gpu.log"
OUT=$OUT timeout 150 bash benchmarks/gpu_federation.sh || echo "benchmarks stopped: $?"
# issue 66's population table on the GPU (rounds and cohorts at 10^3 and 10^6 clients)
timeout 120 python benchmarks/population.py --rounds 6 --quick \
    --out "$OUT/population_gpu.md" > "$OUT/population_gpu.log" 2>&1 || echo "population stopped: $?"
