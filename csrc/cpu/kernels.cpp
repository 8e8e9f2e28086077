// The CPU copy primitive, built from ATen's own copy, and the CPU
// registration of the device-generic ops.
#include "../ops.h"

namespace linnet {
namespace {

void copy_cast_pad_cpu(const at::Tensor& src, const at::Tensor& dst, double scale) {
  int64_t numel = src.numel();
  at::Tensor head = dst.narrow(0, 0, numel);
  if (scale == 1.0) {
    head.copy_(src.reshape({numel}));
  } else {  // scaled in f32 (f64 if either side is) and rounded once, as the CUDA kernel does
    const bool wide = src.scalar_type() == at::kDouble || dst.scalar_type() == at::kDouble;
    head.copy_(src.reshape({numel}).to(wide ? at::kDouble : at::kFloat).mul(scale));
  }
  dst.narrow(0, numel, dst.numel() - numel).zero_();
}

}  // namespace
}  // namespace linnet

TORCH_LIBRARY_IMPL(linnet, CPU, m) {
  linnet::register_kernels<linnet::copy_cast_pad_cpu>(m);
}
