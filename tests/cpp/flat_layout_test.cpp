// The flat layout: offsets aligned and in order, the total split evenly into
// aligned parts with the least padding, and clear errors for bad arguments.
#include "flat_layout.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using linnet::flat_layout;
using linnet::FlatLayout;

TEST(FlatLayout, PadsEachTensorToTheAlignmentAndTheTotalToTheWorld) {
  FlatLayout layout = flat_layout({3, 17, 0, 5}, 16, 3);
  EXPECT_EQ(layout.offsets, (std::vector<int64_t>{0, 16, 48, 48}));
  EXPECT_EQ(layout.total, 96);  // 53 elements, up to a multiple of 16 * 3
  EXPECT_EQ(layout.part_size, 32);
}

TEST(FlatLayout, NeedsNoPaddingWhenEverythingDivides) {
  FlatLayout layout = flat_layout({32, 64}, 16, 2);
  EXPECT_EQ(layout.offsets, (std::vector<int64_t>{0, 32}));
  EXPECT_EQ(layout.total, 96);
  EXPECT_EQ(layout.part_size, 48);
}

TEST(FlatLayout, PacksTightlyWithAlignmentOneAndOneRank) {
  FlatLayout layout = flat_layout({3, 4, 5}, 1, 1);
  EXPECT_EQ(layout.offsets, (std::vector<int64_t>{0, 3, 7}));
  EXPECT_EQ(layout.total, 12);
  EXPECT_EQ(layout.part_size, 12);
}

TEST(FlatLayout, AnEmptyGroupHasNoElements) {
  FlatLayout layout = flat_layout({}, 16, 4);
  EXPECT_TRUE(layout.offsets.empty());
  EXPECT_EQ(layout.total, 0);
  EXPECT_EQ(layout.part_size, 0);
}

TEST(FlatLayout, HoldsItsPromisesForManyShapes) {
  const std::vector<std::vector<int64_t>> groups = {
      {1}, {7}, {16}, {17, 1, 33}, {0, 0, 5}, {4096, 1024, 1024, 4096, 14336}, {5, 3, 8, 13, 21}};
  for (const auto& numels : groups) {
    for (int64_t align : {1, 4, 16, 64}) {
      for (int64_t world = 1; world <= 8; ++world) {
        FlatLayout layout = flat_layout(numels, align, world);
        SCOPED_TRACE(testing::Message() << "align " << align << ", world " << world);
        ASSERT_EQ(layout.offsets.size(), numels.size());
        int64_t end = 0;
        for (size_t i = 0; i < numels.size(); ++i) {
          EXPECT_EQ(layout.offsets[i] % align, 0);
          EXPECT_GE(layout.offsets[i], end);
          EXPECT_LT(layout.offsets[i] - end, align);  // no gap longer than needed
          end = layout.offsets[i] + numels[i];
        }
        EXPECT_EQ(layout.total, layout.part_size * world);
        EXPECT_EQ(layout.part_size % align, 0);
        EXPECT_GE(layout.total, end);
        EXPECT_LT(layout.total - end, align * world);  // the least padding that divides
      }
    }
  }
}

TEST(FlatLayout, RejectsBadArguments) {
  EXPECT_THROW(flat_layout({4, -1}, 16, 2), std::invalid_argument);
  EXPECT_THROW(flat_layout({4}, 0, 2), std::invalid_argument);
  EXPECT_THROW(flat_layout({4}, 16, 0), std::invalid_argument);
}

TEST(FlatLayout, SaysWhichNumelIsNegative) {
  try {
    flat_layout({4, -1}, 16, 2);
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("numels[1] is -1"), std::string::npos) << error.what();
  }
}

TEST(FlatLayout, RejectsLayoutsThatOverflow) {
  const int64_t max = std::numeric_limits<int64_t>::max();
  EXPECT_THROW(flat_layout({max - 3}, 16, 1), std::invalid_argument);
  EXPECT_THROW(flat_layout({max / 2, max / 2}, 16, 1), std::invalid_argument);
  EXPECT_THROW(flat_layout({1}, max / 2, 4), std::invalid_argument);
}

}  // namespace
