#!/usr/bin/env bash
# The measurements of docs/design/jax_speed.md on one GPU, in stages of a few minutes each:
#   bash benchmarks/jax_speed.sh attention [1b 8b]   attention candidates over packed rows (benchmarks/attention_jax.py)
#   bash benchmarks/jax_speed.sh steps CARD [ARGS]    the JAX step as a loop and scanned (step_jax.py ARGS); at 8B
#                                                     each run takes minutes (its set-up alone)
#   bash benchmarks/jax_speed.sh torch CARD [ARGS]    the PyTorch step of the same card (step.py ARGS; needs the
#                                                     build: bash benchmarks/kernels.sh build)
#   bash benchmarks/jax_speed.sh command-buffers CARD [ARGS]  the JAX step under XLA's command-buffer settings: as
#                                                     linnet.jax.xla sets them, addresses of temporaries kept
#                                                     (update mode SKIP_TEMP), command buffers off
#   bash benchmarks/jax_speed.sh profile CARD [ARGS]  both steps traced (ARGS to step_jax.py, e.g. --no-remat), each
#                                                     trace read by trace_gaps.py: idle gaps and kernels by time,
#                                                     in $OUT/jax-NAME-gaps.txt and $OUT/torch-NAME-gaps.txt (needs the build)
# Logs under $OUT (given on the command line, else benchmarks/results/DATE-GPU: benchmarks/stage.sh); each run's
# RESULT line is printed.
RUN_TAIL=20  # a RESULT line a candidate
source "$(dirname "$0")/stage.sh"
case "${1:-}" in
  attention)
    shapes=("${@:2}"); [ ${#shapes[@]} -gt 0 ] || shapes=(1b 8b)
    for shape in "${shapes[@]}"; do run "attention-jax-$shape" python3 benchmarks/attention_jax.py --shape "$shape"; done ;;
  steps)
    card=$2; shift 2; name=${card#llama-}
    run "jax-$name-loop" python3 benchmarks/step_jax.py --card "$card" --steps 12 "$@"
    run "jax-$name-scan" python3 benchmarks/step_jax.py --card "$card" --steps 12 --scan "$@" ;;
  torch)
    card=$2; shift 2; name=${card#llama-}
    run "torch-$name" torchrun --nproc_per_node=1 benchmarks/step.py --card "$card" --steps 12 "$@" ;;
  command-buffers)  # XLA_FLAGS names an option, which linnet.jax.xla then leaves to it
    card=$2; shift 2; name=${card#llama-}
    run "jax-$name-cb-default" python3 benchmarks/step_jax.py --card "$card" --steps 12 "$@"
    run "jax-$name-cb-skip-temp" env XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP \
      python3 benchmarks/step_jax.py --card "$card" --steps 12 "$@"
    run "jax-$name-cb-off" env XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 benchmarks/step_jax.py --card "$card" --steps 12 "$@" ;;
  profile)
    card=$2; shift 2; name=${card#llama-}
    run "jax-$name-traced" python3 benchmarks/step_jax.py --card "$card" --steps 12 --profile "$OUT/jax-trace" "$@"
    run "torch-$name-traced" torchrun --nproc_per_node=1 benchmarks/step.py --card "$card" --steps 12 --profile "$OUT/torch-trace"
    for trace in jax-trace/perfetto_trace.json.gz torch-trace/trace.json.gz; do  # a run that failed left none
      [ -f "$OUT/$trace" ] && python3 benchmarks/trace_gaps.py "$OUT/$trace" --top 25 > "$OUT/${trace%%-*}-$name-gaps.txt"
    done
    rm -rf "$OUT/jax-trace" "$OUT/torch-trace"  # the raw traces are large
    head -4 "$OUT"/*-"$name"-gaps.txt ;;
  *) echo "usage: bash benchmarks/jax_speed.sh attention [shapes]|steps CARD [ARGS]|torch CARD [ARGS]|command-buffers CARD [ARGS]|profile CARD [ARGS]"; exit 2 ;;
esac
