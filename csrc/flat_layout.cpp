// The flat layout of a group of tensors (see flat_layout.h).
#include "flat_layout.h"

#include <limits>
#include <stdexcept>
#include <string>

namespace linnet {
namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

int64_t round_up(int64_t value, int64_t multiple) {
  int64_t rest = value % multiple;
  if (rest == 0) {
    return value;
  }
  if (value > kMax - (multiple - rest)) {
    throw std::invalid_argument("flat_layout: the padded layout overflows int64");
  }
  return value + (multiple - rest);
}

}  // namespace

FlatLayout flat_layout(const std::vector<int64_t>& numels, int64_t align, int64_t world) {
  if (align < 1) {
    throw std::invalid_argument("flat_layout: align must be at least 1 element, got " + std::to_string(align));
  }
  if (world < 1) {
    throw std::invalid_argument("flat_layout: world must be at least 1, got " + std::to_string(world));
  }
  if (align > kMax / world) {
    throw std::invalid_argument("flat_layout: align * world overflows int64");
  }
  FlatLayout layout;
  layout.offsets.reserve(numels.size());
  int64_t end = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    if (numels[i] < 0) {
      throw std::invalid_argument(
          "flat_layout: numels[" + std::to_string(i) + "] is " + std::to_string(numels[i]) +
          ", expected a count of elements >= 0");
    }
    int64_t offset = round_up(end, align);
    if (numels[i] > kMax - offset) {
      throw std::invalid_argument("flat_layout: the layout overflows int64");
    }
    layout.offsets.push_back(offset);
    end = offset + numels[i];
  }
  layout.total = round_up(end, align * world);
  layout.part_size = layout.total / world;
  return layout;
}

}  // namespace linnet
