#!/usr/bin/env bash
# FlashAttention-4 on a Hopper GPU (Python 3.12, torch with CUDA), for benchmarks/attention.py
# (docs/design/kernels.md). FA4 and the CUTLASS DSL packages it needs are downloaded on a machine that reaches
# PyPI and installed from those files on the GPU machine, which need not. They are split over two folders of
# under 64 MiB each, the CUDA 13 library's package (nvidia-cutlass-dsl-libs-cu13, 92 MB) cut in two parts
# across them, for machines that take files in parts of that size; `first` and `second` put them together in
# /tmp/fa4:
#
#   bash benchmarks/fa4.sh download          (.whl/fa4a and .whl/fa4b, git-ignored)
#   bash benchmarks/fa4.sh first             on the GPU machine, with .whl/fa4a in the checkout
#   bash benchmarks/fa4.sh second 8b 1b      on the same machine, with .whl/fa4b in the checkout: installs into
#                                            /tmp/site, then times attention.py's candidates, FA4 among them
#   afterwards: export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
set -euo pipefail
case "${1:-}" in
  download)
    dir=$(mktemp -d)
    for package in flash-attn-4==4.0.0b40 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
                   nvidia-cutlass-dsl-libs-cu13==4.8.1 "apache-tvm-ffi<0.2,>=0.1.11" torch-c-dlpack-ext "quack-kernels>=0.5.3"; do
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$dir" "$package"
    done
    rm -rf .whl/fa4a .whl/fa4b && mkdir -p .whl/fa4a .whl/fa4b
    mv "$dir"/nvidia_cutlass_dsl_libs_cu13-*.whl "$dir/cu13.whl"
    split -b 46M "$dir/cu13.whl" .whl/fa4a/cu13.part.
    mv .whl/fa4a/cu13.part.ab .whl/fa4b/
    rm "$dir/cu13.whl" && mv "$dir"/*.whl .whl/fa4a/
    du -sh .whl/fa4a .whl/fa4b ;;
  first)
    mkdir -p /tmp/fa4 && cp .whl/fa4a/* /tmp/fa4/ && ls /tmp/fa4 ;;
  second)  # then the shapes to time, if any: attention.py's FA4 candidates beside cuDNN's causal and flex's own
    cp .whl/fa4b/* /tmp/fa4/
    cat /tmp/fa4/cu13.part.* > /tmp/fa4/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
    rm /tmp/fa4/cu13.part.*
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/fa4/*.whl
    export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1  # the .pth a --target install skips
    python3 -c "import flash_attn.cute; print('flash_attn.cute', flash_attn.cute.__file__)"
    for shape in "${@:2}"; do
      timeout 300 python3 benchmarks/attention.py --shape "$shape" \
        --only sdpa-cudnn,flex-same-doc,flex-doc-start,flex-same-doc-flash,flex-doc-start-flash,varlen-fa4 || true
    done ;;
  *) echo "usage: bash benchmarks/fa4.sh download|first|second [shape]"; exit 2 ;;
esac
