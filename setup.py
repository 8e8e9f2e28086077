"""Builds linnet._C, the C++ (and, where CUDA is found, CUDA) extension that
registers torch.ops.linnet.*; the package metadata is in pyproject.toml.

    pip install --no-build-isolation -e .

builds against the torch already installed. CUDA kernels are built when this
torch is a CUDA build and nvcc is found (CUDA_HOME), for sm_90 unless
TORCH_CUDA_ARCH_LIST says otherwise.
"""

import glob
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension


def extension():
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    # The C++ standard is left to torch: its headers need C++20 from 2.13 on.
    cxx = ["-O3"]
    if torch.version.cuda is None or CUDA_HOME is None:
        return CppExtension("linnet._C", sources, extra_compile_args={"cxx": cxx})
    nvcc = ["-O3"]
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        nvcc.append("-gencode=arch=compute_90,code=sm_90")
    return CUDAExtension(
        "linnet._C",
        sources + sorted(glob.glob("csrc/cuda/*.cu")),
        extra_compile_args={"cxx": cxx, "nvcc": nvcc},
    )


setup(ext_modules=[extension()], cmdclass={"build_ext": BuildExtension})
