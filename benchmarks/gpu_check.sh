#!/usr/bin/env bash
# For a GPU machine (no internet; torch, triton, transformers installed there): the Triton kernel tests on CUDA,
# a microbenchmark of extend/decode vs torch SDPA on the same gathered K/V (and FlashAttention if importable),
# `radixserve serve` in bf16 under a short shared-prefix load, and with 2+ GPUs the tensor-parallel tests over NCCL.
# Under 5 minutes (10 with the tensor-parallel tests). Log: $OUT/gpu_check.log
# (or benchmarks/results/gpu_check.log).
#   bash benchmarks/gpu_check.sh
# Serving also needs msgspec, pyzmq, aiohttp, uvloop, prometheus_client and tqdm: if the machine lacks them,
# carry their wheels in .gpu-wheels/ (pip download --no-deps -d .gpu-wheels ...); they are installed from there offline.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${OUT:-benchmarks/results}/gpu_check.log
mkdir -p "$(dirname "$LOG")"
PY=${PY:-python}
{
  echo "== $(date) $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null)"
  source benchmarks/offline_site.sh
  $PY -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.cuda.is_available())"
  echo "== kernel tests on CUDA"
  (cd /tmp && timeout 150 $PY -m pytest -q -p no:cacheprovider "$REPO/tests/test_triton_kernels.py" \
    "$REPO/tests/test_kernels_torch.py" 2>&1 | tail -5)
  echo "== microbenchmark"
  timeout 120 $PY benchmarks/gpu_attention_bench.py 2>&1
  echo "== tensor parallelism over NCCL (--tp over this machine's GPUs; a GPU per rank)"
  if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
    (cd /tmp && timeout 300 $PY -m pytest -q -p no:cacheprovider "$REPO/tests/test_tensor_parallel.py" 2>&1 | tail -5)
  else
    echo "skipped: $(nvidia-smi -L 2>/dev/null | wc -l) GPU(s) here; NCCL ranks need a GPU each"
  fi
  echo "== radixserve serve on the GPU, 32 shared-prefix requests"
  (cd /tmp && timeout 200 $PY "$REPO/benchmarks/gpu_serve_check.py" 2>&1 | grep -v "it/s]" | tail -12)
} 2>&1 | tee "$LOG"
