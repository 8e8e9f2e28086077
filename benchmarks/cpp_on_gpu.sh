#!/usr/bin/env bash
# The C++ tests (tests/cpp) built with CUDA and run on a GPU machine. Needs torch built with CUDA, nvcc and
# CMake; GoogleTest's sources and gloo's headers come from .whl/cpp, which `pack` fills from the Debian packages
# libgtest-dev and libgloo-dev of a machine that has them (copy .whl/cpp along where the GPU machine has neither):
#
#   bash benchmarks/cpp_on_gpu.sh pack      (.whl/cpp, git-ignored: googletest's sources, gloo's headers)
#   bash benchmarks/cpp_on_gpu.sh run       on the GPU machine, with .whl/cpp in the checkout
set -euo pipefail
case "${1:-}" in
  pack)
    rm -rf .whl/cpp && mkdir -p .whl/cpp/include
    cp -r /usr/src/googletest .whl/cpp/googletest
    cp -r /usr/include/gloo .whl/cpp/include/gloo
    du -sh .whl/cpp ;;
  run)
    start=$(date +%s)
    cmake -S tests/cpp -B build/cpp-gpu -DCMAKE_BUILD_TYPE=Release -DGTEST_SOURCE_DIR="$PWD/.whl/cpp/googletest" \
      -DGLOO_INCLUDE_DIR="$PWD/.whl/cpp/include" -DCMAKE_CXX_COMPILER=/usr/bin/g++ -DCMAKE_C_COMPILER=/usr/bin/gcc \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_PREFIX_PATH="$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
      > /tmp/cpp-configure.log 2>&1 || { tail -30 /tmp/cpp-configure.log; exit 1; }
    cmake --build build/cpp-gpu --parallel 16 > /tmp/cpp-build.log 2>&1 || { grep -E "error|Error" /tmp/cpp-build.log | head -30; exit 1; }
    echo "configured and built in $(( $(date +%s) - start )) s"
    for test in flat_layout_test collectives_test; do build/cpp-gpu/$test 2>&1 | grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|OK \] CudaCopyCast|SKIPPED \]|FAILED \]"; done ;;
  *) echo "usage: bash benchmarks/cpp_on_gpu.sh pack|run"; exit 2 ;;
esac
