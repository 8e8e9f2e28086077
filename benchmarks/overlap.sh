#!/usr/bin/env bash
# The overlap measurements of docs/design/schedule.md and docs/design/hybrid.md on one GPU, in stages of under
# ten minutes each (the build stays in the checkout between them):
#   bash benchmarks/overlap.sh build      build, CUDA tests of the simulated world and of the GPU path
#   bash benchmarks/overlap.sh sim4       8B, one GPU's share of 4 ranks: Linnet and FSDP2, no time / 360 GB/s
#   bash benchmarks/overlap.sh sim8       the same at 8 ranks
#   bash benchmarks/overlap.sh world1 [1b 3b]  world size 1: Linnet beside the plain compiled ceiling
#   bash benchmarks/overlap.sh variants   8B at 4 ranks and 360 GB/s: prefetch 2, and a bf16 reduction
#   bash benchmarks/overlap.sh hybrid M G [linnet fsdp2]  8B on M machines of G GPUs (360 GB/s inside, 45 GB/s
#                                          between; docs/design/hybrid.md): hybrid and flat, and with no time
#   bash benchmarks/overlap.sh hybrid-trace M G   Linnet's hybrid step of the same, traced: where the compute
#                                          stream waits (trace_gaps.py), trace in $OUT/hybrid-M-G/
# Logs under $OUT (given on the command line, else benchmarks/results/DATE-GPU: benchmarks/stage.sh); each run's
# RESULT and SIM lines are printed.
RUN_SHOWS="^RESULT|^SIM|Error|error:"
source "$(dirname "$0")/stage.sh"
sim() {  # world, bus GB/s, name, script and its arguments
  local world=$1 gbps=$2 name=$3; shift 3
  run "$name" env SIM_WORLD=$world SIM_BUS_GBPS=$gbps LOCAL_RANK=0 python3 benchmarks/sim_world.py "$@"
}
case "${1:-}" in
  build)
    nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv
    start=$(date +%s)
    CC=/usr/bin/gcc CXX=/usr/bin/g++ TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
      || { tail -50 "$OUT/build.log"; exit 1; }
    echo "build: $(( $(date +%s) - start )) s"
    python3 -m pytest -q -x tests/test_sim_world.py tests/test_gpu.py 2>&1 | tee "$OUT/tests.txt" | tail -5 ;;
  sim4|sim8)
    world=${1#sim}
    for gbps in inf 360; do
      sim "$world" "$gbps" "linnet-8b-w$world-$gbps" benchmarks/step.py --card llama-3.1-8b --steps 8
      sim "$world" "$gbps" "fsdp2-8b-w$world-$gbps" benchmarks/peers/fsdp2_baseline.py --shape 8b --steps 8
    done
    for side in linnet fsdp2; do
      echo "$side exposed: $(python3 benchmarks/sim_world.py --compare "$OUT/$side-8b-w$world-360.log" "$OUT/$side-8b-w$world-inf.log")"
    done ;;
  variants)
    sim 4 360 linnet-8b-w4-360-prefetch2 benchmarks/step.py --card llama-3.1-8b --steps 8 --prefetch 2
    sim 4 360 linnet-8b-w4-360-bf16 benchmarks/step.py --card llama-3.1-8b --steps 8 --reduce-dtype bf16 ;;
  hybrid)  # machines, GPUs a machine, then the sides (default both)
    machines=$2 gpus=$3 world=$(( $2 * $3 )) mesh="$2x$3"
    sides=("${@:4}"); [ ${#sides[@]} -gt 0 ] || sides=(linnet fsdp2)
    export SIM_MACHINE_SIZE=$gpus SIM_NET_GBPS=45
    for side in "${sides[@]}"; do
      case $side in
        linnet) step=(benchmarks/step.py --card llama-3.1-8b --steps 8) ;;
        fsdp2) step=(benchmarks/peers/fsdp2_baseline.py --shape 8b --steps 8) ;;
        *) echo "hybrid: no side $side (linnet, fsdp2)"; exit 2 ;;
      esac
      sim "$world" inf "$side-8b-$mesh-inf" "${step[@]}" --mesh "$mesh"
      sim "$world" 360 "$side-8b-$mesh" "${step[@]}" --mesh "$mesh"
      sim "$world" 360 "$side-8b-flat$world" "${step[@]}"
      echo "$side hybrid exposed: $(python3 benchmarks/sim_world.py --compare "$OUT/$side-8b-$mesh.log" "$OUT/$side-8b-$mesh-inf.log")"
    done ;;
  hybrid-trace)  # machines, GPUs a machine
    export SIM_MACHINE_SIZE=$3 SIM_NET_GBPS=45
    trace="$OUT/hybrid-$2-$3"
    sim $(( $2 * $3 )) 360 "linnet-8b-$2x$3-traced" benchmarks/step.py --card llama-3.1-8b --steps 8 --mesh "$2x$3" --profile "$trace"
    python3 benchmarks/trace_gaps.py "$trace/trace.json.gz" --top 25 | tee "$OUT/hybrid-$2-$3-gaps.txt" ;;
  world1)
    shapes=("${@:2}"); [ ${#shapes[@]} -gt 0 ] || shapes=(1b 3b)
    for shape in "${shapes[@]}"; do
      run "linnet-$shape" torchrun --nproc_per_node=1 benchmarks/step.py --card llama-3.2-$shape --steps 20
      run "ceiling-$shape" python3 benchmarks/peers/plain_ceiling.py --shape $shape --steps 20
    done ;;
  *) echo "usage: bash benchmarks/overlap.sh build|sim4|sim8|world1|variants|hybrid MACHINES GPUS [SIDES]|hybrid-trace MACHINES GPUS"; exit 2 ;;
esac
