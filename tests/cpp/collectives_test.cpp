// linnet::all_gather and linnet::reduce_scatter (csrc/collectives.cpp) over a
// real c10d ProcessGroupGloo of 2, 3 and 4 ranks in this one process: a thread
// per rank, the ranks meeting through one HashStore. The ops are called as
// torch.ops.linnet.* calls them, through the dispatcher, so what runs is what
// the extension registers: its schemas, its CPU kernels (with the CPU copy
// primitive, private to csrc/cpu/kernels.cpp) and its autograd kernels. Where
// the CUDA kernels are built and a GPU is present, the CUDA copy-cast is
// checked against the CPU one.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "flat_layout.h"

namespace {

// Every rank names its group alike, as ranks in separate processes do: c10d's
// thread isolation mode gives each thread a registry of its own (the mode its
// threaded process groups use), and the op takes its rank from the group.
const std::string kGroup = "linnet_test";
// A rank that fails leaves the others waiting in a collective; Gloo's timeout
// turns that wait into an error rather than a hung test.
constexpr std::chrono::seconds kTimeout(60);

// Runs body(rank) on `world` threads, each with its rank's Gloo group of
// `world` ranks registered as kGroup. Failures inside body are reported with
// the rank; an exception fails the test with its message.
void run_ranks(int world, const std::function<void(int rank)>& body) {
  c10d::set_thread_isolation_mode(true);
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(kTimeout);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      SCOPED_TRACE(testing::Message() << "rank " << rank << " of " << world);
      try {
        auto options = c10d::ProcessGroupGloo::Options::create(kTimeout);
        options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
        auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, options);
        auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, world);
        group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
        c10d::register_process_group(kGroup, group);
        body(rank);
        c10d::unregister_process_group(kGroup);
      } catch (const std::exception& error) {
        ADD_FAILURE() << error.what();
      }
    });
  }
  for (std::thread& thread : threads) {
    thread.join();
  }
}

// Calls torch.ops.linnet.<name> as Python does: the arguments given, then the
// schema's defaults for the rest; returns the outputs.
std::vector<c10::IValue> call(const std::string& name, std::vector<c10::IValue> args) {
  c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(("linnet::" + name).c_str(), "");
  const std::vector<c10::Argument>& arguments = op.schema().arguments();
  TORCH_CHECK(args.size() <= arguments.size(), "linnet::", name, " takes ", arguments.size(), " arguments");
  for (size_t i = args.size(); i < arguments.size(); ++i) {
    TORCH_CHECK(arguments[i].default_value(), "linnet::", name, ": no value for ", arguments[i].name());
    args.push_back(*arguments[i].default_value());
  }
  op.callBoxed(args);
  return args;
}

// (gathered, token); gathered is valid once waited.
std::pair<at::Tensor, at::Tensor> all_gather(
    const at::Tensor& part,
    at::ScalarType dtype,
    int64_t group_size,
    const std::string& group_name = kGroup) {
  std::vector<c10::IValue> outputs = call("all_gather", {part, dtype, group_size, group_name});
  return {outputs[0].toTensor(), outputs[1].toTensor()};
}

at::Tensor reduce_scatter(
    const at::Tensor& full,
    const std::string& reduce_op,
    at::ScalarType reduce_dtype,
    int64_t group_size,
    const std::string& group_name = kGroup) {
  return call("reduce_scatter", {full, reduce_op, reduce_dtype, group_size, group_name})[0].toTensor();
}

at::Tensor wait(const at::Tensor& tensor) {
  return call("wait", {tensor})[0].toTensor();
}

at::Tensor flatten(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets, int64_t total) {
  return call("flatten", {tensors, offsets, total})[0].toTensor();
}

at::Tensor shard(const at::Tensor& flat, int64_t rank, int64_t world) {
  return call("shard", {flat, rank, world})[0].toTensor();
}

at::Tensor random(int64_t numel, uint64_t seed, at::ScalarType dtype = at::kFloat) {
  return at::randn({numel}, at::detail::createCPUGenerator(seed)).to(dtype);
}

