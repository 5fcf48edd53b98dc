#include "tests/malloc_flag.h"

#include <cstdint>
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "common/malloc_tuning.h"

ABSL_FLAG(int32_t, malloc_keep_freed_mb, 64,
          "as kvdepotd's flag: freed memory each glibc malloc arena keeps "
          "for reuse, in MiB; 0 = glibc's defaults");

namespace kvdepot::testing {

int MallocKeepFreedMb() { return absl::GetFlag(FLAGS_malloc_keep_freed_mb); }

void ApplyMallocKeepFreedFlag() {
  const int32_t mb = absl::GetFlag(FLAGS_malloc_keep_freed_mb);
  if (mb == 0) return;
  if (const absl::Status s = KeepFreedMemory(int64_t{mb} << 20); !s.ok()) {
    std::fprintf(stderr, "--malloc_keep_freed_mb=%d: %s\n", mb,
                 std::string(s.message()).c_str());
  }
}

}  // namespace kvdepot::testing
