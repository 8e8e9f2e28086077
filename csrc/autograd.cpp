// Autograd formulas, registered to the Autograd key as Functional.cpp does for
// _c10d_functional_autograd. Forwards redispatch below autograd; backwards call
// ops through the dispatcher, so AOTAutograd traces them into the graph.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
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

std::tuple<at::Tensor, at::Tensor> call_all_gather(
    const at::Tensor& part,
    at::ScalarType dtype,
    int64_t group_size,
    const std::string& group_name) {
  static auto handle = op<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&,
      at::ScalarType,
      int64_t,
      std::string,
      std::string,
      std::optional<at::ScalarType>,
      std::string,
      int64_t)>("linnet::all_gather");
  return handle.call(part, dtype, group_size, group_name, "sum", std::nullopt, "", 1);
}

at::Tensor call_reduce_scatter(
    const at::Tensor& full,
    const std::string& reduce_op,
    at::ScalarType reduce_dtype,
    int64_t group_size,
    const std::string& group_name,
    const std::string& replicate_group_name = "",
    int64_t replicas = 1) {
  static auto handle =
      op<at::Tensor(const at::Tensor&, std::string, at::ScalarType, int64_t, std::string, std::string, int64_t)>(
          "linnet::reduce_scatter");
  return handle.call(full, reduce_op, reduce_dtype, group_size, group_name, replicate_group_name, replicas);
}

at::Tensor call_after(const at::Tensor& x, at::TensorList forward_deps, at::TensorList backward_deps) {
  static auto handle = op<at::Tensor(const at::Tensor&, at::TensorList, at::TensorList)>("linnet::after");
  return handle.call(x, forward_deps, backward_deps);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_linear_cross_entropy_forward(
    const at::Tensor& hidden,
    const at::Tensor& head,
    const at::Tensor& targets,
    const at::Tensor& weights,
    int64_t chunk_rows,
    bool gradients = true) {
  static auto handle = op<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, bool)>(
      "linnet::linear_cross_entropy_forward");
  return handle.call(hidden, head, targets, weights, chunk_rows, gradients);
}

// How a gradient is reduce-scattered into a part (and summed across the
// replicas that hold it): kept by a forward, used by its backward
// (AllGather's, which waits, and WaitGathered's, which does not).
void save_reduction(
    AutogradContext* ctx,
    const std::string& reduce_op,
    at::ScalarType reduce_dtype,
    int64_t group_size,
    const std::string& group_name,
    const std::string& replicate_group_name = "",
    int64_t replicas = 1) {
  ctx->saved_data["reduce_op"] = reduce_op;
  ctx->saved_data["reduce_dtype"] = static_cast<int64_t>(reduce_dtype);
  ctx->saved_data["group_size"] = group_size;
  ctx->saved_data["group_name"] = group_name;
  ctx->saved_data["replicate_group_name"] = replicate_group_name;
  ctx->saved_data["replicas"] = replicas;
}

// Launches the reduction save_reduction described; the result is f32 and un-waited.
at::Tensor launch_reduction(AutogradContext* ctx, const at::Tensor& grad) {
  return call_reduce_scatter(
      grad.contiguous(),
      ctx->saved_data["reduce_op"].toStringRef(),
      static_cast<at::ScalarType>(ctx->saved_data["reduce_dtype"].toInt()),
      ctx->saved_data["group_size"].toInt(),
      ctx->saved_data["group_name"].toStringRef(),
      ctx->saved_data["replicate_group_name"].toStringRef(),
      ctx->saved_data["replicas"].toInt());
}

class Flatten : public torch::autograd::Function<Flatten> {
 public:
  static at::Tensor forward(AutogradContext* ctx, at::TensorList tensors, at::IntArrayRef offsets, int64_t total) {
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
    static auto handle = op<at::Tensor(at::TensorList, at::IntArrayRef, int64_t)>("linnet::flatten");
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
    at::Tensor grad = at::constant_pad_nd_symint(grads[0].narrow_symint(0, 0, count), {start, numel - start - count});
    return {grad, at::Tensor(), at::Tensor()};
  }
};