// Each tensor flattened at its offset in a buffer of `total` zeros: what
// linnet::flatten should make, built here with plain ATen.
at::Tensor reference_flat(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets, int64_t total) {
  at::Tensor flat = at::zeros({total}, tensors[0].options());
  for (size_t i = 0; i < tensors.size(); ++i) {
    flat.narrow(0, offsets[i], tensors[i].numel()).copy_(tensors[i].flatten());
  }
  return flat;
}

// Equal in dtype, shape and every element.
testing::AssertionResult Same(const at::Tensor& actual, const at::Tensor& expected) {
  if (actual.scalar_type() != expected.scalar_type() || actual.sizes() != expected.sizes()) {
    return testing::AssertionFailure() << "expected " << expected.scalar_type() << " of shape " << expected.sizes()
                                       << ", got " << actual.scalar_type() << " of shape " << actual.sizes();
  }
  if (at::equal(actual, expected)) {
    return testing::AssertionSuccess();
  }
  int64_t where = at::ne(actual, expected).to(at::kByte).argmax().item<int64_t>();
  return testing::AssertionFailure() << "element " << where << " is " << actual[where].item<double>() << ", expected "
                                     << expected[where].item<double>();
}

// |actual - expected| <= bound at every element (expected and bound in f64).
testing::AssertionResult Within(const at::Tensor& actual, const at::Tensor& expected, const at::Tensor& bound) {
  at::Tensor error = (actual.to(at::kDouble) - expected).abs();
  at::Tensor over = error > bound;
  if (!over.any().item<bool>()) {
    return testing::AssertionSuccess();
  }
  int64_t where = over.to(at::kByte).argmax().item<int64_t>();
  return testing::AssertionFailure() << "element " << where << " is " << actual[where].item<double>() << ", expected "
                                     << expected[where].item<double>() << " within " << bound[where].item<double>();
}

// Whether fn throws a c10::Error whose message holds `expected`.
testing::AssertionResult Throws(const std::function<void()>& fn, const std::string& expected) {
  try {
    fn();
  } catch (const c10::Error& error) {
    std::string message = error.what_without_backtrace();
    if (message.find(expected) != std::string::npos) {
      return testing::AssertionSuccess();
    }
    return testing::AssertionFailure() << "the error says \"" << message << "\", expected \"" << expected << "\"";
  }
  return testing::AssertionFailure() << "no error; expected \"" << expected << "\"";
}

// Machine epsilon of a reduce dtype.
double epsilon(at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? 0x1p-7 : 0x1p-23;
}

class Collectives : public testing::TestWithParam<int> {};

INSTANTIATE_TEST_SUITE_P(Worlds, Collectives, testing::Values(2, 3, 4), [](const auto& info) {
  return "world" + std::to_string(info.param);
});

TEST_P(Collectives, AllGatherCastsEveryPartAndConcatenatesThemInRankOrder) {
  const int world = GetParam();
  const int64_t part_size = 7;  // odd: no gathered length here is a multiple of 16
  std::vector<at::Tensor> parts;
  std::vector<at::Tensor> strided_parts;  // every other element of a longer tensor
  for (int rank = 0; rank < world; ++rank) {
    parts.push_back(random(part_size, 10 + rank));
    strided_parts.push_back(random(2 * part_size, 20 + rank).slice(0, 0, 2 * part_size, 2));
  }
  run_ranks(world, [&](int rank) {
    for (at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
      SCOPED_TRACE(testing::Message() << "gathered to " << dtype);
      auto [gathered, token] = all_gather(parts[rank], dtype, world);
      EXPECT_EQ(token.numel(), 0);
      EXPECT_TRUE(Same(wait(gathered), at::cat(parts).to(dtype)));
      EXPECT_TRUE(Same(wait(all_gather(strided_parts[rank], dtype, world).first), at::cat(strided_parts).to(dtype)));
    }
  });
}

