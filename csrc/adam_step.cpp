// Adam's step of one parameter, as an op that a backward can call the moment
// the parameter's gradient exists (linnet/torch/step_in_backward.py): the
// gradient is read once and can be freed, rather than every parameter's
// gradient held until an optimizer steps them all.
#include <ATen/ATen.h>

#include "ops.h"

namespace linnet {

void check_adam_step(
    const at::Tensor& param,
    const at::Tensor& exp_avg,
    const at::Tensor& exp_avg_sq,
    const at::Tensor& step,
    const at::Tensor& gradient,
    const at::Tensor& lr,
    std::optional<at::ScalarType> copy_dtype) {
  TORCH_CHECK(
      gradient.sizes() == param.sizes(),
      "adam_step_: the gradient's shape ",
      gradient.sizes(),
      " is not the parameter's ",
      param.sizes());
  TORCH_CHECK(
      at::isFloatingType(param.scalar_type()) && at::isFloatingType(gradient.scalar_type()),
      "adam_step_: the parameter and its gradient must be floating point, got ",
      param.scalar_type(),
      " and ",
      gradient.scalar_type());
  for (const at::Tensor* moment : {&exp_avg, &exp_avg_sq}) {
    TORCH_CHECK(
        moment->sizes() == param.sizes() && moment->scalar_type() == param.scalar_type(),
        "adam_step_: a moment of shape ",
        moment->sizes(),
        " and dtype ",
        moment->scalar_type(),
        " for a parameter of shape ",
        param.sizes(),
        " and dtype ",
        param.scalar_type());
  }
  const at::Tensor* on_its_device[] = {&exp_avg, &exp_avg_sq, &step, &gradient};
  for (const at::Tensor* tensor : on_its_device) {
    TORCH_CHECK(
        tensor->device() == param.device(),
        "adam_step_: the moments, the count and the gradient must be on the parameter's device (",
        param.device(),
        "), got one on ",
        tensor->device());
  }
  // On the host the rate is read as a double, as a float rate is: the step is the optimizer's to the bit.
  TORCH_CHECK(
      lr.dim() == 0 && (lr.is_cpu() || lr.device() == param.device()),
      "adam_step_: lr must be a 0-d tensor on the CPU or on the parameter's device");
  TORCH_CHECK(step.dim() == 0 && step.scalar_type() == at::kFloat, "adam_step_: step must be a 0-d float32 tensor");
  TORCH_CHECK(
      !copy_dtype || at::isFloatingType(*copy_dtype),
      "adam_step_: copy_dtype must be a floating dtype (the compute dtype), got ",
      *copy_dtype);
}

void adam_step_(
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
  check_adam_step(param, exp_avg, exp_avg_sq, step, gradient, lr, copy_dtype);
  // As torch.optim.Adam(W)(fused=True): the count first (every check above passed), then ATen's fused
  // kernel, which reads it. A narrower gradient is widened first: the kernel takes one dtype.
  step.add_(1);
  const at::Tensor grad = gradient.to(param.scalar_type()).contiguous();
  if (decoupled) {
    at::_fused_adamw_(
        {param},
        {grad},
        {exp_avg},
        {exp_avg_sq},
        {},
        {step},
        lr,
        beta1,
        beta2,
        weight_decay,
        eps,
        /*amsgrad=*/false,
        /*maximize=*/false);
  } else {
    at::_fused_adam_(
        {param},
        {grad},
        {exp_avg},
        {exp_avg_sq},
        {},
        {step},
        lr,
        beta1,
        beta2,
        weight_decay,
        eps,
        /*amsgrad=*/false,
        /*maximize=*/false);
  }
  if (copy_dtype) {
    keep_stepped_cast(param, param.to(*copy_dtype, /*non_blocking=*/false, /*copy=*/true));
  }
}

}  // namespace linnet
