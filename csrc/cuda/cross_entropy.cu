// softmax_cross_entropy_ on CUDA: one block a row. A first pass over the row
// keeps a running maximum and sum of exponentials (the online softmax), so
// the row's logsumexp needs one read; a second pass writes the gradient over
// the logits. The arithmetic is in the logits' accumulation type (f32 for
// bf16), as the ATen body's (csrc/linear_cross_entropy.cpp).
#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <limits>

#include "../ops.h"
#include "vector.cuh"

namespace linnet {
namespace {

constexpr int kThreads = 512;

// exp on the special function unit where the math is f32 (as inductor's own
// softmax kernels compute it); double stays exact.
__device__ __forceinline__ float exp_of(float x) {
  return __expf(x);
}
__device__ __forceinline__ double exp_of(double x) {
  return exp(x);
}

// A running (maximum, sum of exp(x - maximum)) over some of a row's values.
template <typename Math>
struct Running {
  Math maximum = -std::numeric_limits<Math>::infinity();
  Math sum = 0;

  __device__ void add(Math x) {
    if (x > maximum) {
      sum = sum * exp_of(maximum - x) + 1;
      maximum = x;
    } else if (x != -std::numeric_limits<Math>::infinity()) {  // exp(-inf - -inf) would be NaN
      sum += exp_of(x - maximum);
    }
  }

  __device__ void merge(Math other_maximum, Math other_sum) {
    const Math top = other_maximum > maximum ? other_maximum : maximum;
    if (top == -std::numeric_limits<Math>::infinity()) {
      return;  // both empty (or every value -inf)
    }
    sum = sum * exp_of(maximum - top) + other_sum * exp_of(other_maximum - top);
    maximum = top;
  }
};

// The block's (maximum, sum), on every thread.
template <typename Math>
__device__ Running<Math> block_merge(Running<Math> mine) {
  __shared__ Math maxima[kThreads / 32];
  __shared__ Math sums[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) {
    mine.merge(__shfl_xor_sync(0xffffffff, mine.maximum, offset), __shfl_xor_sync(0xffffffff, mine.sum, offset));
  }
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
    maxima[warp] = mine.maximum;
    sums[warp] = mine.sum;
  }
  __syncthreads();
  Running<Math> all;
  for (int w = 0; w < kThreads / 32; ++w) {
    all.merge(maxima[w], sums[w]);
  }
  return all;
}

// `vectorised`: the row's start is aligned for N values and the row's length
// a multiple of N, so each thread reads and writes N values at a time.
template <typename T, int N>
__global__ void __launch_bounds__(kThreads) softmax_cross_entropy_kernel(
    T* __restrict__ logits,
    int64_t vocabulary,
    const int64_t* __restrict__ targets,
    const float* __restrict__ scale,
    float* __restrict__ losses,
    bool vectorised) {
  using Math = at::acc_type<T, /*is_cuda=*/true>;
  T* row = logits + blockIdx.x * vocabulary;
  const int64_t target = targets[blockIdx.x];
  const bool ignored = target == kIgnoredTarget;
  CUDA_KERNEL_ASSERT(ignored || (target >= 0 && target < vocabulary));
  // Read before the barrier in block_merge: the second pass overwrites it.
  const Math target_logit = ignored ? Math(0) : static_cast<Math>(row[target]);
  using Values = Vector<T, N>;
  const int64_t step = vectorised ? N : 1;

  Running<Math> running;
  for (int64_t begin = threadIdx.x * step; begin < vocabulary; begin += kThreads * step) {
    if (vectorised) {
      const Values values = *reinterpret_cast<const Values*>(row + begin);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        running.add(static_cast<Math>(values.values[j]));
      }
    } else {
      running.add(static_cast<Math>(row[begin]));
    }
  }
  const Running<Math> all = block_merge(running);
  const Math logsumexp = all.maximum + std::log(all.sum);
  if (threadIdx.x == 0) {
    losses[blockIdx.x] = ignored ? 0.0f : static_cast<float>(logsumexp - target_logit);
  }

  const Math factor = ignored ? Math(0) : static_cast<Math>(scale[blockIdx.x]);
  for (int64_t begin = threadIdx.x * step; begin < vocabulary; begin += kThreads * step) {
    if (vectorised) {
      Values values = *reinterpret_cast<const Values*>(row + begin);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const Math probability = exp_of(static_cast<Math>(values.values[j]) - logsumexp);
        values.values[j] = static_cast<T>((probability - Math(begin + j == target)) * factor);
      }
      *reinterpret_cast<Values*>(row + begin) = values;
    } else {
      const Math probability = exp_of(static_cast<Math>(row[begin]) - logsumexp);
      row[begin] = static_cast<T>((probability - Math(begin == target)) * factor);
    }
  }
}

at::Tensor softmax_cross_entropy_cuda(at::Tensor& logits, const at::Tensor& targets, const at::Tensor& scale) {
  check_softmax_cross_entropy(logits, targets, scale);
  TORCH_CHECK(logits.is_contiguous(), "softmax_cross_entropy_: the logits must be contiguous");
  const at::cuda::OptionalCUDAGuard device_guard(logits.device());
  const int64_t rows = logits.size(0);
  const int64_t vocabulary = logits.size(1);
  at::Tensor losses = at::empty({rows}, scale.options());
  if (rows == 0) {
    return losses;
  }
  TORCH_CHECK(vocabulary > 0, "softmax_cross_entropy_: an empty vocabulary");
  TORCH_CHECK(rows <= std::numeric_limits<int32_t>::max(), "softmax_cross_entropy_: too many rows (", rows, ")");
  const at::Tensor target_ids = targets.to(at::kLong).contiguous();
  const at::Tensor row_scale = scale.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "softmax_cross_entropy_", [&] {
    constexpr int N = 16 / sizeof(scalar_t);
    scalar_t* data = logits.mutable_data_ptr<scalar_t>();
    const bool vectorised = vocabulary % N == 0 && aligned(data, sizeof(scalar_t) * N);
    softmax_cross_entropy_kernel<scalar_t, N><<<rows, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        data,
        vocabulary,
        target_ids.const_data_ptr<int64_t>(),
        row_scale.const_data_ptr<float>(),
        losses.mutable_data_ptr<float>(),
        vectorised);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return losses;
}

}  // namespace
}  // namespace linnet

TORCH_LIBRARY_IMPL(linnet, CUDA, m) {
  m.impl("softmax_cross_entropy_", &linnet::softmax_cross_entropy_cuda);
}
