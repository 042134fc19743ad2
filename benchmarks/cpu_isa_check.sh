#!/usr/bin/env bash
# For a machine whose CPU is not the development machine's (AVX-512 BF16, AMX; no internet, torch installed): the
# native step's kernel tests that need no bundled model -- every product format (AMX tiles where granted), attention
# with shared-prefix groups against float64 softmax, the per-ISA builds -- and the shared-prefix attention
# microbenchmark at 2 threads and at every core (a GPU machine's own checks: benchmarks/gpu_check.sh). Under 5
# minutes. Log: $OUT/cpu_isa_check.log (or benchmarks/results/cpu_isa_check.log).
#   bash benchmarks/cpu_isa_check.sh
# msgspec, pyzmq and gguf, if missing there, travel as wheels in .gpu-wheels/ (as for gpu_check.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${OUT:-benchmarks/results}/cpu_isa_check.log
mkdir -p "$(dirname "$LOG")"
PY=${PY:-python3}
export RADIXSERVE_CACHE=${RADIXSERVE_CACHE:-/tmp/radixserve-cache} PYTHONUNBUFFERED=1
{
  echo "== $(date -u) $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs"
  echo "flags: $(grep -m1 -o -w -E 'avx2|avx512f|avx512_bf16|avx512_vnni|amx_tile|amx_bf16|amx_int8' /proc/cpuinfo | tr '\n' ' ')"
  source benchmarks/offline_site.sh
  $PY -c "import torch; print('torch', torch.__version__, '| cuda', torch.cuda.is_available())"
  echo "== native kernel tests (no model needed)"
  (cd /tmp && timeout 240 $PY -m pytest -q -p no:cacheprovider "$REPO/tests/test_native_decode.py" \
    -k "product_format or k_quant_formats or softmax_over_each or each_instruction_set or built_once or own_bits" \
    "$REPO/tests/test_gguf_quant.py::test_the_native_step_reads_every_format_in_its_own_bits" 2>&1 | tail -6)
  echo "== shared-prefix attention, one layer, 32 rows (shared / per-row path)"
  for threads in ${BENCH_THREADS-2 $(nproc)}; do
    for groups in 1 4; do
      echo "-- $threads threads, $groups group(s)"
      OMP_NUM_THREADS=$threads timeout 60 $PY benchmarks/shared_attention.py $groups 2>&1 | tail -7
    done
  done
} 2>&1 | tee "$LOG"
