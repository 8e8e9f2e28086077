// Autograd formulas, registered to the Autograd key as Functional.cpp does for
// _c10d_functional_autograd. Forwards redispatch below autograd; backwards call
// ops through the dispatcher, so AOTAutograd traces them into the graph.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>

#include "ops.h"

namespace linnet {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

at::Tensor call_all_gather(
    const at::Tensor& part,
    at::ScalarType dtype,
    int64_t group_size,
    const std::string& group_name) {
  static auto handle =
      op<at::Tensor(const at::Tensor&, at::ScalarType, int64_t, std::string)>("linnet::all_gather");
  return handle.call(part, dtype, group_size, group_name);
}

at::Tensor call_reduce_scatter(
    const at::Tensor& full,
    const std::string& reduce_op,
    int64_t group_size,
    const std::string& group_name) {
  static auto handle =
      op<at::Tensor(const at::Tensor&, std::string, int64_t, std::string)>("linnet::reduce_scatter");
  return handle.call(full, reduce_op, group_size, group_name);
}

class Flatten : public torch::autograd::Function<Flatten> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      at::TensorList tensors,
      at::IntArrayRef offsets,
      int64_t total) {
    std::vector<int64_t> shapes;
    std::vector<int64_t> ndims;
    for (const at::Tensor& tensor : tensors) {
      // The offsets fix every size: a traced size is specialised to its value.
      for (const c10::SymInt& size : tensor.sym_sizes()) {
        shapes.push_back(size.guard_int(__FILE__, __LINE__));
      }
      ndims.push_back(tensor.dim());
    }
    ctx->saved_data["offsets"] = offsets.vec();
    ctx->saved_data["shapes"] = shapes;
    ctx->saved_data["ndims"] = ndims;
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto handle =
        op<at::Tensor(at::TensorList, at::IntArrayRef, int64_t)>("linnet::flatten");
    return handle.call(tensors, offsets, total);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result = group_views(
        grads[0],
        ctx->saved_data["offsets"].toIntVector(),
        ctx->saved_data["shapes"].toIntVector(),
        ctx->saved_data["ndims"].toIntVector());
    result.emplace_back();  // offsets
    result.emplace_back();  // total
    return result;
  }
};

class Shard : public torch::autograd::Function<Shard> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& flat, int64_t rank, int64_t world) {
    ctx->saved_data["numel"] = flat.sym_numel();
    ctx->saved_data["rank"] = rank;
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto handle = op<at::Tensor(const at::Tensor&, int64_t, int64_t)>("linnet::shard");
    return handle.call(flat, rank, world);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // The part's padding came from no element of flat; the rest maps back.
    c10::SymInt numel = ctx->saved_data["numel"].toSymInt();
    c10::SymInt part_size = grads[0].sym_numel();
    c10::SymInt start = (part_size * ctx->saved_data["rank"].toInt()).min(numel);
    c10::SymInt count = part_size.min(numel - start);
    at::Tensor grad = at::constant_pad_nd_symint(
        grads[0].narrow_symint(0, 0, count), {start, numel - start - count});
    return {grad, at::Tensor(), at::Tensor()};
  }
};

class AllGather : public torch::autograd::Function<AllGather> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& part,
      at::ScalarType dtype,
      int64_t group_size,
      const std::string& group_name) {
    ctx->saved_data["part_dtype"] = static_cast<int64_t>(part.scalar_type());
    ctx->saved_data["group_size"] = group_size;
    ctx->saved_data["group_name"] = group_name;
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_all_gather(part, dtype, group_size, group_name);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // Every rank used the whole gathered tensor: a part's gradient is the sum
    // over ranks of the gradient of its slot, reduced in f32.
    at::Tensor grad = wait(call_reduce_scatter(
        grads[0].contiguous(),
        "sum",
        ctx->saved_data["group_size"].toInt(),
        ctx->saved_data["group_name"].toStringRef()));
    auto part_dtype = static_cast<at::ScalarType>(ctx->saved_data["part_dtype"].toInt());
    return {grad.to(part_dtype), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

class ReduceScatter : public torch::autograd::Function<ReduceScatter> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& full,
      const std::string& reduce_op,
      int64_t group_size,
      const std::string& group_name) {
    ctx->saved_data["full_dtype"] = static_cast<int64_t>(full.scalar_type());
    ctx->saved_data["avg"] = reduce_op == "avg";
    ctx->saved_data["group_size"] = group_size;
    ctx->saved_data["group_name"] = group_name;
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_reduce_scatter(full, reduce_op, group_size, group_name);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    int64_t group_size = ctx->saved_data["group_size"].toInt();
    auto full_dtype = static_cast<at::ScalarType>(ctx->saved_data["full_dtype"].toInt());
    // Scaled in f32, before the gather casts to the full tensor's dtype.
    at::Tensor part = ctx->saved_data["avg"].toBool() ? grads[0] / group_size : grads[0];
    at::Tensor grad = wait(call_all_gather(
        part.contiguous(), full_dtype, group_size, ctx->saved_data["group_name"].toStringRef()));
    return {grad, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Waiting changes no value, so its gradient is the identity. The forward calls
// _c10d_functional::wait_tensor through the dispatcher, which puts that op in
// AOTAutograd's graphs (where inductor knows it), while eager autograd sees
// this node rather than wait_tensor's missing autograd kernel.
class Wait : public torch::autograd::Function<Wait> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& tensor) {
    return wait(tensor);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0]};
  }
};

}  // namespace
}  // namespace linnet

TORCH_LIBRARY_IMPL(linnet, Autograd, m) {
  m.impl("flatten", [](at::TensorList tensors, at::IntArrayRef offsets, int64_t total) {
    return linnet::Flatten::apply(tensors, offsets, total);
  });
  m.impl("shard", [](const at::Tensor& flat, int64_t rank, int64_t world) {
    return linnet::Shard::apply(flat, rank, world);
  });
  m.impl(
      "all_gather",
      [](const at::Tensor& part, at::ScalarType dtype, int64_t group_size, std::string group_name) {
        return linnet::AllGather::apply(part, dtype, group_size, group_name);
      });
  m.impl(
      "reduce_scatter",
      [](const at::Tensor& full, std::string reduce_op, int64_t group_size, std::string group_name) {
        return linnet::ReduceScatter::apply(full, reduce_op, group_size, group_name);
      });
  m.impl("wait", [](const at::Tensor& tensor) { return linnet::Wait::apply(tensor); });
}
