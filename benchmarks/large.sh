#!/usr/bin/env bash
# Models larger than one GPU, one GPU's share of a simulated world (docs/design/simulation.md), on one GPU with
# torch with CUDA and nvcc, in stages of a few minutes each:
#   bash benchmarks/large.sh build     build, the GPU tests
#   bash benchmarks/large.sh linnet70  Llama 3.1 70B, random weights, full recompute: one GPU's share of 16 ranks
#   bash benchmarks/large.sh fsdp70    FSDP2 on the same: meta device, activation checkpointing
#   bash benchmarks/large.sh linnet70bf16  the same with a bf16 reduction (half the reduce-scatter's copy)
#   bash benchmarks/large.sh small     8B at 4 ranks, to check that smaller models keep their speed and memory
# Collectives move nothing and take no time (benchmarks/sim_world.py with SIM_BUS_GBPS=inf); logs under $OUT
# (given on the command line, else benchmarks/results/DATE-GPU: benchmarks/stage.sh), RESULT lines printed.
source "$(dirname "$0")/stage.sh"
sim() {  # world, name, then the script and its arguments
  local world=$1 name=$2; shift 2
  echo "== $name"
  SIM_WORLD=$world SIM_BUS_GBPS=inf LOCAL_RANK=0 timeout 560 python3 benchmarks/sim_world.py "$@" > "$OUT/$name.log" 2>&1
  echo "exit $?"; grep -E "^RESULT|Error|error:" "$OUT/$name.log" | cut -c1-700 | tail -3
}
case "${1:-}" in
  build)
    CC=/usr/bin/gcc CXX=/usr/bin/g++ TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
      || { tail -50 "$OUT/build.log"; exit 1; }
    python3 -m pytest -q -x tests/test_gpu.py 2>&1 | tee "$OUT/tests.txt" | tail -3 ;;
  linnet70) sim 16 linnet-70b-w16 benchmarks/step.py --card llama-3.1-70b --recompute full --steps 6 ;;
  linnet70bf16) sim 16 linnet-70b-w16-bf16 benchmarks/step.py --card llama-3.1-70b --recompute full --reduce-dtype bf16 --steps 6 ;;
  fsdp70) sim 16 fsdp2-70b-w16 benchmarks/peers/fsdp2_baseline.py --shape 70b --meta --ac --steps 6 ;;
  small) sim 4 linnet-8b-w4 benchmarks/step.py --card llama-3.1-8b --steps 8 ;;
  *) echo "usage: bash benchmarks/large.sh build|linnet70|linnet70bf16|fsdp70|small"; exit 2 ;;
esac
