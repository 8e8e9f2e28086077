// The language model's loss from its last hidden states: the head's product
// and the cross-entropy in one op that never holds the whole logits. The rows
// go a chunk at a time: a chunk's logits are made, turned in place into their
// gradient by softmax_cross_entropy_ (one pass that also gives each row's
// loss), and multiplied into the gradients of the hidden states and of the
// head at once. So the gradients are made in the forward, and the backward
// keeps neither the logits nor the head, only the two gradients (scaled there
// by the loss's own gradient: csrc/autograd.cpp).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <limits>

#include "ops.h"

namespace linnet {

namespace {

at::Tensor call_softmax_cross_entropy(at::Tensor& logits, const at::Tensor& targets, const at::Tensor& scale) {
  static auto handle = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("linnet::softmax_cross_entropy_", "")
                           .typed<at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return handle.call(logits, targets, scale);
}

}  // namespace

void check_softmax_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& scale) {
  TORCH_CHECK(
      logits.dim() == 2, "softmax_cross_entropy_: logits must be (rows, vocabulary), got shape ", logits.sizes());
  const int64_t rows = logits.size(0);
  TORCH_CHECK(
      targets.dim() == 1 && targets.size(0) == rows && !at::isFloatingType(targets.scalar_type()),
      "softmax_cross_entropy_: targets must be integers, one per row (",
      rows,
      "), got ",
      targets.scalar_type(),
      " of shape ",
      targets.sizes());
  TORCH_CHECK(
      scale.dim() == 1 && scale.size(0) == rows && scale.scalar_type() == at::kFloat,
      "softmax_cross_entropy_: scale must be float32, one per row (",
      rows,
      "), got ",
      scale.scalar_type(),
      " of shape ",
      scale.sizes());
  TORCH_CHECK(
      targets.device() == logits.device() && scale.device() == logits.device(),
      "softmax_cross_entropy_: targets and scale must be on the logits' device (",
      logits.device(),
      ")");
}

at::Tensor softmax_cross_entropy_(at::Tensor& logits, const at::Tensor& targets, const at::Tensor& scale) {
  check_softmax_cross_entropy(logits, targets, scale);
  // In the logits' dtype's accumulation type (f32 for bf16), as F.cross_entropy of upcast logits.
  const at::ScalarType math = at::toOpMathType(logits.scalar_type());
  const at::Tensor x = logits.to(math);
  const at::Tensor lse = at::logsumexp(x, {1}, /*keepdim=*/true);
  const at::Tensor ignored = targets.eq(kIgnoredTarget);
  TORCH_CHECK(
      targets.lt(logits.size(1)).logical_and(targets.ge(0)).logical_or(ignored).all().item<bool>(),
      "softmax_cross_entropy_: a target outside [0, ",
      logits.size(1),
      ") that is not the ignored ",
      kIgnoredTarget);
  const at::Tensor index = targets.masked_fill(ignored, 0).to(at::kLong).unsqueeze(1);
  const at::Tensor losses = (lse - x.gather(1, index)).squeeze(1).masked_fill(ignored, 0).to(at::kFloat);
  at::Tensor gradient = (x - lse).exp_();
  gradient.scatter_add_(1, index, at::full_like(index, -1, gradient.options()));
  gradient.mul_(scale.masked_fill(ignored, 0).to(math).unsqueeze(1));
  logits.copy_(gradient);
  return losses;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_forward(
    const at::Tensor& hidden,
    const at::Tensor& head,
    const at::Tensor& targets,
    const at::Tensor& weights,
    int64_t chunk_rows,
    bool gradients) {
  TORCH_CHECK(
      hidden.dim() == 2 && head.dim() == 2 && hidden.size(1) == head.size(1),
      "linear_cross_entropy: hidden must be (rows, width) and head (vocabulary, width), got shapes ",
      hidden.sizes(),
      " and ",
      head.sizes());
  TORCH_CHECK(
      hidden.scalar_type() == head.scalar_type() && hidden.device() == head.device(),
      "linear_cross_entropy: hidden and head must share a dtype and a device, got ",
      hidden.scalar_type(),
      " on ",
      hidden.device(),
      " and ",
      head.scalar_type(),
      " on ",
      head.device());
  const int64_t rows = hidden.size(0);
  TORCH_CHECK(
      weights.dim() == 1 && weights.size(0) == rows && weights.device() == hidden.device(),
      "linear_cross_entropy: weights must be one per row (",
      rows,
      ") on hidden's device, got shape ",
      weights.sizes(),
      " on ",
      weights.device());
  TORCH_CHECK(
      targets.dim() == 1 && targets.size(0) == rows && targets.device() == hidden.device(),
      "linear_cross_entropy: targets must be one per row (",
      rows,
      ") on hidden's device, got shape ",
      targets.sizes(),
      " on ",
      targets.device());
  TORCH_CHECK(chunk_rows >= 1, "linear_cross_entropy: chunk_rows must be at least 1, got ", chunk_rows);
  // The loss is the mean over the weights (as the generated cross_entropy): each row's gradient is
  // its weight over their sum, which a zero sum leaves zero rather than NaN.
  const at::Tensor weight = weights.to(at::kFloat);
  const at::Tensor total = weight.sum().clamp_min(std::numeric_limits<float>::min());
  const at::Tensor scale = weight / total;
  at::Tensor losses = at::empty({rows}, weight.options());
  at::Tensor grad_hidden = gradients ? at::empty_like(hidden, at::MemoryFormat::Contiguous) : hidden.new_empty({0});
  at::Tensor grad_head = gradients ? at::empty_like(head, at::MemoryFormat::Contiguous) : head.new_empty({0});
  if (gradients && rows == 0) {
    grad_head.zero_();
  }
  const at::Tensor head_t = head.t();
  for (int64_t start = 0; start < rows; start += chunk_rows) {
    const int64_t count = std::min(chunk_rows, rows - start);
    const at::Tensor chunk = hidden.narrow(0, start, count);
    at::Tensor logits = at::mm(chunk, head_t);  // (count, vocabulary): this op's largest buffer
    losses.narrow(0, start, count)
        .copy_(call_softmax_cross_entropy(logits, targets.narrow(0, start, count), scale.narrow(0, start, count)));
    if (gradients) {  // logits now hold their gradient
      at::Tensor rows_of_grad = grad_hidden.narrow(0, start, count);
      at::mm_out(rows_of_grad, logits, head);
      // The head's gradient sums over the chunks in its own dtype: each chunk's product is
      // accumulated in f32 and added once (tests/test_linear_cross_entropy.py bounds the rounding).
      if (start == 0) {
        at::mm_out(grad_head, logits.t(), chunk);
      } else {
        grad_head.addmm_(logits.t(), chunk);
      }
    }
  }
  const at::Tensor loss = (losses * weight).sum() / total;
  return {loss, grad_hidden, grad_head};
}

at::Tensor linear_cross_entropy(
    const at::Tensor& hidden,
    const at::Tensor& head,
    const at::Tensor& targets,
    const at::Tensor& weights,
    int64_t chunk_rows) {
  return std::get<0>(linear_cross_entropy_forward(hidden, head, targets, weights, chunk_rows, /*gradients=*/false));
}

}  // namespace linnet
