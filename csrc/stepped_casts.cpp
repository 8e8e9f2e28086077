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
// A cast is kept once the step's autograd kernel has counted the part's new
// version (confirm_stepped_cast): a step made below autograd (under
// inference_mode, say) counts none, and its cast is never taken. What is kept
// is one cast a stepped part, until the part's next cast takes it or the
// stepping ends (linnet/torch/step_in_backward.py drops its model's); the step
// in the backward asks for casts only where they cost no memory at the step's
// peak (linnet/torch/collectives.py, `_casts_from_the_step`).
#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/variable.h>

#include <mutex>
#include <unordered_map>
#include <vector>

#include "ops.h"

namespace linnet {
namespace {

struct Kept {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;  // the part's: where it lies
  int64_t offset;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  at::ScalarType dtype;  // the part's
  uint32_t version;      // once confirmed: the part's version after its step counted it
  bool confirmed;
  at::Tensor cast;
};

struct Kept_casts {
  std::mutex mutex;  // the backward steps on autograd's device threads while a forward may cast on another
  std::unordered_map<const c10::StorageImpl*, Kept> by_storage;
};

// Never destroyed: it may hold CUDA tensors, which must not outlive the allocator at exit.
Kept_casts& kept() {
  static auto* casts = new Kept_casts();
  return *casts;
}

// Whether a change to `tensor` would be counted: it has storage and a version (not an inference tensor).
bool versioned(const at::Tensor& tensor) {
  return !tensor.is_inference() && tensor.has_storage();
}

uint32_t version_of(const at::Tensor& part) {
  return torch::autograd::impl::version_counter(part).current_version();
}

const c10::StorageImpl* storage_of(const at::Tensor& part) {
  return part.storage().unsafeGetStorageImpl();
}

// Whether `entry` was kept for this very tensor: the same elements of the same storage, as the same dtype.
bool kept_for(const Kept& entry, const at::Tensor& part) {
  return !entry.storage.expired() && entry.offset == part.storage_offset() && part.sizes() == entry.sizes &&
      part.strides() == entry.strides && part.scalar_type() == entry.dtype;
}

// Forgets the casts of parts that no longer exist, which no cast will take.
void forget_the_gone(std::unordered_map<const c10::StorageImpl*, Kept>& by_storage) {
  for (auto it = by_storage.begin(); it != by_storage.end();) {
    it = it->second.storage.expired() ? by_storage.erase(it) : std::next(it);
  }
}

}  // namespace

void keep_stepped_cast(const at::Tensor& param, at::Tensor cast) {
  if (!versioned(param)) {  // no version to tell a change by
    return;
  }
  Kept entry{
      c10::weak_intrusive_ptr<c10::StorageImpl>(param.storage().getWeakStorageImpl()),
      param.storage_offset(),
      param.sizes().vec(),
      param.strides().vec(),
      param.scalar_type(),
      0,
      false,
      std::move(cast)};
  Kept_casts& casts = kept();
  std::lock_guard<std::mutex> lock(casts.mutex);
  forget_the_gone(casts.by_storage);
  casts.by_storage.insert_or_assign(storage_of(param), std::move(entry));
}

void confirm_stepped_cast(const at::Tensor& param) {
  if (!versioned(param)) {
    return;
  }
  Kept_casts& casts = kept();
  std::lock_guard<std::mutex> lock(casts.mutex);
  auto it = casts.by_storage.find(storage_of(param));
  if (it != casts.by_storage.end() && !it->second.confirmed && kept_for(it->second, param)) {
    it->second.version = version_of(param);
    it->second.confirmed = true;
  }
}

std::optional<at::Tensor> take_stepped_cast(const at::Tensor& part, at::ScalarType dtype) {
  if (!versioned(part)) {
    return std::nullopt;
  }
  Kept_casts& casts = kept();
  std::lock_guard<std::mutex> lock(casts.mutex);
  auto it = casts.by_storage.find(storage_of(part));
  if (it == casts.by_storage.end()) {
    return std::nullopt;
  }
  Kept entry = std::move(it->second);
  casts.by_storage.erase(it);  // taken or stale, it is not kept for another cast
  const bool same = entry.confirmed && kept_for(entry, part) && entry.version == version_of(part) &&
      entry.cast.scalar_type() == dtype;
  return same ? std::optional<at::Tensor>(std::move(entry.cast)) : std::nullopt;
}

int64_t stepped_casts_kept() {
  Kept_casts& casts = kept();
  std::lock_guard<std::mutex> lock(casts.mutex);
  forget_the_gone(casts.by_storage);
  return static_cast<int64_t>(casts.by_storage.size());
}

void drop_stepped_casts(const std::vector<at::Tensor>& parts) {
  Kept_casts& casts = kept();
  std::lock_guard<std::mutex> lock(casts.mutex);
  for (const at::Tensor& part : parts) {
    if (part.has_storage()) {
      casts.by_storage.erase(storage_of(part));
    }
  }
  forget_the_gone(casts.by_storage);
}

}  // namespace linnet
