// The casts that Adam's step makes. On one rank a part's gather is a cast of
// the f32 part to the compute dtype (cast_into_sink), made again in every
// forward: six bytes a parameter read and written (the 1B's step on an H100:
// about 2 ms). Adam's step, which reads and writes the part anyway, can write
// the cast as well for two bytes a parameter (adam_step_'s copy_dtype). It is
// kept here, one per part, until the next cast of that part takes it in place
// of casting; a part changed since (its version moved on: a checkpoint read
// into it, or any write) or a cast of another dtype finds none and casts. A
// write through `.data`, which no version counts (autograd does not see it
// either), is not seen: write parts in place under torch.no_grad() instead.
//
// What is kept is one cast a stepped part, from its step to the next forward
// that reaches the part; the step in the backward asks for it only where that
// costs no memory at the step's peak (linnet/torch/shard.py, `_take`).
#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/variable.h>

#include <mutex>
#include <unordered_map>

#include "ops.h"

namespace linnet {
namespace {

struct Kept {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;  // the part's: where it lies
  int64_t offset;
  int64_t numel;
  uint32_t version;  // the part's version once its step has counted it (csrc/autograd.cpp)
  at::Tensor cast;
};

// The backward steps on autograd's device threads while a forward may cast on another.
std::mutex mutex;
std::unordered_map<const c10::StorageImpl*, Kept> kept;

uint32_t version_of(const at::Tensor& part) {
  return torch::autograd::impl::version_counter(part).current_version();
}

// Forgets the casts of parts that no longer exist, which no cast will take.
void forget_the_gone() {
  for (auto it = kept.begin(); it != kept.end();) {
    it = it->second.storage.expired() ? kept.erase(it) : std::next(it);
  }
}

}  // namespace

void keep_stepped_cast(const at::Tensor& param, at::Tensor cast) {
  if (param.is_inference()) {  // no version to tell a change by
    return;
  }
  const c10::StorageImpl* where = param.storage().unsafeGetStorageImpl();
  // Called from below autograd (the step's device body): its autograd kernel counts the new version after.
  Kept entry{
      c10::weak_intrusive_ptr<c10::StorageImpl>(param.storage().getWeakStorageImpl()),
      param.storage_offset(),
      param.numel(),
      version_of(param) + 1,
      std::move(cast)};
  std::lock_guard<std::mutex> lock(mutex);
  forget_the_gone();
  kept.insert_or_assign(where, std::move(entry));
}

std::optional<at::Tensor> take_stepped_cast(const at::Tensor& part, at::ScalarType dtype) {
  if (part.is_inference() || !part.has_storage()) {
    return std::nullopt;
  }
  std::lock_guard<std::mutex> lock(mutex);
  auto it = kept.find(part.storage().unsafeGetStorageImpl());
  if (it == kept.end()) {
    return std::nullopt;
  }
  Kept entry = std::move(it->second);
  kept.erase(it);  // taken or stale, it is not kept for another cast
  const bool same = !entry.storage.expired() && entry.offset == part.storage_offset() &&
      entry.numel == part.numel() && part.dim() == 1 && entry.version == version_of(part) &&
      entry.cast.scalar_type() == dtype;
  return same ? std::optional<at::Tensor>(std::move(entry.cast)) : std::nullopt;
}

int64_t stepped_casts_kept() {
  std::lock_guard<std::mutex> lock(mutex);
  forget_the_gone();
  return static_cast<int64_t>(kept.size());
}

void drop_stepped_casts() {
  std::lock_guard<std::mutex> lock(mutex);
  kept.clear();
}

}  // namespace linnet
