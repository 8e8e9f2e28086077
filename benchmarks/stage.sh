# Sourced by the stage scripts (kernels.sh, jax_speed.sh, overlap.sh): NVLink multicast off (the lent
# machines' rule), logs under $OUT, and run(): a command's log in $OUT/NAME.log and its RESULT lines
# printed. RUN_SHOWS (a grep pattern) and RUN_TAIL choose what is printed.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
run() {  # name, then the command; keeps going when one fails
  local name=$1; shift
  echo "== $name"; timeout 420 "$@" > "$OUT/$name.log" 2>&1; echo "exit $?"
  grep -E "${RUN_SHOWS:-^RESULT|Error|error:}" "$OUT/$name.log" | cut -c1-700 | tail -"${RUN_TAIL:-3}"
}
