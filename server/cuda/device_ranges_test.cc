#include "server/cuda/device_ranges.h"

#include <cstdint>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvdepot {
namespace {

using ::testing::HasSubstr;

// Fake addresses: the registry never dereferences them.
const void* At(uintptr_t a) { return reinterpret_cast<const void*>(a); }

TEST(DeviceRangesTest, FindsPointersInsideRangesOnly) {
  DeviceRanges r;
  r.Add(At(0x10000), 0x1000, 0);
  r.Add(At(0x40000), 0x200000, 1);
  // Host pointers: below, between and after the ranges.
  for (uintptr_t host :
       {uintptr_t{0x100}, uintptr_t{0xFFFF}, uintptr_t{0x11000},
        uintptr_t{0x3FFFF}, uintptr_t{0x240000}}) {
    absl::StatusOr<std::optional<DeviceRanges::Range>> f = r.Find(At(host), 1);
    ASSERT_TRUE(f.ok()) << host;
    EXPECT_FALSE(f->has_value()) << std::hex << host;
  }
  absl::StatusOr<std::optional<DeviceRanges::Range>> f =
      r.Find(At(0x10000), 0x1000);
  ASSERT_TRUE(f.ok() && f->has_value());
  EXPECT_EQ((*f)->base, 0x10000u);
  EXPECT_EQ((*f)->device, 0);
  f = r.Find(At(0x23FFFF), 1);  // the last byte of the second range
  ASSERT_TRUE(f.ok() && f->has_value());
  EXPECT_EQ((*f)->base, 0x40000u);
  EXPECT_EQ((*f)->size, 0x200000);
  EXPECT_EQ((*f)->device, 1);
  // Zero bytes at the start of a range.
  f = r.Find(At(0x40000), 0);
  ASSERT_TRUE(f.ok() && f->has_value());
}

TEST(DeviceRangesTest, ARangeThatDoesNotHoldAllTheBytesIsInternal) {
  DeviceRanges r;
  r.Add(At(0x10000), 0x1000, 0);
  absl::StatusOr<std::optional<DeviceRanges::Range>> f =
      r.Find(At(0x10F00), 0x101);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(f.status().message(),
              HasSubstr("257 bytes at offset 3840 runs past its device "
                        "allocation of 4096 bytes"));
  f = r.Find(At(0x10F00), -1);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(r.Find(At(0x10F00), 0x100).ok());
}

TEST(DeviceRangesTest, SharedBasesAreCountedAndKeepTheLargestSize) {
  DeviceRanges r;
  r.Add(At(0x80000), 0x100, 0);  // two imports of one handle
  r.Add(At(0x80000), 0x300, 0);
  absl::StatusOr<std::optional<DeviceRanges::Range>> f =
      r.Find(At(0x80200), 0x100);
  ASSERT_TRUE(f.ok() && f->has_value()) << f.status();
  EXPECT_EQ((*f)->count, 2);
  r.Remove(At(0x80000));
  f = r.Find(At(0x80200), 0x100);
  ASSERT_TRUE(f.ok() && f->has_value());
  EXPECT_EQ((*f)->count, 1);
  r.Remove(At(0x80000));
  f = r.Find(At(0x80000), 1);
  ASSERT_TRUE(f.ok());
  EXPECT_FALSE(f->has_value());
  r.Remove(At(0x80000));  // unknown: no effect
}

TEST(DeviceRangesTest, RemembersExportedHandles) {
  DeviceRanges r;
  const std::string a(64, 'a'), b(64, 'b');
  EXPECT_FALSE(r.IsExported(a));
  r.AddExported(a);
  EXPECT_TRUE(r.IsExported(a));
  EXPECT_FALSE(r.IsExported(b));
  r.RemoveExported(a);
  EXPECT_FALSE(r.IsExported(a));
}

}  // namespace
}  // namespace kvdepot
