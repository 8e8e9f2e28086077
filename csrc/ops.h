// The device-generic bodies of Linnet's ops. Each backend supplies one
// primitive, CopyCastPad, and registers these bodies with it for its dispatch
// key (csrc/cpu/kernels.cpp, csrc/cuda/kernels.cu).
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <vector>

namespace linnet {

// Writes dst[i] = scale * src.flatten()[i] (cast to dst's dtype) for
// i < src.numel() and dst[i] = 0 for the rest of dst. dst is 1-D, contiguous,
// on src's device, with at least src.numel() elements; src may be strided.
using CopyCastPad = void (*)(const at::Tensor& src, const at::Tensor& dst, double scale);

at::Tensor flatten(at::TensorList tensors, at::IntArrayRef offsets, int64_t total, CopyCastPad copy);
at::Tensor shard(const at::Tensor& flat, int64_t rank, int64_t world, CopyCastPad copy);
// Launches the gather of every rank's part, cast to `dtype`, and returns
// (gathered, token): `gathered` is valid once waited; `token` is an empty
// tensor made by the same call, which code that orders other work after this
// launch can depend on without keeping `gathered` alive.
std::tuple<at::Tensor, at::Tensor> all_gather(
    const at::Tensor& part,
    at::ScalarType dtype,
    int64_t group_size,
    const std::string& group_name,
    CopyCastPad copy);
// One rank's gather: `part` cast to `dtype`. Its gradient goes, as it is, to
// `sink` (an expanded zero of the cast's shape and dtype, which the forward
// does not read), not to the part (csrc/autograd.cpp): on one rank, the
// optimizer steps the part from the gradient the sink receives.
at::Tensor cast_into_sink(const at::Tensor& part, const at::Tensor& sink, at::ScalarType dtype, CopyCastPad copy);
// Launches the reduce-scatter of `full` in `reduce_dtype` and returns this
// rank's part in f32, valid once waited (a narrower reduction is cast when
// waited for). With replicas > 1 (hybrid sharding), the part is then summed
// across the replicate group, launched as soon as the reduce-scatter ends
// (a side stream waits for it); "avg" averages over every rank of both.
// The collectives read only buffers this call allocates, so nothing the
// caller frees or reuses can be in flight.
at::Tensor reduce_scatter(
    const at::Tensor& full,
    const std::string& reduce_op,
    at::ScalarType reduce_dtype,
    int64_t group_size,
    const std::string& group_name,
    const std::string& replicate_group_name,
    int64_t replicas,
    CopyCastPad copy);

// Returns `tensor` once the collective that produces it has finished (the
// dispatcher's _c10d_functional::wait_tensor).
at::Tensor wait(const at::Tensor& tensor);

// `gathered` once its gather has finished; the autograd formula
// (csrc/autograd.cpp) reduce-scatters its gradient into `part`, un-waited.
// (Strings by value: the signature the dispatcher registers it with.)
at::Tensor wait_gathered(
    const at::Tensor& gathered,
    const at::Tensor& part,
    std::string reduce_op,
    at::ScalarType reduce_dtype,
    int64_t group_size,
    std::string group_name,
    std::string replicate_group_name,
    int64_t replicas);

// A copy of `x`, made once every tensor of forward_deps exists; its gradient
// is a copy of the incoming gradient, made once every tensor of
// backward_deps exists (csrc/autograd.cpp). Generated code orders
// communication with these dependencies (linnet/sharding/schedule.py).
at::Tensor after(const at::Tensor& x, at::TensorList forward_deps, at::TensorList backward_deps);

std::vector<at::Tensor> group_views(
    const at::Tensor& flat,
    at::IntArrayRef offsets,
    at::IntArrayRef shapes,
    at::IntArrayRef ndims);

// Adam's step of one parameter from its gradient, in place (param, its two
// moments, and its step count, a 0-d f32 tensor on the parameter's device):
// AdamW's decoupled weight decay if `decoupled`, Adam's L2 otherwise, with
// the numerics of torch.optim.Adam(W)(fused=True) (csrc/adam_step.cpp). The
// gradient may be narrower than the parameter (a bf16 gradient of an f32
// part): it is read as the parameter's dtype. This body takes ATen's fused
// kernel on any device; CUDA has its own for f32 parts (csrc/cuda/adam_step.cu).
// With `copy_dtype`, the stepped parameter is also cast to it and kept for the
// next cast of the parameter to take (keep_stepped_cast).
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
    std::optional<at::ScalarType> copy_dtype);

