// all_gather and reduce_scatter in the manner of PyTorch's functional
// collectives (torch/csrc/distributed/c10d/Functional.cpp): resolve the group
// by name, launch, register the work against the output and return it
// un-waited; `wait` (here, and _c10d_functional::wait_tensor) waits.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "ops.h"

namespace linnet {
namespace {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;
using GroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;

// The dispatcher's c10d ops, which route to the group's backend for the
// tensors' device. Called directly rather than through ProcessGroup's
// methods, whose names change across the torch versions we build against.
WorkPtr allgather_base(at::Tensor& output, at::Tensor& input, const GroupPtr& group) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("c10d::_allgather_base_", "")
                       .typed<std::tuple<at::Tensor, WorkPtr>(
                           at::Tensor&, at::Tensor&, const GroupPtr&, bool, int64_t)>();
  return std::get<1>(op.call(output, input, group, /*async_op=*/true, /*timeout=*/-1));
}

WorkPtr reduce_scatter_sum(at::Tensor& output, at::Tensor& input, const GroupPtr& group) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("c10d::_reduce_scatter_base_", "")
                       .typed<std::tuple<at::Tensor, WorkPtr>(
                           at::Tensor&,
                           at::Tensor&,
                           const GroupPtr&,
                           const c10::intrusive_ptr<c10d::ReduceOp>&,
                           bool,
                           int64_t)>();
  auto sum = c10::make_intrusive<c10d::ReduceOp>(c10d::ReduceOp::SUM);
  return std::get<1>(op.call(output, input, group, sum, /*async_op=*/true, /*timeout=*/-1));
}

GroupPtr resolve_group(const char* op, const std::string& group_name, int64_t group_size) {
  GroupPtr group = c10d::resolve_process_group(group_name);
  TORCH_CHECK(
      group->getSize() == group_size,
      op,
      ": group_size is ",
      group_size,
      " but the process group '",
      group_name,
      "' has ",
      group->getSize(),
      " ranks");
  return group;
}

}  // namespace

at::Tensor all_gather(
    const at::Tensor& part,
    at::ScalarType dtype,
    int64_t group_size,
    const std::string& group_name,
    CopyCastPad copy) {
  TORCH_CHECK(part.dim() == 1, "all_gather: expected a 1-D part, got shape ", part.sizes());
  TORCH_CHECK(group_size >= 1, "all_gather: expected group_size >= 1, got ", group_size);
  check_floating(part, "all_gather", "a part");
  TORCH_CHECK(
      at::isFloatingType(dtype),
      "all_gather: expected a floating output dtype (such as bfloat16), got ",
      dtype);
  int64_t part_size = part.numel();
  at::Tensor output = at::empty({part_size * group_size}, part.options().dtype(dtype));
  if (group_size == 1) {
    copy(part, output, 1.0);
    return output;
  }
  GroupPtr group = resolve_group("all_gather", group_name, group_size);
  // Cast straight into this rank's slot; the gather then runs in place.
  at::Tensor slot = output.narrow(0, group->getRank() * part_size, part_size);
  copy(part, slot, 1.0);
  WorkPtr work = allgather_base(output, slot, group);
  c10d::register_work(output, work);
  return output;
}

at::Tensor reduce_scatter(
    const at::Tensor& full,
    const std::string& reduce_op,
    int64_t group_size,
    const std::string& group_name,
    CopyCastPad copy) {
  TORCH_CHECK(full.dim() == 1, "reduce_scatter: expected a 1-D tensor, got shape ", full.sizes());
  TORCH_CHECK(group_size >= 1, "reduce_scatter: expected group_size >= 1, got ", group_size);
  check_floating(full, "reduce_scatter", "a tensor");
  TORCH_CHECK(
      full.numel() % group_size == 0,
      "reduce_scatter: expected a numel divisible by group_size = ",
      group_size,
      ", got ",
      full.numel());
  TORCH_CHECK(
      reduce_op == "sum" || reduce_op == "avg",
      "reduce_scatter: reduce_op must be \"sum\" or \"avg\", got \"",
      reduce_op,
      "\"");
  // avg scales each rank's contribution before a sum: one code path for
  // every backend (Gloo lacks AVG), fused into the cast.
  double scale = reduce_op == "avg" ? 1.0 / static_cast<double>(group_size) : 1.0;
  at::Tensor part = at::empty({full.numel() / group_size}, full.options().dtype(at::kFloat));
  if (group_size == 1) {
    copy(full, part, scale);
    return part;
  }
  GroupPtr group = resolve_group("reduce_scatter", group_name, group_size);
  at::Tensor input = full;
  if (full.scalar_type() != at::kFloat || scale != 1.0 || !full.is_contiguous()) {
    input = at::empty({full.numel()}, part.options());
    copy(full, input, scale);
  }
  WorkPtr work = reduce_scatter_sum(part, input, group);
  c10d::register_work(part, work);
  return part;
}

at::Tensor wait(const at::Tensor& tensor) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("_c10d_functional::wait_tensor", "")
                       .typed<at::Tensor(const at::Tensor&)>();
  return op.call(tensor);
}

}  // namespace linnet
