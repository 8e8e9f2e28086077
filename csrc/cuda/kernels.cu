// The CUDA copy primitive: one vectorised cast-copy-and-pad kernel on the
// current stream, and the CUDA registration of the device-generic ops.
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../ops.h"
#include "vector.cuh"

namespace linnet {
namespace {

// The arithmetic type of a cast: double if either side is double, else float.
template <typename Src, typename Dst>
using Math = std::conditional_t<std::is_same_v<Src, double> || std::is_same_v<Dst, double>, double, float>;

template <typename Src, typename Dst>
__device__ __forceinline__ Dst cast(Src value, Math<Src, Dst> scale) {
  return static_cast<Dst>(static_cast<Math<Src, Dst>>(value) * scale);
}

// dst[i] = scale * src[i] for i < src_numel, 0 up to dst_numel. Each thread
// takes N consecutive elements: a vector load and store where the N lie wholly
// inside src, elementwise at the one boundary chunk.
template <typename Src, typename Dst, int N>
__global__ void copy_cast_pad_kernel(
    const Src* __restrict__ src,
    int64_t src_numel,
    Dst* __restrict__ dst,
    int64_t dst_numel,
    Math<Src, Dst> scale) {
  int64_t chunks = (dst_numel + N - 1) / N;
  int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t chunk = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; chunk < chunks; chunk += stride) {
    int64_t begin = chunk * N;
    if (begin + N <= src_numel) {
      auto in = reinterpret_cast<const Vector<Src, N>*>(src)[chunk];
      Vector<Dst, N> out;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        out.values[j] = cast<Src, Dst>(in.values[j], scale);
      }
      reinterpret_cast<Vector<Dst, N>*>(dst)[chunk] = out;
    } else if (begin >= src_numel && begin + N <= dst_numel) {
      Vector<Dst, N> zeros;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        zeros.values[j] = Dst(0);
      }
      reinterpret_cast<Vector<Dst, N>*>(dst)[chunk] = zeros;
    } else {
      int64_t end = begin + N < dst_numel ? begin + N : dst_numel;
      for (int64_t i = begin; i < end; ++i) {
        dst[i] = i < src_numel ? cast<Src, Dst>(src[i], scale) : Dst(0);
      }
    }
  }
}

template <typename Src, typename Dst, int N>
void launch(const Src* src, int64_t src_numel, Dst* dst, int64_t dst_numel, double scale) {
  constexpr int kThreads = 256;
  int64_t chunks = (dst_numel + N - 1) / N;
  // Enough blocks to fill the device a few times over; the kernel strides.
  int64_t max_blocks = 4LL * at::cuda::getCurrentDeviceProperties()->multiProcessorCount * (2048 / kThreads);
  int64_t blocks = std::min((chunks + kThreads - 1) / kThreads, max_blocks);
  copy_cast_pad_kernel<Src, Dst, N><<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      src, src_numel, dst, dst_numel, static_cast<Math<Src, Dst>>(scale));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void copy_cast_pad_cuda(const at::Tensor& src_tensor, const at::Tensor& dst, double scale) {
  TORCH_CHECK(
      src_tensor.device() == dst.device(),
      "expected source and destination on one device, got ",
      src_tensor.device(),
      " and ",
      dst.device());
  TORCH_INTERNAL_ASSERT(dst.is_contiguous() && dst.numel() >= src_tensor.numel());
  if (dst.numel() == 0) {
    return;
  }
  const at::cuda::OptionalCUDAGuard device_guard(dst.device());
  at::Tensor src = src_tensor.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src.scalar_type(), "copy_cast_pad", [&] {
    using Src = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dst.scalar_type(), "copy_cast_pad", [&] {
      using Dst = scalar_t;
      // Each access of the narrower side is 16 bytes (the wider side
      // takes two), where both pointers allow it.
      constexpr int N = 16 / std::min(sizeof(Src), sizeof(Dst));
      const Src* src_data = src.const_data_ptr<Src>();
      Dst* dst_data = dst.mutable_data_ptr<Dst>();
      if (aligned(src_data, sizeof(Src) * N) && aligned(dst_data, sizeof(Dst) * N)) {
        launch<Src, Dst, N>(src_data, src.numel(), dst_data, dst.numel(), scale);
      } else {
        launch<Src, Dst, 1>(src_data, src.numel(), dst_data, dst.numel(), scale);
      }
    });
  });
}

}  // namespace
}  // namespace linnet

TORCH_LIBRARY_IMPL(linnet, CUDA, m) {
  linnet::register_kernels<linnet::copy_cast_pad_cuda>(m);
}