TEST_P(Collectives, ReduceScatterSumsOrAveragesInTheReduceDtype) {
  const int world = GetParam();
  const int64_t part_size = 7;
  for (at::ScalarType full_dtype : {at::kFloat, at::kBFloat16}) {
    std::vector<at::Tensor> fulls;
    for (int rank = 0; rank < world; ++rank) {
      fulls.push_back(random(part_size * world, 30 + rank, full_dtype));
    }
    at::Tensor sum = at::zeros({part_size * world}, at::kDouble);
    at::Tensor magnitude = at::zeros({part_size * world}, at::kDouble);
    for (const at::Tensor& full : fulls) {
      sum += full.to(at::kDouble);
      magnitude += full.to(at::kDouble).abs();
    }
    run_ranks(world, [&](int rank) {
      for (at::ScalarType reduce_dtype : {at::kFloat, at::kBFloat16}) {
        for (std::string reduce_op : {"sum", "avg"}) {
          SCOPED_TRACE(testing::Message() << full_dtype << " " << reduce_op << " in " << reduce_dtype);
          at::Tensor part = wait(reduce_scatter(fulls[rank], reduce_op, reduce_dtype, world));
          // The part is f32 whatever the reduce dtype (csrc/ops.h), and holds
          // values of the reduce dtype.
          EXPECT_EQ(part.scalar_type(), at::kFloat);
          EXPECT_TRUE(Same(part, part.to(reduce_dtype).to(at::kFloat)));
          double scale = reduce_op == "avg" ? 1.0 / world : 1.0;
          at::Tensor expected = (sum * scale).narrow(0, rank * part_size, part_size);
          // Each rank's term rounds into reduce_dtype (cast, then scaled),
          // and each of the world - 1 additions rounds: a few epsilons of the
          // sum of the terms' magnitudes, whatever order Gloo adds them in.
          at::Tensor bound =
              (world + 2) * epsilon(reduce_dtype) * (magnitude * scale).narrow(0, rank * part_size, part_size);
          EXPECT_TRUE(Within(part, expected, bound));
        }
      }
    });
  }
}

TEST_P(Collectives, APaddedGroupGathersAndReduceScattersThroughItsParts) {
  const int world = GetParam();
  // 20 elements in three tensors: aligned to 4 they leave gaps, and end at 23,
  // which no part size of any world here divides.
  const std::vector<int64_t> numels = {7, 10, 3};
  const linnet::FlatLayout layout = linnet::flat_layout(numels, 4, world);
  const int64_t end = layout.offsets.back() + numels.back();
  ASSERT_GT(layout.total, end);
  std::vector<at::Tensor> tensors = {random(7, 50).reshape({7, 1}), random(10, 51), random(3, 52)};
  const at::Tensor flat = reference_flat(tensors, layout.offsets, layout.total);
  // Each rank's gradient of the whole buffer, zero in the gaps and the padding
  // as the gradient of the group's views is.
  std::vector<at::Tensor> grads;
  at::Tensor grad_sum = at::zeros({layout.total}, at::kDouble);
  at::Tensor grad_magnitude = at::zeros({layout.total}, at::kDouble);
  for (int rank = 0; rank < world; ++rank) {
    grads.push_back(reference_flat(
        {random(7, 60 + rank), random(10, 70 + rank), random(3, 80 + rank)}, layout.offsets, layout.total));
    grad_sum += grads.back().to(at::kDouble);
    grad_magnitude += grads.back().to(at::kDouble).abs();
  }
  // A buffer of 23 elements cut without a layout: the last part runs past it.
  const at::Tensor odd = random(23, 90);
  const int64_t odd_part_size = (23 + world - 1) / world;

  run_ranks(world, [&](int rank) {
    at::Tensor part = shard(flatten(tensors, layout.offsets, layout.total), rank, world);
    EXPECT_EQ(part.numel(), layout.part_size);
    EXPECT_TRUE(Same(wait(all_gather(part, at::kBFloat16, world).first), flat.to(at::kBFloat16)));

    at::Tensor grad = wait(reduce_scatter(grads[rank], "avg", at::kFloat, world));
    const int64_t start = rank * layout.part_size;
    EXPECT_TRUE(Within(
        grad,
        grad_sum.narrow(0, start, layout.part_size) / world,
        (world + 2) * epsilon(at::kFloat) * grad_magnitude.narrow(0, start, layout.part_size) / world));
    // The padding in this part (if any): zeros summed, exactly zero.
    const int64_t padding_start = std::clamp(end - start, int64_t{0}, layout.part_size);
    at::Tensor padding = grad.narrow(0, padding_start, layout.part_size - padding_start);
    EXPECT_TRUE(Same(padding, at::zeros({padding.numel()})));

    at::Tensor odd_part = shard(odd, rank, world);
    EXPECT_EQ(odd_part.numel(), odd_part_size);
    at::Tensor gathered = wait(all_gather(odd_part, at::kFloat, world).first);
    at::Tensor expected = at::zeros({odd_part_size * world});
    expected.narrow(0, 0, 23).copy_(odd);
    EXPECT_TRUE(Same(gathered, expected));
  });
}

