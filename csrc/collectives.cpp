// all_gather and reduce_scatter in the manner of PyTorch's functional
// collectives (torch/csrc/distributed/c10d/Functional.cpp): resolve the group
// by name, launch, register the work against the output and return it
// un-waited; `wait` (here, and _c10d_functional::wait_tensor) waits.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
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
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("c10d::_allgather_base_", "")
          .typed<std::tuple<at::Tensor, WorkPtr>(at::Tensor&, at::Tensor&, const GroupPtr&, bool, int64_t)>();
  return std::get<1>(op.call(output, input, group, /*async_op=*/true, /*timeout=*/-1));
}

WorkPtr reduce_scatter_sum(at::Tensor& output, at::Tensor& input, const GroupPtr& group) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("c10d::_reduce_scatter_base_", "")
          .typed<std::tuple<at::Tensor, WorkPtr>(
              at::Tensor&, at::Tensor&, const GroupPtr&, const c10::intrusive_ptr<c10d::ReduceOp>&, bool, int64_t)>();
  auto sum = c10::make_intrusive<c10d::ReduceOp>(c10d::ReduceOp::SUM);
  return std::get<1>(op.call(output, input, group, sum, /*async_op=*/true, /*timeout=*/-1));
}

WorkPtr allreduce_sum(at::Tensor& tensor, const GroupPtr& group) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("c10d::allreduce_", "")
                       .typed<std::tuple<std::vector<at::Tensor>, WorkPtr>(
                           at::TensorList,
                           const GroupPtr&,
                           const c10::intrusive_ptr<c10d::ReduceOp>&,
                           const std::optional<at::Tensor>&,
                           bool,
                           int64_t)>();
  auto sum = c10::make_intrusive<c10d::ReduceOp>(c10d::ReduceOp::SUM);
  return std::get<1>(op.call({tensor}, group, sum, std::nullopt, /*async_op=*/true, /*timeout=*/-1));
}

// Launches `second` (a collective reading what `first` writes) once `first` is
// done, without holding up the caller's stream: on a side stream of the device
// that waits for `first`, so that the second starts when the first ends rather
// than where the caller next waits. `first_reads` (what the first collective
// reads) is recorded on the side stream: the allocator reuses its memory only
// once the first has ended, which no stream of the caller's waits for. On the
// CPU, where waiting blocks, it waits.
template <typename Launch>
WorkPtr launch_when_done(const WorkPtr& first, const at::Tensor& first_reads, Launch second) {
  const at::Device device = first_reads.device();
  if (device.is_cpu()) {
    first->wait();
    return second();
  }
  c10::impl::VirtualGuardImpl guard_impl(device.type());
  c10::Stream side = guard_impl.getStreamFromGlobalPool(device, /*isHighPriority=*/true);
  c10::StreamGuard on_side(side);
  first->wait();  // the side stream waits; the caller's does not
  guard_impl.recordDataPtrOnStream(first_reads.storage().data_ptr(), side);
  return second();
}

// The work of a reduction done in a narrower dtype than its result: waiting
// for it waits for the collective, then casts into the result on the waiting
// (current) stream, so that the result is never read before it is complete.
class CastWhenDone : public c10d::Work {
 public:
  CastWhenDone(WorkPtr collective, at::Tensor reduced, at::Tensor result)
      : collective_(std::move(collective)), reduced_(std::move(reduced)), result_(std::move(result)) {}

  bool wait(std::chrono::milliseconds timeout) override {
    bool done = collective_->wait(timeout);
    if (reduced_.defined()) {
      result_.copy_(reduced_);
      reduced_.reset();
    }
    return done;
  }

  bool isCompleted() override {
    return collective_->isCompleted() && !reduced_.defined();
  }

 private:
  WorkPtr collective_;
  at::Tensor reduced_;
  at::Tensor result_;
};

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

std::tuple<at::Tensor, at::Tensor> all_gather(
    const at::Tensor& part,
    at::ScalarType dtype,
    int64_t group_size,
    const std::string& group_name,
    CopyCastPad copy) {
  TORCH_CHECK(part.dim() == 1, "all_gather: expected a 1-D part, got shape ", part.sizes());
  TORCH_CHECK(group_size >= 1, "all_gather: expected group_size >= 1, got ", group_size);
  check_floating(part, "all_gather", "a part");
  TORCH_CHECK(
      at::isFloatingType(dtype), "all_gather: expected a floating output dtype (such as bfloat16), got ", dtype);
  int64_t part_size = part.numel();
  at::Tensor output = at::empty({part_size * group_size}, part.options().dtype(dtype));
  at::Tensor token = at::empty({0}, part.options());
  if (group_size == 1) {
    copy(part, output, 1.0);
    return {output, token};
  }
  GroupPtr group = resolve_group("all_gather", group_name, group_size);
  // Cast straight into this rank's slot; the gather then runs in place.
  at::Tensor slot = output.narrow(0, group->getRank() * part_size, part_size);
  copy(part, slot, 1.0);
  WorkPtr work = allgather_base(output, slot, group);
  c10d::register_work(output, work);
  return {output, token};
}

