#!/usr/bin/env bash
# The TRL peer of the benchmark table (benchmarks/peers/TRL.md): TRL's SFTTrainer under accelerate's FSDP2
# plugin. Needs Python 3.12 with torch (CUDA), transformers and accelerate installed; TRL and the packages it adds
# are downloaded where PyPI is reachable and installed from those files, so the GPU machine needs no network.
#
#   bash benchmarks/trl.sh download        # where PyPI is reachable: into .whl/trl (git-ignored), prints their size
#   bash benchmarks/trl.sh install         # on the GPU machine, with .whl/trl in the checkout: pip --target /tmp/site
#   bash benchmarks/trl.sh run N ARGS...   # there: accelerate launch on N GPUs of benchmarks/peers/trl_sft.py ARGS
#   bash benchmarks/trl.sh check           # there, after install: versions and the imports trl_sft.py needs
#
# `run` sets PYTHONPATH=/tmp/site itself; benchmarks/table.py's own `accelerate launch` finds TRL only where the
# caller has exported PYTHONPATH=/tmp/site (after `install`, in the same shell).
# E.g.:  bash benchmarks/trl.sh install && bash benchmarks/trl.sh run 1 --init ... --steps 30
set -euo pipefail
cd "$(dirname "$0")/.."
DOWNLOADS=${TRL_DOWNLOADS:-.whl/trl}
SITE=${TRL_SITE:-/tmp/site}
# TRL and what it needs beyond an environment of Python 3.12, torch 2.11.0+cu130, transformers 5.17.0,
# accelerate 1.15.0, huggingface_hub 1.33.0, pyarrow, pandas, fsspec, xxhash, ... . trl 1.16.0 needs transformers>=4.56.2, accelerate>=1.10.1, datasets>=4.7.0;
# datasets 5.2.0 needs dill<0.4.2 and multiprocess<0.70.20 (and pyarrow>=24, fsspec<=2026.9.0,
# huggingface-hub>=1.31, already there). Pinned, so that what was checked on the CPU is what is installed.
PACKAGES=(trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)

case "${1:-}" in
download)
  mkdir -p "$DOWNLOADS"
  rm -f "$DOWNLOADS"/*.whl
  # The GPU machine's Python: 3.12, x86-64, manylinux. All four are pure-Python built distributions (multiprocess
  # has one a Python version: its py312 one), so the platform tags only keep pip from picking a source archive.
  ${PIP:-python3 -m pip} download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$DOWNLOADS" "${PACKAGES[@]}"
  ls -l "$DOWNLOADS"
  total=$(du -cb "$DOWNLOADS"/*.whl | tail -1 | cut -f1)
  echo "total $total bytes ($(( total / 1024 )) KiB) in $DOWNLOADS"
  [ "$total" -lt $(( 32 * 1024 * 1024 )) ] || { echo "more than 32 MiB of packages: check what was downloaded" >&2; exit 1; }
  ;;
install)
  ls "$DOWNLOADS"/*.whl > /dev/null || { echo "no packages in $DOWNLOADS: run 'download' where PyPI is reachable" >&2; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$DOWNLOADS"/*.whl
  PYTHONPATH=$SITE python3 -c "import trl, datasets, transformers, accelerate, torch; print('trl', trl.__version__, \
'datasets', datasets.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, \
'torch', torch.__version__)"
  ;;
check)
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
  python3 -m pip list 2>/dev/null | grep -i -E '^(torch|transformers|accelerate|datasets|trl|dill|multiprocess|pyarrow|fsspec|huggingface.hub|pandas|xxhash|tokenizers) ' || true
  python3 -c "from trl import SFTConfig, SFTTrainer; from trl.trainer.sft_trainer import DataCollatorForLanguageModeling; \
from datasets import Dataset; Dataset.from_dict({'a': [[1, 2]]}); print('imports ok')"
  ;;
run)
  shift
  n=${1:?run N ARGS: N processes (GPUs)}; shift
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
  # NVLink multicast off, as in benchmarks/stage.sh
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
  # `python3 -m accelerate.commands.launch` is the `accelerate launch` CLI, without relying on the PATH
  exec python3 -m accelerate.commands.launch --config_file benchmarks/peers/trl_fsdp2.yaml --num_processes "$n" \
    benchmarks/peers/trl_sft.py "$@"
  ;;
*)
  sed -n '2,12p' "$0" >&2
  exit 2
  ;;
esac