TEST_P(Collectives, RejectWhatDoesNotFitTheGroup) {
  const int world = GetParam();
  run_ranks(world, [&](int) {
    EXPECT_TRUE(Throws(
        [&] { all_gather(at::ones({4}), at::kBFloat16, world + 1); },
        "group_size is " + std::to_string(world + 1) + " but the process group '" + kGroup + "' has " +
            std::to_string(world) + " ranks"));
    EXPECT_TRUE(Throws(
        [&] { reduce_scatter(at::ones({2 * world + 1}), "sum", at::kFloat, world); },
        "expected a numel divisible by group_size = " + std::to_string(world)));
    EXPECT_TRUE(Throws(
        [&] { reduce_scatter(at::ones({2 * world}), "max", at::kFloat, world); },
        "reduce_op must be \"sum\" or \"avg\", got \"max\""));
  });
}

// The CUDA copy-cast (csrc/cuda/kernels.cu) against the CPU one, through ops
// that need no group: a gather of one rank (a cast) and a shard (a copy that
// pads), from an aligned start (the vector path) and one element in (the
// scalar path).
TEST(CudaCopyCast, MatchesTheCpuCopyCast) {
  c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("linnet::all_gather", "");
  if (!op.hasKernelForDispatchKey(c10::DispatchKey::CUDA)) {
    GTEST_SKIP() << "the CUDA kernels are not built (this torch is a CPU build)";
  }
  if (!at::hasCUDA()) {
    GTEST_SKIP() << "no CUDA device";
  }
  const std::vector<std::pair<at::ScalarType, at::ScalarType>> casts = {
      {at::kFloat, at::kBFloat16},
      {at::kBFloat16, at::kFloat},
      {at::kFloat, at::kFloat},
      {at::kHalf, at::kBFloat16},
      {at::kDouble, at::kFloat}};
  for (auto [source, target] : casts) {
    for (int64_t numel : {1, 7, 16, 1000, 4099}) {
      const at::Tensor host = random(numel + 1, 100, source);
      const at::Tensor device = host.to(at::kCUDA);
      for (int64_t start : {0, 1}) {
        SCOPED_TRACE(testing::Message() << source << " to " << target << ", " << numel << " elements from " << start);
        at::Tensor cpu_part = host.narrow(0, start, numel);
        at::Tensor cuda_part = device.narrow(0, start, numel);
        at::Tensor gathered = all_gather(cuda_part, target, 1, "").first;
        EXPECT_EQ(gathered.device(), cuda_part.device());
        EXPECT_TRUE(Same(gathered.cpu(), all_gather(cpu_part, target, 1, "").first));
        EXPECT_TRUE(Same(shard(cuda_part, 2, 3).cpu(), shard(cpu_part, 2, 3)));
      }
    }
  }
}

}  // namespace