at::Tensor cast_into_sink(const at::Tensor& part, const at::Tensor& sink, at::ScalarType dtype, CopyCastPad copy) {
  TORCH_CHECK(
      sink.sizes() == part.sizes() && sink.scalar_type() == dtype && sink.device() == part.device(),
      "cast_into_sink: the sink must have the part's shape ",
      part.sizes(),
      " and device, in ",
      dtype,
      "; got shape ",
      sink.sizes(),
      " in ",
      sink.scalar_type(),
      " on ",
      sink.device());
  if (std::optional<at::Tensor> stepped = take_stepped_cast(part, dtype)) {
    return *std::move(stepped);  // made by the part's step, which the part has not changed since
  }
  return std::get<0>(all_gather(part, dtype, 1, "", copy));
}

at::Tensor reduce_scatter(
    const at::Tensor& full,
    const std::string& reduce_op,
    at::ScalarType reduce_dtype,
    int64_t group_size,
    const std::string& group_name,
    const std::string& replicate_group_name,
    int64_t replicas,
    CopyCastPad copy) {
  TORCH_CHECK(full.dim() == 1, "reduce_scatter: expected a 1-D tensor, got shape ", full.sizes());
  TORCH_CHECK(group_size >= 1, "reduce_scatter: expected group_size >= 1, got ", group_size);
  TORCH_CHECK(replicas >= 1, "reduce_scatter: expected replicas >= 1, got ", replicas);
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
  TORCH_CHECK(
      at::isFloatingType(reduce_dtype),
      "reduce_scatter: expected a floating reduce dtype (float32 or bfloat16), got ",
      reduce_dtype);
  // avg scales each rank's contribution before a sum: one code path for
  // every backend (Gloo lacks AVG), fused into the cast.
  double scale = reduce_op == "avg" ? 1.0 / static_cast<double>(group_size * replicas) : 1.0;
  at::Tensor part = at::empty({full.numel() / group_size}, full.options().dtype(at::kFloat));
  if (group_size == 1 && replicas == 1) {
    copy(full, part, scale);
    return part;
  }
  bool narrow = reduce_dtype != at::kFloat;
  at::Tensor reduced = narrow ? at::empty({part.numel()}, full.options().dtype(reduce_dtype)) : part;
  WorkPtr work;
  at::Tensor input;
  if (group_size == 1) {
    copy(full, reduced, scale);
  } else {
    GroupPtr group = resolve_group("reduce_scatter", group_name, group_size);
    // Always a buffer of our own: the caller (or inductor, which reuses dead
    // buffers by name) may free or overwrite `full` as soon as this returns.
    input = at::empty({full.numel()}, full.options().dtype(reduce_dtype));
    copy(full, input, scale);
    work = reduce_scatter_sum(reduced, input, group);
  }
  if (replicas > 1) {
    // Across the replicas (hybrid sharding), each holding this part: summed
    // as soon as the reduce-scatter inside the shard group ends.
    GroupPtr replicate = resolve_group("reduce_scatter", replicate_group_name, replicas);
    auto across = [&] { return allreduce_sum(reduced, replicate); };
    work = work ? launch_when_done(work, input, across) : across();
  }
  if (narrow) {
    work = c10::make_intrusive<CastWhenDone>(std::move(work), reduced, part);
  }
  c10d::register_work(part, work);
  return part;
}

at::Tensor wait_gathered(
    const at::Tensor& gathered,
    const at::Tensor& part,
    std::string /*reduce_op*/,
    at::ScalarType /*reduce_dtype*/,
    int64_t group_size,
    std::string /*group_name*/,
    std::string /*replicate_group_name*/,
    int64_t /*replicas*/) {
  TORCH_CHECK(
      gathered.dim() == 1 && part.dim() == 1 && gathered.numel() == part.numel() * group_size,
      "wait_gathered: expected a gathered buffer of group_size (",
      group_size,
      ") x the part's ",
      part.numel(),
      " elements, got ",
      gathered.sizes(),
      " and a part of ",
      part.sizes());
  return wait(gathered);
}

at::Tensor after(const at::Tensor& x, at::TensorList forward_deps, at::TensorList backward_deps) {
  return x.clone();
}

at::Tensor wait(const at::Tensor& tensor) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("_c10d_functional::wait_tensor", "")
                       .typed<at::Tensor(const at::Tensor&)>();
  return op.call(tensor);
}

}  // namespace linnet
