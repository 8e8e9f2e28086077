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
  std::vector<at::Tensor> views;
  views.reserve(offsets.size());
  size_t dim = 0;
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
    at::IntArrayRef shape = shapes.slice(dim, ndims[i]);
    dim += ndims[i];
    int64_t numel = c10::multiply_integers(shape);
    TORCH_CHECK(
        offsets[i] >= 0 && offsets[i] + numel <= flat.sym_numel(),
        "group_views: tensor ",
        i,
        " of shape ",
        shape,
        " at offset ",
        offsets[i],
        " does not fit in the flat buffer of ",
        flat.sym_numel(),
        " elements");
    views.push_back(flat.narrow(0, offsets[i], numel).view(shape));
  }
  TORCH_CHECK(
      dim == shapes.size(),
      "group_views: expected sum(ndims) == len(shapes), got ",
      dim,
      " and ",
      shapes.size());
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
