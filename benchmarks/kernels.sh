#!/usr/bin/env bash
# The measurements of docs/design/kernels.md on one GPU, in stages of a few minutes each (build first: bash
# benchmarks/kernels.sh build, or bash benchmarks/overlap.sh build, which also runs the GPU tests):
#   bash benchmarks/kernels.sh build       the extension alone
#   bash benchmarks/kernels.sh world1-8b [full matmuls]   8B at world size 1 under those recompute policies, beside the
#                                          ceiling with activation checkpointing (also docs/design/schedule.md)
#   bash benchmarks/kernels.sh once [1b 8b 8b-w4]   a layer compiled once (LINNET_COMPILE_LAYERS_ONCE=1) against
#                                          the unrolled function, caches off: first step, step, peak, and (8B) the
#                                          memory and un-waited collectives after each step
#   bash benchmarks/kernels.sh memory [1b 3b 8b 8b-matmuls]  the optimizer's step in the backward against after it
#                                          (step.py --step-after): step, peak memory and first step, each shape
#                                          (8b: recompute "gather"; an 8B pair takes about 7 minutes); WHEN
#                                          picks the runs (default "in-backward after")
#   bash benchmarks/kernels.sh beside [1b 3b]   the kernels' table: Linnet under "gather" and "matmuls", each with
#                                          its gathers made again in the backward and kept (--no-reshard), beside
#                                          the ceiling (plain_ceiling.py), each shape (default both); LOSS=op swaps in the
#                                          loss op (step.py --loss op) for Linnet's runs
#   bash benchmarks/kernels.sh casts [1b 3b]    Adam's step writing each part's cast for the next forward
#                                          (step.py --casts-from-step) against the forward casting, the layers'
#                                          casts kept (--no-reshard) and not, beside the ceiling (default 1b)
#   bash benchmarks/kernels.sh targets [1b 3b 8b]   the kernels' table, each shape in one run: Linnet's default,
#                                          its quickest (1b, 3b: the layers' casts kept, the step writing them)
#                                          and (1b) its leanest ("matmuls", the loss op), beside the ceiling and
#                                          FSDP2 (8b: "gather" beside both with activation checkpointing)
#   bash benchmarks/kernels.sh snapshot [1b]   what is live at the peak of the 1B's step (or 3b; RECOMPUTE, default
#                                          "matmuls", and LOSS pick the run): step.py --memory-snapshot, read by
#                                          benchmarks/memory_peak.py
#   bash benchmarks/kernels.sh profile [1b]   two traced steps ("gather"; or 3b): the kernels by time, and the
#                                          sources of the Triton ones among them (benchmarks/top_kernels.py)
#   bash benchmarks/kernels.sh clip [1b 8b-w4]   train's clipping (max_grad_norm=1.0) and accumulation (4 rows a step,
#                                          reduce-scattered each row, or held and reduce-scattered once) against its
#                                          default, the optimizer stepping in the backward: 1b on one GPU, 8b as
#                                          rank 0 of a simulated 4 ranks at 360 GB/s (sim_world.py)
# Logs under $OUT (given on the command line, else benchmarks/results/DATE-GPU: benchmarks/stage.sh); each run's
# RESULT line is printed.
source "$(dirname "$0")/stage.sh"
case "${1:-}" in
  build)  # the extension alone (overlap.sh build also runs the GPU tests)
    CC=/usr/bin/gcc CXX=/usr/bin/g++ TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
      || { tail -50 "$OUT/build.log"; exit 1; } ;;
  clip)  # then the shapes, default both
    shapes=("${@:2}"); [ ${#shapes[@]} -gt 0 ] || shapes=(1b 8b-w4)
    for shape in "${shapes[@]}"; do
      modes=(default clip clip-accumulate4)
      [ "$shape" = 1b ] || modes+=(clip-accumulate4-held)  # one rank reduce-scatters nothing: nothing to hold
      for mode in "${modes[@]}"; do
        case $mode in
          default) options=() ;;
          clip) options=(--max-grad-norm 1.0) ;;
          clip-accumulate4) options=(--max-grad-norm 1.0 --accumulate 4) ;;
          clip-accumulate4-held) options=(--max-grad-norm 1.0 --accumulate 4 --hold-gradients) ;;
        esac
        case $shape in
          1b) run "linnet-1b-$mode" torchrun --nproc_per_node=1 benchmarks/step.py --card llama-3.2-1b --steps 12 \
                "${options[@]}" ;;
          8b-w4) run "linnet-8b-w4-$mode" env SIM_WORLD=4 SIM_BUS_GBPS=360 LOCAL_RANK=0 \
                   python3 benchmarks/sim_world.py benchmarks/step.py --card llama-3.1-8b --steps 8 "${options[@]}" ;;
        esac
      done
    done ;;
  world1-8b)  # then the recompute policies, default both
    policies=("${@:2}"); [ ${#policies[@]} -gt 0 ] || policies=(full matmuls)
    for recompute in "${policies[@]}"; do
      run "linnet-8b-$recompute" torchrun --nproc_per_node=1 benchmarks/step.py --card llama-3.1-8b --recompute $recompute --steps 12
    done
    run ceiling-8b-ac python3 benchmarks/peers/plain_ceiling.py --shape 8b --ac --steps 12 ;;
  once)  # then the shapes: 1b (world 1), 8b (world 1), 8b-w4 (a simulated 4 ranks, recompute full: the region
          # is refused with "gather" over several ranks, linnet/torch/model.py says why); default all three
    export TORCHINDUCTOR_FORCE_DISABLE_CACHES=1
    shapes=("${@:2}"); [ ${#shapes[@]} -gt 0 ] || shapes=(1b 8b 8b-w4)
    for shape in "${shapes[@]}"; do
      for once in 0 1; do
        case $shape in
          1b) run "linnet-1b-once$once" env LINNET_COMPILE_LAYERS_ONCE=$once torchrun --nproc_per_node=1 benchmarks/step.py --card llama-3.2-1b --steps 12 ;;
          8b) run "linnet-8b-once$once" env LINNET_COMPILE_LAYERS_ONCE=$once torchrun --nproc_per_node=1 benchmarks/step.py --card llama-3.1-8b --steps 8 --memory-trace ;;
          8b-w4) run "linnet-8b-w4-full-once$once" env LINNET_COMPILE_LAYERS_ONCE=$once SIM_WORLD=4 SIM_BUS_GBPS=inf LOCAL_RANK=0 \
                   python3 benchmarks/sim_world.py benchmarks/step.py --card llama-3.1-8b --recompute full --steps 8 --memory-trace ;;
        esac
      done
    done ;;
  memory)  # then the shapes, default all three: the memory targets (1B 18 GiB, 3B 48 GiB, 8B 116 GiB)
    shapes=("${@:2}"); [ ${#shapes[@]} -gt 0 ] || shapes=(1b 3b 8b)
    for shape in "${shapes[@]}"; do
      case $shape in 1b) card=llama-3.2-1b; extra=() ;; 3b) card=llama-3.2-3b; extra=() ;;
                     8b) card=llama-3.1-8b; extra=(--recompute gather) ;;
                     8b-matmuls) card=llama-3.1-8b; extra=(--recompute matmuls) ;; esac
      for when in ${WHEN:-in-backward after}; do
        case $when in in-backward) flag=() ;; after) flag=(--step-after) ;;
                      *) echo "WHEN: in-backward or after, got $when"; exit 2 ;; esac
        run "linnet-$shape-step-$when" torchrun --nproc_per_node=1 benchmarks/step.py --card $card --steps 12 --compile-times "${extra[@]}" "${flag[@]}"
      done
    done ;;
  beside)
    shapes=("${@:2}"); [ ${#shapes[@]} -gt 0 ] || shapes=(1b 3b)
    for shape in "${shapes[@]}"; do
      for recompute in gather matmuls; do
        for reshard in "" --no-reshard; do
          run "linnet-$shape-$recompute${reshard:+-kept}-loss-${LOSS:-generated}" torchrun --nproc_per_node=1 \
            benchmarks/step.py --card llama-3.2-$shape --recompute $recompute $reshard --loss "${LOSS:-generated}" --steps 12
        done
      done
      run "ceiling-$shape" python3 benchmarks/peers/plain_ceiling.py --shape $shape --steps 12
    done ;;
  casts)  # then the shapes (default 1b): Adam's step writing each part's cast for the next forward, against the
          # forward casting, with the layers' casts kept (--no-reshard, where fully_shard has the step write them)
          # and not (where it does not: forced), beside the ceiling
    shapes=("${@:2}"); [ ${#shapes[@]} -gt 0 ] || shapes=(1b)
    for shape in "${shapes[@]}"; do
      for casts in auto never; do
        run "linnet-$shape-gather-kept-casts-$casts" torchrun --nproc_per_node=1 benchmarks/step.py \
          --card llama-3.2-$shape --no-reshard --casts-from-step $casts --steps 12
      done
      for casts in auto always; do
        run "linnet-$shape-gather-casts-$casts" torchrun --nproc_per_node=1 benchmarks/step.py \
          --card llama-3.2-$shape --casts-from-step $casts --steps 12
      done
      run "ceiling-$shape" python3 benchmarks/peers/plain_ceiling.py --shape $shape --steps 12
    done ;;
  targets)
    shapes=("${@:2}"); [ ${#shapes[@]} -gt 0 ] || shapes=(1b 3b 8b)
    for shape in "${shapes[@]}"; do
      case $shape in
        1b|3b)
          card=llama-3.2-$shape
          run "linnet-$shape-default" torchrun --nproc_per_node=1 benchmarks/step.py --card $card --steps 12
          run "linnet-$shape-kept" torchrun --nproc_per_node=1 benchmarks/step.py --card $card --no-reshard --steps 12
          [ $shape = 1b ] && run "linnet-$shape-matmuls-loss-op" torchrun --nproc_per_node=1 benchmarks/step.py \
            --card $card --recompute matmuls --loss op --steps 12
          run "ceiling-$shape" python3 benchmarks/peers/plain_ceiling.py --shape $shape --steps 12
          run "fsdp2-$shape" torchrun --nproc_per_node=1 benchmarks/peers/fsdp2_baseline.py --shape $shape --steps 12 ;;
        8b)
          run linnet-8b-gather torchrun --nproc_per_node=1 benchmarks/step.py --card llama-3.1-8b --steps 8
          run ceiling-8b-ac python3 benchmarks/peers/plain_ceiling.py --shape 8b --ac --steps 8
          run fsdp2-8b-ac torchrun --nproc_per_node=1 benchmarks/peers/fsdp2_baseline.py --shape 8b --ac --steps 8 ;;
        *) echo "targets: 1b, 3b or 8b, got $shape"; exit 2 ;;
      esac
    done ;;
  snapshot)
    shape=${2:-1b}; name="snapshot-$shape-${RECOMPUTE:-matmuls}-loss-${LOSS:-generated}"
    run "$name" torchrun --nproc_per_node=1 benchmarks/step.py --card llama-3.2-$shape --recompute "${RECOMPUTE:-matmuls}" \
      --loss "${LOSS:-generated}" --steps 6 --memory-snapshot "/tmp/$name.pickle"
    grep "recording" "$OUT/$name.log"
    python3 benchmarks/memory_peak.py "/tmp/$name.pickle" --top 40 > "$OUT/$name-peak.txt"; head -30 "$OUT/$name-peak.txt" ;;
  profile)
    shape=${2:-1b}
    export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/linnet-inductor}
    run "profile-$shape" torchrun --nproc_per_node=1 benchmarks/step.py --card llama-3.2-$shape --loss "${LOSS:-generated}" \
      --steps 8 --profile "$OUT/profile-$shape"
    python3 benchmarks/top_kernels.py "$OUT/profile-$shape/trace.json.gz" --top 40 --sources "$TORCHINDUCTOR_CACHE_DIR" \
      --out "$OUT/profile-$shape/kernels" | tee "$OUT/profile-$shape/top.txt" | head -30 ;;
  *) echo "usage: bash benchmarks/kernels.sh build|world1-8b [policies]|once [shapes]|memory [shapes]|beside [shapes]|casts [shapes]|targets [shapes]|snapshot [shape]|profile [shape]"; exit 2 ;;
esac