// The casts Adam's step makes of the parts it steps (csrc/stepped_casts.cpp):
// kept, one a part, from the step until the next cast of that part takes it
// (cast_into_sink), which finds none where the part changed since.
// keep_stepped_cast is called by a step's device body, below autograd;
// confirm_stepped_cast by its autograd kernel once it has counted the part's
// new version: only a confirmed cast is taken.
void keep_stepped_cast(const at::Tensor& param, at::Tensor cast);
void confirm_stepped_cast(const at::Tensor& param);
std::optional<at::Tensor> take_stepped_cast(const at::Tensor& part, at::ScalarType dtype);
int64_t stepped_casts_kept();
// Drops the casts kept for `parts` (and for parts that no longer exist).
void drop_stepped_casts(const std::vector<at::Tensor>& parts);

// The checks of adam_step_'s arguments, which every device's body makes first.
void check_adam_step(
    const at::Tensor& param,
    const at::Tensor& exp_avg,
    const at::Tensor& exp_avg_sq,
    const at::Tensor& step,
    const at::Tensor& gradient,
    const at::Tensor& lr,
    std::optional<at::ScalarType> copy_dtype);

// The target that F.cross_entropy ignores (its default ignore_index): its
// row's loss and gradient are zero.
constexpr int64_t kIgnoredTarget = -100;

// Turns each row of `logits` (rows, vocabulary) in place into the gradient of
// its cross-entropy, (softmax - onehot(target)) * scale[row], and returns the
// rows' losses, logsumexp - logit[target], in f32 (both zero where the target
// is kIgnoredTarget). This body is ATen's ops on any device; CUDA has one
// kernel of its own (csrc/cuda/cross_entropy.cu).
at::Tensor softmax_cross_entropy_(at::Tensor& logits, const at::Tensor& targets, const at::Tensor& scale);
void check_softmax_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& scale);

// The mean over `weights` of the rows' cross-entropies of hidden @ head.T,
// made `chunk_rows` rows at a time (csrc/linear_cross_entropy.cpp); with
// `gradients`, also the loss's gradients of hidden and head, else two empty
// tensors.
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_forward(
    const at::Tensor& hidden,
    const at::Tensor& head,
    const at::Tensor& targets,
    const at::Tensor& weights,
    int64_t chunk_rows,
    bool gradients);
// The loss alone (where no gradient is wanted; csrc/autograd.cpp makes both).
at::Tensor linear_cross_entropy(
    const at::Tensor& hidden,
    const at::Tensor& head,
    const at::Tensor& targets,
    const at::Tensor& weights,
    int64_t chunk_rows);

// Checks that a backend's kernels accept: a floating dtype (what the copy
// kernels are instantiated for).
void check_floating(const at::Tensor& tensor, const char* op, const char* what);

// Registers the bodies above for one backend's dispatch key.
template <CopyCastPad copy>
void register_kernels(torch::Library& m) {
  m.impl("flatten", [](at::TensorList tensors, at::IntArrayRef offsets, int64_t total) {
    return flatten(tensors, offsets, total, copy);
  });
  m.impl("shard", [](const at::Tensor& flat, int64_t rank, int64_t world) { return shard(flat, rank, world, copy); });
  m.impl(
      "all_gather",
      [](const at::Tensor& part,
         at::ScalarType dtype,
         int64_t group_size,
         std::string group_name,
         std::string /*reduce_op*/,
         std::optional<at::ScalarType> /*reduce_dtype*/,
         std::string /*replicate_group_name*/,
         int64_t /*replicas*/) {
        // The reduce settings are the gradient's (csrc/autograd.cpp).
        return all_gather(part, dtype, group_size, group_name, copy);
      });
  m.impl("cast_into_sink", [](const at::Tensor& part, const at::Tensor& sink, at::ScalarType dtype) {
    return cast_into_sink(part, sink, dtype, copy);
  });
  m.impl(
      "reduce_scatter",
      [](const at::Tensor& full,
         std::string reduce_op,
         at::ScalarType reduce_dtype,
         int64_t group_size,
         std::string group_name,
         std::string replicate_group_name,
         int64_t replicas) {
        return reduce_scatter(
            full, reduce_op, reduce_dtype, group_size, group_name, replicate_group_name, replicas, copy);
      });
}

}  // namespace linnet
