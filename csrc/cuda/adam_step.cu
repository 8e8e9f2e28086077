// Adam's step of an f32 part on CUDA, one pass over it: the part and its two
// moments read and written, the gradient read in its own dtype (a bf16
// gradient is not widened into a buffer of its own first). ATen's fused
// kernel (csrc/adam_step.cpp, and so torch.optim.Adam(W)(fused=True)) does
// the same arithmetic through multi_tensor_apply, whose launches of a few
// hundred blocks reach about 2.8-3.5 TB/s of an H200's 4.8 on one large part
// (benchmarks/adam_bench.py); this kernel strides one grid over the part.
// Asked for a copy, it also writes the stepped part cast to bf16 or f16 (two
// bytes more a parameter), which the next forward takes for the part's cast
// (csrc/stepped_casts.cpp).
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

constexpr int kThreads = 256;
constexpr int kWidth = 4;  // elements a thread takes at a time: 16 bytes of each f32 tensor

struct Settings {
  const float* step;          // the count, already counted up
  const float* lr_on_device;  // null where the rate came from the host
  float lr;
  float beta1;
  float beta2;
  float weight_decay;
  float eps;
};

// The arithmetic of ATen's fused Adam in f32 (aten/src/ATen/native/cuda/fused_adam_utils.cuh), written
// in the same order, so that it rounds as the optimizer's fused step does.
template <bool kDecoupled>
struct Update {
  float lr, beta1, beta2, weight_decay, eps, step_size, bias_correction2_sqrt;

  __device__ explicit Update(const Settings& s)
      : lr(s.lr_on_device ? *s.lr_on_device : s.lr),
        beta1(s.beta1),
        beta2(s.beta2),
        weight_decay(s.weight_decay),
        eps(s.eps) {
    const float step = *s.step;
    step_size = lr / (1 - powf(beta1, step));
    bias_correction2_sqrt = sqrtf(1 - powf(beta2, step));
  }

  __device__ __forceinline__ void operator()(float& param, float& exp_avg, float& exp_avg_sq, float grad) const {
    if (weight_decay != 0) {
      if constexpr (kDecoupled) {
        param -= lr * weight_decay * param;
      } else {
        grad += param * weight_decay;  // ATen's rounds differently here, by an ulp or so (tests/test_gpu_adam_step.py)
      }
    }
    exp_avg = fmaf(beta1, exp_avg, fmaf(-beta1, grad, grad));
    exp_avg_sq = fmaf(beta2, exp_avg_sq, fmaf(-beta2, grad * grad, grad * grad));
    const float denom = (sqrtf(exp_avg_sq) / bias_correction2_sqrt) + eps;
    param -= step_size * exp_avg / denom;
  }
};

// Elements [begin, n) one at a time, over the whole grid; the copy, where there is one, cast from each.
template <typename Grad, typename Copy, bool kDecoupled>
__device__ void elementwise(
    const Update<kDecoupled>& update,
    float* param,
    float* exp_avg,
    float* exp_avg_sq,
    const Grad* grad,
    Copy* copy,
    int64_t begin,
    int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = begin + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    update(param[i], exp_avg[i], exp_avg_sq[i], static_cast<float>(grad[i]));
    if (copy != nullptr) {
      copy[i] = static_cast<Copy>(param[i]);
    }
  }
}

// `vectorised`: every pointer is aligned for kWidth elements, so each thread loads and stores kWidth of
// each tensor at a time, and the last n % kWidth elements go one at a time. `copy`: null, or where the
// stepped part is written cast to Copy.
template <typename Grad, typename Copy, bool kDecoupled>
__global__ void __launch_bounds__(kThreads) adam_kernel(
    float* __restrict__ param,
    float* __restrict__ exp_avg,
    float* __restrict__ exp_avg_sq,
    const Grad* __restrict__ grad,
    Copy* __restrict__ copy,
    int64_t n,
    Settings settings,
    bool vectorised) {
  const Update<kDecoupled> update(settings);
  if (!vectorised) {
    elementwise(update, param, exp_avg, exp_avg_sq, grad, copy, 0, n);
    return;
  }
  using Floats = Vector<float, kWidth>;
  using Grads = Vector<Grad, kWidth>;
  using Copies = Vector<Copy, kWidth>;
  const int64_t chunks = n / kWidth;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t chunk = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; chunk < chunks; chunk += stride) {
    Floats p = reinterpret_cast<const Floats*>(param)[chunk];
    Floats m = reinterpret_cast<const Floats*>(exp_avg)[chunk];
    Floats v = reinterpret_cast<const Floats*>(exp_avg_sq)[chunk];
    const Grads g = reinterpret_cast<const Grads*>(grad)[chunk];
#pragma unroll
    for (int j = 0; j < kWidth; ++j) {
      update(p.values[j], m.values[j], v.values[j], static_cast<float>(g.values[j]));
    }
    reinterpret_cast<Floats*>(param)[chunk] = p;
    reinterpret_cast<Floats*>(exp_avg)[chunk] = m;
    reinterpret_cast<Floats*>(exp_avg_sq)[chunk] = v;
    if (copy != nullptr) {
      Copies c;
#pragma unroll
      for (int j = 0; j < kWidth; ++j) {
        c.values[j] = static_cast<Copy>(p.values[j]);  // rounded as the cast kernel rounds (to nearest even)
      }
      reinterpret_cast<Copies*>(copy)[chunk] = c;
    }
  }
  elementwise(update, param, exp_avg, exp_avg_sq, grad, copy, chunks * kWidth, n);
}

