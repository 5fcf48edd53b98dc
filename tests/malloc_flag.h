// --malloc_keep_freed_mb for the benchmarks and the scheduler processes
// that stand in for a daemon or a client: the same setting as kvdepotd's
// flag of that name (common/malloc_tuning.h), so that their figures are
// those of the tuned process, and 0 measures glibc's defaults.
#ifndef KVDEPOT_TESTS_MALLOC_FLAG_H_
#define KVDEPOT_TESTS_MALLOC_FLAG_H_

namespace kvdepot::testing {

// Applies the flag (after absl::ParseCommandLine). A refusal (e.g. under
// ASan) is printed on stderr and otherwise ignored.
void ApplyMallocKeepFreedFlag();

// The flag's value, to hand on to child processes.
int MallocKeepFreedMb();

}  // namespace kvdepot::testing

#endif  // KVDEPOT_TESTS_MALLOC_FLAG_H_