class AllGather : public torch::autograd::Function<AllGather> {
 public:
  static variable_list forward(
      AutogradContext* ctx,
      const at::Tensor& part,
      at::ScalarType dtype,
      int64_t group_size,
      const std::string& group_name,
      const std::string& reduce_op,
      std::optional<at::ScalarType> reduce_dtype,
      const std::string& replicate_group_name,
      int64_t replicas) {
    ctx->saved_data["part_dtype"] = static_cast<int64_t>(part.scalar_type());
    save_reduction(
        ctx, reduce_op, reduce_dtype.value_or(at::kFloat), group_size, group_name, replicate_group_name, replicas);
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [gathered, token] = call_all_gather(part, dtype, group_size, group_name);
    ctx->mark_non_differentiable({token});
    return {gathered, token};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // Every rank used the whole gathered tensor: a part's gradient is the sum
    // (or mean) over ranks, and across the replicas, of the gradient of its slot, in f32.
    at::Tensor grad = wait(launch_reduction(ctx, grads[0]));
    auto part_dtype = static_cast<at::ScalarType>(ctx->saved_data["part_dtype"].toInt());
    return {
        grad.to(part_dtype),
        at::Tensor(),
        at::Tensor(),
        at::Tensor(),
        at::Tensor(),
        at::Tensor(),
        at::Tensor(),
        at::Tensor()};
  }
};

class ReduceScatter : public torch::autograd::Function<ReduceScatter> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& full,
      const std::string& reduce_op,
      at::ScalarType reduce_dtype,
      int64_t group_size,
      const std::string& group_name) {
    ctx->saved_data["full_dtype"] = static_cast<int64_t>(full.scalar_type());
    ctx->saved_data["avg"] = reduce_op == "avg";
    ctx->saved_data["group_size"] = group_size;
    ctx->saved_data["group_name"] = group_name;
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_reduce_scatter(full, reduce_op, reduce_dtype, group_size, group_name);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    int64_t group_size = ctx->saved_data["group_size"].toInt();
    auto full_dtype = static_cast<at::ScalarType>(ctx->saved_data["full_dtype"].toInt());
    // Scaled in f32, before the gather casts to the full tensor's dtype.
    at::Tensor part = ctx->saved_data["avg"].toBool() ? grads[0] / group_size : grads[0];
    at::Tensor grad = wait(std::get<0>(
        call_all_gather(part.contiguous(), full_dtype, group_size, ctx->saved_data["group_name"].toStringRef())));
    return {grad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The wait of a gather launched from a detached part: the gradient reaches
// the part from here, reduce-scattered and un-waited, so that the backward
// launches the reduce-scatter as soon as the layer's weight gradients exist
// (this node's place) and its caller decides where to wait for it.
class WaitGathered : public torch::autograd::Function<WaitGathered> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& gathered,
      const at::Tensor& part,
      const std::string& reduce_op,
      at::ScalarType reduce_dtype,
      int64_t group_size,
      const std::string& group_name,
      const std::string& replicate_group_name,
      int64_t replicas) {
    TORCH_CHECK(
        part.scalar_type() == at::kFloat,
        "wait_gathered: the part must be float32 (its gradient is handed on un-waited, so it cannot be cast), got ",
        part.scalar_type());
    save_reduction(ctx, reduce_op, reduce_dtype, group_size, group_name, replicate_group_name, replicas);
    // Below autograd this is _c10d_functional::wait_tensor, which compilers know.
    return wait_gathered(
        gathered, part, reduce_op, reduce_dtype, group_size, group_name, replicate_group_name, replicas);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result = {at::Tensor(), launch_reduction(ctx, grads[0])};
    result.resize(8);  // the settings take no gradient
    return result;
  }
};

// The cast's gradient goes to the sink as it is; the part takes none.
class CastIntoSink : public torch::autograd::Function<CastIntoSink> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& part,
      const at::Tensor& sink,
      at::ScalarType dtype) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto handle = op<at::Tensor(const at::Tensor&, const at::Tensor&, at::ScalarType)>("linnet::cast_into_sink");
    return handle.call(part, sink, dtype);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {at::Tensor(), grads[0], at::Tensor()};
  }
};

