// Where each tensor of a group lies in the group's flat buffer, and how that
// buffer splits into equal parts across ranks. Plain C++ (no torch), so it is
// unit tested on its own.
#pragma once

#include <cstdint>
#include <vector>

namespace linnet {

struct FlatLayout {
  std::vector<int64_t> offsets;  // where each tensor starts, in elements
  int64_t total = 0;             // padded length: part_size * world
  int64_t part_size = 0;         // one rank's part, a multiple of align
};

// Each tensor starts at a multiple of `align` elements, so vectorised kernels
// can load it whole; the total is padded so that it splits into `world` parts
// of `part_size` elements, each itself a multiple of `align`. Throws
// std::invalid_argument for a negative numel, align < 1, world < 1, or a
// layout that would overflow int64.
FlatLayout flat_layout(const std::vector<int64_t>& numels, int64_t align, int64_t world);

}  // namespace linnet