template <typename Grad, typename Copy, bool kDecoupled>
void launch(
    at::Tensor& param,
    at::Tensor& exp_avg,
    at::Tensor& exp_avg_sq,
    const at::Tensor& grad,
    Copy* copy,
    const Settings& settings) {
  float* p = param.mutable_data_ptr<float>();
  float* m = exp_avg.mutable_data_ptr<float>();
  float* v = exp_avg_sq.mutable_data_ptr<float>();
  const Grad* g = grad.const_data_ptr<Grad>();
  const bool vectorised = aligned(p, sizeof(float) * kWidth) && aligned(m, sizeof(float) * kWidth) &&
      aligned(v, sizeof(float) * kWidth) && aligned(g, sizeof(Grad) * kWidth) &&
      (copy == nullptr || aligned(copy, sizeof(Copy) * kWidth));
  const int64_t n = param.numel();
  const int64_t threads_wanted = vectorised ? std::max<int64_t>(n / kWidth, 1) : n;
  // As many blocks as the SMs hold at once, no more (one wave): the grid strides over the rest.
  int per_sm = 0;
  C10_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, adam_kernel<Grad, Copy, kDecoupled>, kThreads, 0));
  const int64_t resident =
      static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * std::max(per_sm, 1);
  const int64_t blocks = std::min((threads_wanted + kThreads - 1) / kThreads, resident);
  adam_kernel<Grad, Copy, kDecoupled>
      <<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(p, m, v, g, copy, n, settings, vectorised);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void adam_step_cuda(
    at::Tensor& param,
    at::Tensor& exp_avg,
    at::Tensor& exp_avg_sq,
    at::Tensor& step,
    const at::Tensor& gradient,
    const at::Tensor& lr,
    double beta1,
    double beta2,
    double weight_decay,
    double eps,
    bool decoupled,
    std::optional<at::ScalarType> copy_dtype) {
  const bool own = param.scalar_type() == at::kFloat && param.is_contiguous() && exp_avg.is_contiguous() &&
      exp_avg_sq.is_contiguous() && (!copy_dtype || *copy_dtype == at::kBFloat16 || *copy_dtype == at::kHalf);
  if (!own) {  // another dtype, layout or copy: ATen's fused kernel, through the device-generic body
    adam_step_(param, exp_avg, exp_avg_sq, step, gradient, lr, beta1, beta2, weight_decay, eps, decoupled, copy_dtype);
    return;
  }
  check_adam_step(param, exp_avg, exp_avg_sq, step, gradient, lr, copy_dtype);
  const at::cuda::OptionalCUDAGuard device_guard(param.device());
  step.add_(1);  // as the fused optimizer counts: first, on the device; the kernel reads it there
  if (param.numel() == 0) {
    return;
  }
  const at::Tensor grad = gradient.contiguous();
  at::Tensor lr_on_device;
  Settings settings{
      step.const_data_ptr<float>(),
      nullptr,
      0.0f,
      static_cast<float>(beta1),
      static_cast<float>(beta2),
      static_cast<float>(weight_decay),
      static_cast<float>(eps)};
  if (lr.is_cpu()) {
    settings.lr = static_cast<float>(lr.item<double>());  // as ATen reads a host rate: a double, then f32
  } else {
    lr_on_device = lr.to(at::kFloat);
    settings.lr_on_device = lr_on_device.const_data_ptr<float>();
  }
  at::Tensor copy;
  if (copy_dtype) {
    copy = at::empty_like(param, param.options().dtype(*copy_dtype));
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "adam_step_", [&] {
    using Grad = scalar_t;
    auto with_copy = [&](auto* copy_data) {
      using Copy = std::remove_pointer_t<decltype(copy_data)>;
      if (decoupled) {
        launch<Grad, Copy, true>(param, exp_avg, exp_avg_sq, grad, copy_data, settings);
      } else {
        launch<Grad, Copy, false>(param, exp_avg, exp_avg_sq, grad, copy_data, settings);
      }
    };
    if (!copy_dtype) {
      with_copy(static_cast<c10::BFloat16*>(nullptr));
    } else if (*copy_dtype == at::kBFloat16) {
      with_copy(copy.mutable_data_ptr<c10::BFloat16>());
    } else {
      with_copy(copy.mutable_data_ptr<c10::Half>());
    }
  });
  if (copy_dtype) {
    keep_stepped_cast(param, std::move(copy));
  }
}

}  // namespace
}  // namespace linnet

TORCH_LIBRARY_IMPL(linnet, CUDA, m) {
  m.impl("adam_step_", &linnet::adam_step_cuda);
}
