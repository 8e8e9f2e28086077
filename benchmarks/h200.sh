#!/usr/bin/env bash
# On one Hopper GPU (H100 or H200): build the CUDA extension against the machine's
# PyTorch, run the op and GPU tests, then time Linnet beside FSDP2. Needs torch
# with CUDA, nvcc, transformers and JAX with CUDA. Writes logs under $OUT (given
# on the command line, else benchmarks/results/DATE-GPU: benchmarks/stage.sh).
# Usage: [OUT=folder] bash benchmarks/h200.sh [quick]
source "$(dirname "$0")/stage.sh"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print(torch.__version__, torch.version.cuda)"
start=$(date +%s)
# A g++ that links libstdc++ statically builds an extension that crashes on its
# first error message: build with the system compiler.
CC=/usr/bin/gcc CXX=/usr/bin/g++ TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
  || { tail -50 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s" | tee "$OUT/build-time.txt"
# Written straight to $OUT, so that a run cut short still shows how far the tests got.
python3 -m pytest -v -x tests/test_ops.py tests/test_gpu.py > "$OUT/tests.txt" 2>&1; tail -15 "$OUT/tests.txt"
run() {  # name, then the command; keeps going when one fails (in place of stage.sh's: a longer timeout)
  local name=$1; shift
  echo "== $name"; timeout 900 "$@" > "$OUT/$name.log" 2>&1; echo "exit $?"
  grep -E "RESULT|Error|error:" "$OUT/$name.log" | tail -3
}
run linnet-1b torchrun --nproc_per_node=1 benchmarks/step.py --card llama-3.2-1b --steps 30
run fsdp2-1b torchrun --nproc_per_node=1 benchmarks/peers/fsdp2_baseline.py --shape 1b --steps 30
run linnet-jax-1b python3 benchmarks/step_jax.py --card llama-3.2-1b --steps 30 --no-remat
[ "${1:-}" = quick ] && exit 0
run linnet-8b torchrun --nproc_per_node=1 benchmarks/step.py --card llama-3.1-8b --steps 10 --recompute full
run linnet-jax-8b env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 benchmarks/step_jax.py --card llama-3.1-8b --steps 10
run fsdp2-8b-ac torchrun --nproc_per_node=1 benchmarks/peers/fsdp2_baseline.py --shape 8b --ac --steps 10
