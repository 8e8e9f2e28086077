// The CPU copy primitive, built from ATen's own copy, and the CPU
// registration of the device-generic ops.
#include "../ops.h"

namespace linnet {
namespace {

void copy_cast_pad_cpu(const at::Tensor& src, const at::Tensor& dst, double scale) {
  int64_t numel = src.numel();
  at::Tensor head = dst.narrow(0, 0, numel);
  head.copy_(src.reshape({numel}));
  if (scale != 1.0) {
    head.mul_(scale);
  }
  dst.narrow(0, numel, dst.numel() - numel).zero_();
}

}  // namespace
}  // namespace linnet

TORCH_LIBRARY_IMPL(linnet, CPU, m) {
  linnet::register_kernels<linnet::copy_cast_pad_cpu>(m);
}
