// Tests of the CUDA backend's ordering: a host function parked on a stream
// until Release(), so that work queued behind it waits for the test.
#ifndef KVDEPOT_SERVER_CUDA_TEST_GATE_H_
#define KVDEPOT_SERVER_CUDA_TEST_GATE_H_

#include <cuda_runtime_api.h>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace kvdepot {

class Gate {
 public:
  void Park(cudaStream_t stream) {
    ASSERT_EQ(cudaLaunchHostFunc(
                  stream,
                  [](void* self) {
                    static_cast<Gate*>(self)->open_.WaitForNotification();
                  },
                  this),
              cudaSuccess);
  }
  void Release() {
    if (!open_.HasBeenNotified()) open_.Notify();
  }
  ~Gate() { Release(); }

 private:
  absl::Notification open_;
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_CUDA_TEST_GATE_H_
