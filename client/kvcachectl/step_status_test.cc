#include "client/kvcachectl/step_status.h"

#include "gtest/gtest.h"
#include "proto/step_doorbell.h"

namespace kvdepot::ctl {
namespace {

TEST(StepStatusNamesTest, NamesEveryBit) {
  EXPECT_EQ(StepStatusNames(0), "ok");
  EXPECT_EQ(StepStatusNames(doorbell::kStatusCancelled), "cancelled");
  EXPECT_EQ(StepStatusNames(
                doorbell::kStatusStepMismatch | doorbell::kStatusOutOfRange |
                doorbell::kStatusWorkerWatchdog | doorbell::kStatusDaemonError),
            "step_mismatch|out_of_range|worker_watchdog|daemon_error");
  EXPECT_EQ(StepStatusNames(doorbell::kStatusCancelled | (uint64_t{1} << 40)),
            "cancelled|bit40");
}

// Attack: a worker-chosen name cannot send escape sequences or lines.
TEST(TerminalSafeTest, ControlBytesAreReplaced) {
  EXPECT_EQ(TerminalSafe("rank0"), "rank0");
  EXPECT_EQ(TerminalSafe("a\x1b[2Jb\nc\x7f\xff"), "a?[2Jb?c??");
}

}  // namespace
}  // namespace kvdepot::ctl