// A copy that orders: the forward runs once forward_deps exist, the backward
// (a copy of the gradient) once backward_deps exist. Only backward_deps are
// kept for the backward; the dependencies get no gradient.
class After : public torch::autograd::Function<After> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& x,
      at::TensorList forward_deps,
      at::TensorList backward_deps) {
    ctx->saved_data["forward_deps"] = static_cast<int64_t>(forward_deps.size());
    ctx->save_for_backward(backward_deps.vec());
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_after(x, forward_deps, backward_deps);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list backward_deps = ctx->get_saved_variables();
    variable_list result = {call_after(grads[0], backward_deps, {})};
    size_t deps = ctx->saved_data["forward_deps"].toInt() + backward_deps.size();
    result.resize(1 + deps);
    return result;
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

// The loss's gradients are made with it, in the forward (the logits are
// never whole: csrc/linear_cross_entropy.cpp); the backward only scales them
// by the loss's gradient. Where no gradient is wanted, none is made.
class LinearCrossEntropy : public torch::autograd::Function<LinearCrossEntropy> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& hidden,
      const at::Tensor& head,
      const at::Tensor& targets,
      const at::Tensor& weights,
      int64_t chunk_rows) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [loss, grad_hidden, grad_head] = call_linear_cross_entropy_forward(hidden, head, targets, weights, chunk_rows);
    ctx->save_for_backward({grad_hidden, grad_head});
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    return {saved[0] * grads[0], saved[1] * grads[0], at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor linear_cross_entropy_autograd(
    const at::Tensor& hidden,
    const at::Tensor& head,
    const at::Tensor& targets,
    const at::Tensor& weights,
    int64_t chunk_rows) {
  if (at::GradMode::is_enabled() && (hidden.requires_grad() || head.requires_grad())) {
    return LinearCrossEntropy::apply(hidden, head, targets, weights, chunk_rows);
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  return std::get<0>(call_linear_cross_entropy_forward(hidden, head, targets, weights, chunk_rows, false));
}

// Adam's step takes no gradient: below autograd it runs as it is, and the
// tensors it changes in place count a new version, so that autograd refuses
// a saved tensor that the step changed rather than read its new value.
void adam_step_autograd(
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
  static auto handle = op<void(
      at::Tensor&,
      at::Tensor&,
      at::Tensor&,
      at::Tensor&,
      const at::Tensor&,
      const at::Tensor&,
      double,
      double,
      double,
      double,
      bool,
      std::optional<at::ScalarType>)>("linnet::adam_step_");
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    handle.call(param, exp_avg, exp_avg_sq, step, gradient, lr, beta1, beta2, weight_decay, eps, decoupled, copy_dtype);
  }
  for (at::Tensor* changed : {&param, &exp_avg, &exp_avg_sq, &step}) {
    torch::autograd::increment_version(*changed);
  }
  if (copy_dtype) {
    confirm_stepped_cast(param);  // its cast is taken only at this version
  }
}

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
      [](const at::Tensor& part,
         at::ScalarType dtype,
         int64_t group_size,
         std::string group_name,
         std::string reduce_op,
         std::optional<at::ScalarType> reduce_dtype,
         std::string replicate_group_name,
         int64_t replicas) {
        auto outputs = linnet::AllGather::apply(
            part, dtype, group_size, group_name, reduce_op, reduce_dtype, replicate_group_name, replicas);
        return std::make_tuple(outputs[0], outputs[1]);
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
        if (replicas > 1) {  // a gradient's reduction (WaitGathered's backward launches it), not differentiated
          TORCH_CHECK(
              !full.requires_grad(),
              "reduce_scatter: no gradient through a reduction across replicas (replicas = ",
              replicas,
              ")");
          at::AutoDispatchBelowADInplaceOrView guard;
          return linnet::call_reduce_scatter(
              full, reduce_op, reduce_dtype, group_size, group_name, replicate_group_name, replicas);
        }
        return linnet::ReduceScatter::apply(full, reduce_op, reduce_dtype, group_size, group_name);
      });
  m.impl("after", [](const at::Tensor& x, at::TensorList forward_deps, at::TensorList backward_deps) {
    return linnet::After::apply(x, forward_deps, backward_deps);
  });
  m.impl("wait", [](const at::Tensor& tensor) { return linnet::Wait::apply(tensor); });
  m.impl("cast_into_sink", [](const at::Tensor& part, const at::Tensor& sink, at::ScalarType dtype) {
    return linnet::CastIntoSink::apply(part, sink, dtype);
  });
  m.impl("adam_step_", &linnet::adam_step_autograd);
  m.impl("linear_cross_entropy", &linnet::linear_cross_entropy_autograd);
  m.impl(
      "wait_gathered",
      [](const at::Tensor& gathered,
         const at::Tensor& part,
         std::string reduce_op,
         at::ScalarType reduce_dtype,
         int64_t group_size,
         std::string group_name,
         std::string replicate_group_name,
         int64_t replicas) {
        return linnet::WaitGathered::apply(
            gathered, part, reduce_op, reduce_dtype, group_size, group_name, replicate_group_name, replicas);
      });
}
