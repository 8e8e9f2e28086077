// Linnet's op schemas, defined once, and the kernels that are the same on
// every device: the flat layout (no tensors) and the views of a gathered
// buffer. Importing the module linnet._C registers them all.
#include <Python.h>

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <stdexcept>

#include "flat_layout.h"
#include "ops.h"

namespace linnet {
namespace {

std::vector<int64_t> flat_layout_op(at::IntArrayRef numels, int64_t align, int64_t world) {
  FlatLayout layout;
  try {
    layout = flat_layout(numels.vec(), align, world);
  } catch (const std::invalid_argument& error) {
    TORCH_CHECK_VALUE(false, error.what());
  }
  std::vector<int64_t> result = std::move(layout.offsets);
  result.push_back(layout.total);
  result.push_back(layout.part_size);
  return result;
}

}  // namespace

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
    int64_t numel = c10::multiply_integers(shapes.slice(dim, ndims[i]));
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
      dim == shapes.size(),
      "group_views: expected sum(ndims) == len(shapes), got ",
      dim,
      " and ",
      shapes.size());
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
  const std::vector<at::Tag> collective_tags = {
      at::Tag::pt2_compliant_tag, at::Tag::needs_contiguous_strides};
  m.def(
      "flat_layout(int[] numels, int align, int world) -> int[]",
      torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &linnet::flat_layout_op),
      tags);
  m.def("flatten(Tensor[] tensors, int[] offsets, int total) -> Tensor", tags);
  m.def("shard(Tensor flat, int rank, int world) -> Tensor", tags);
  m.def(
      "group_views(Tensor(a -> *) flat, int[] offsets, int[] shapes, int[] ndims) -> Tensor(a)[]",
      torch::dispatch(c10::DispatchKey::CompositeImplicitAutograd, &linnet::group_views),
      tags);
  m.def(
      "all_gather(Tensor part, ScalarType dtype, int group_size, str group_name) -> Tensor",
      collective_tags);
  m.def(
      "reduce_scatter(Tensor full, str reduce_op, int group_size, str group_name) -> Tensor",
      collective_tags);
  m.def(
      "wait(Tensor tensor) -> Tensor",
      torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &linnet::wait),
      tags);
}

// An empty module: importing it loads this library, whose static initialisers
// register the ops above with the dispatcher.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
