# Sourced by the stage scripts (kernels.sh, jax_speed.sh, overlap.sh, large.sh, h200.sh): NVLink multicast off
# (NCCL's NVLS, torch's symmetric-memory multicast and NVSHMEM's: a fault there can take a shared host's GPUs out
# of service), logs under $OUT, and run(): a command's log in $OUT/NAME.log and its RESULT lines printed.
# RUN_SHOWS (a grep pattern) and RUN_TAIL choose what is printed.
# OUT, the folder of the logs, is given on the command line (OUT=folder bash benchmarks/kernels.sh ...), else
# benchmarks/results/DATE-GPU/ (e.g. benchmarks/results/2026-01-31-h200/).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
results_folder() {  # benchmarks/results/DATE-GPU, GPU the first GPU's model in lower case (h100, h200, ...)
  local gpu
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oE '[A-Z]+[0-9]+' | head -1)
  echo "benchmarks/results/$(date +%F)-$(echo "${gpu:-cpu}" | tr '[:upper:]' '[:lower:]')"
}
OUT=${OUT:-$(results_folder)}; mkdir -p "$OUT"
run() {  # name, then the command; keeps going when one fails
  local name=$1; shift
  echo "== $name"; timeout 420 "$@" > "$OUT/$name.log" 2>&1; echo "exit $?"
  grep -E "${RUN_SHOWS:-^RESULT|Error|error:}" "$OUT/$name.log" | cut -c1-700 | tail -"${RUN_TAIL:-3}"
}
