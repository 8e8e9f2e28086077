// flatten and shard: the copies that build a group's flat buffer and cut a
// rank's part from it, on any device (the backend supplies the copy).
#include "ops.h"

namespace linnet {

void check_floating(const at::Tensor& tensor, const char* op, const char* what) {
  TORCH_CHECK(
      at::isFloatingType(tensor.scalar_type()),
      op,
      ": expected ",
      what,
      " of a floating dtype (float32, bfloat16, float16, float64), got ",
      tensor.scalar_type());
}

at::Tensor flatten(at::TensorList tensors, at::IntArrayRef offsets, int64_t total, CopyCastPad copy) {
  TORCH_CHECK(!tensors.empty(), "flatten: expected at least one tensor");
  TORCH_CHECK(
      offsets.size() == tensors.size(),
      "flatten: expected one offset per tensor, got ",
      offsets.size(),
      " offsets for ",
      tensors.size(),
      " tensors");
  const at::Tensor& first = tensors[0];
  check_floating(first, "flatten", "tensors");
  int64_t end = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(
        tensors[i].scalar_type() == first.scalar_type() && tensors[i].device() == first.device(),
        "flatten: expected every tensor to be ",
        first.scalar_type(),
        " on ",
        first.device(),
        " like tensors[0], but tensors[",
        i,
        "] is ",
        tensors[i].scalar_type(),
        " on ",
        tensors[i].device());
    TORCH_CHECK(
        offsets[i] >= end && offsets[i] + tensors[i].numel() <= total,
        "flatten: tensors[",
        i,
        "] (",
        tensors[i].numel(),
        " elements) at offset ",
        offsets[i],
        " overlaps the tensor before it (which ends at ",
        end,
        ") or runs past total = ",
        total,
        "; expected increasing offsets such as flat_layout's");
    end = offsets[i] + tensors[i].numel();
  }
  at::Tensor flat = at::empty({total}, first.options());
  flat.narrow(0, 0, offsets[0]).zero_();
  for (size_t i = 0; i < tensors.size(); ++i) {
    // Each copy also zeroes the gap up to the next tensor (or the end).
    int64_t next = i + 1 < tensors.size() ? offsets[i + 1] : total;
    copy(tensors[i], flat.narrow(0, offsets[i], next - offsets[i]), 1.0);
  }
  return flat;
}

at::Tensor shard(const at::Tensor& flat, int64_t rank, int64_t world, CopyCastPad copy) {
  TORCH_CHECK(flat.dim() == 1, "shard: expected a 1-D flat buffer, got shape ", flat.sizes());
  TORCH_CHECK(world >= 1, "shard: expected world >= 1, got ", world);
  TORCH_CHECK(0 <= rank && rank < world, "shard: expected 0 <= rank < world = ", world, ", got rank ", rank);
  check_floating(flat, "shard", "a flat buffer");
  int64_t numel = flat.numel();
  int64_t part_size = (numel + world - 1) / world;
  int64_t start = std::min(rank * part_size, numel);
  int64_t count = std::min(part_size, numel - start);
  at::Tensor part = at::empty({part_size}, flat.options());
  copy(flat.narrow(0, start, count), part, 1.0);
  return part;
}

}  // namespace linnet
