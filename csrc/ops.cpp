// Linnet's op schemas, defined once, and the kernel that is the same on
// every device: the views of a gathered buffer. Importing the module
// linnet._C (csrc/module.cpp) registers them all.
#include <ATen/ATen.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>
#include <algorithm>

#include "ops.h"

namespace linnet {

std::vector<at::Tensor> group_views(
    const at::Tensor& flat,
    at::IntArrayRef offsets,
    at::IntArrayRef shapes,
    at::IntArrayRef ndims) {
  TORCH_CHECK(flat.dim() == 1, "group_views: expected a 1-D flat buffer, got shape ", flat.sizes());
  TORCH_CHECK(
      offsets.size() == ndims.size(),
      "group_views: expected one offset per tensor, got ",
      offsets.size(),
      " offsets and ",
      ndims.size(),
      " ndims");
  // One split of the whole buffer, gaps and tail included, rather than a
  // narrow per tensor: the gradient of a split is one concatenation into a
  // single buffer, where each narrow's gradient would be a buffer of its own.
  // Sizes are symbolic under torch.compile with dynamic shapes: the buffer's
  // length is a SymInt there, so the pieces are SymInts too.
  const c10::SymInt total = flat.sym_numel();
  std::vector<c10::SymInt> pieces;
  std::vector<size_t> kept;
  size_t dim = 0;
  int64_t end = 0;
  for (size_t i = 0; i < offsets.size(); ++i) {
    TORCH_CHECK(
        ndims[i] >= 0 && dim + ndims[i] <= shapes.size(),
        "group_views: ndims[",
        i,
        "] = ",
        ndims[i],
        " runs past the ",
        shapes.size(),
        " entries of shapes; expected sum(ndims) == len(shapes)");
    const auto shape = shapes.slice(dim, ndims[i]);
    TORCH_CHECK(
        std::all_of(shape.begin(), shape.end(), [](int64_t size) { return size >= 0; }),
        "group_views: tensor ",
        i,
        " has a negative size in its shape ",
        shape);
    int64_t numel = c10::multiply_integers(shape);
    dim += ndims[i];
    TORCH_SYM_CHECK(
        total.sym_ge(offsets[i] + numel).sym_and(c10::SymBool(offsets[i] >= end)),
        "group_views: tensor ",
        i,
        " of ",
        numel,
        " elements at offset ",
        offsets[i],
        " overlaps the one before it (which ends at ",
        end,
        ") or does not fit in the flat buffer of ",
        total,
        " elements");
    pieces.emplace_back(offsets[i] - end);  // the gap before it (often empty)
    kept.push_back(pieces.size());
    pieces.emplace_back(numel);
    end = offsets[i] + numel;
  }
  TORCH_CHECK(
      dim == shapes.size(), "group_views: expected sum(ndims) == len(shapes), got ", dim, " and ", shapes.size());
  pieces.push_back(total - end);
  std::vector<at::Tensor> split = flat.split_with_sizes_symint(pieces);
  std::vector<at::Tensor> views;
  views.reserve(kept.size());
  dim = 0;
  for (size_t i = 0; i < kept.size(); ++i) {
    views.push_back(split[kept[i]].view(shapes.slice(dim, ndims[i])));
    dim += ndims[i];
  }
  return views;
}

}  // namespace linnet

TORCH_LIBRARY(linnet, m) {
  // Fake (meta) kernels live in Python; torch imports this module to find them.
  m.set_python_module("linnet.torch.ops");
  const std::vector<at::Tag> tags = {at::Tag::pt2_compliant_tag};
  const std::vector<at::Tag> collective_tags = {at::Tag::pt2_compliant_tag, at::Tag::needs_contiguous_strides};
  m.def("flatten(Tensor[] tensors, int[] offsets, int total) -> Tensor", tags);
  m.def("shard(Tensor flat, int rank, int world) -> Tensor", tags);
  m.def(
      "group_views(Tensor(a -> *) flat, int[] offsets, int[] shapes, int[] ndims) -> Tensor(a)[]",
      torch::dispatch(c10::DispatchKey::CompositeImplicitAutograd, &linnet::group_views),
      tags);
  // all_gather's last four arguments are its gradient's: summed or averaged
  // over ranks, in f32 by default, and summed across the replicas that hold
  // the same part (hybrid sharding) as reduce_scatter's.
  m.def(
      "all_gather(Tensor part, ScalarType dtype, int group_size, str group_name, "
      "str reduce_op=\"sum\", ScalarType? reduce_dtype=None, str replicate_group_name=\"\", "
      "int replicas=1) -> (Tensor, Tensor)",
      collective_tags);
  m.def(
      "reduce_scatter(Tensor full, str reduce_op, ScalarType reduce_dtype, int group_size, "
      "str group_name, str replicate_group_name=\"\", int replicas=1) -> Tensor",
      collective_tags);
  // On one rank: a part's cast, whose gradient goes to `sink` (csrc/ops.h).
  m.def("cast_into_sink(Tensor part, Tensor sink, ScalarType dtype) -> Tensor", tags);
  m.def(
      "after(Tensor x, Tensor[] forward_deps, Tensor[] backward_deps) -> Tensor",
      torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &linnet::after),
      tags);
  m.def(
      "wait(Tensor tensor) -> Tensor",
      torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &linnet::wait),
      tags);
  // A gather launched from a detached part, waited for: its gradient is
  // reduce-scattered into `part` where the backward reaches this wait, and
  // handed on un-waited (the caller waits for it, as late as it can).
  m.def(
      "wait_gathered(Tensor gathered, Tensor part, str reduce_op, ScalarType reduce_dtype, int group_size, "
      "str group_name, str replicate_group_name=\"\", int replicas=1) -> Tensor",
      torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &linnet::wait_gathered),
      tags);
  // The head's product and the cross-entropy, a chunk of rows at a time:
  // `linear_cross_entropy` is the loss (differentiable: its gradients are
  // made in the forward, below autograd, by `linear_cross_entropy_forward`);
  // `softmax_cross_entropy_` turns a chunk's logits into their gradient.
  m.def(
      "linear_cross_entropy(Tensor hidden, Tensor head, Tensor targets, Tensor weights, int chunk_rows) -> Tensor",
      torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &linnet::linear_cross_entropy),
      tags);
  m.def(
      "linear_cross_entropy_forward(Tensor hidden, Tensor head, Tensor targets, Tensor weights, int chunk_rows, "
      "bool gradients) -> (Tensor, Tensor, Tensor)",
      torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &linnet::linear_cross_entropy_forward),
      tags);
  m.def(
      "softmax_cross_entropy_(Tensor(a!) logits, Tensor targets, Tensor scale) -> Tensor",
      torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &linnet::softmax_cross_entropy_),
      tags);
  // Adam's step of one parameter, in place, for a backward to take where the
  // gradient arrives (the lr a tensor, so that a schedule changes no graph);
  // with copy_dtype, the parameter's cast kept for its next cast (csrc/ops.h).
  m.def(
      "adam_step_(Tensor(a!) param, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor(d!) step, "
      "Tensor gradient, Tensor lr, float beta1, float beta2, float weight_decay, float eps, "
      "bool decoupled=True, ScalarType? copy_dtype=None) -> ()",
      torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &linnet::adam_step_),
      tags);
}
