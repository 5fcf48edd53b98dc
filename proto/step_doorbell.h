// The doorbell region of a step-path registration (SPEC §10,
// docs/STEP_PATH.md): 64-bit words in device memory that the worker's and
// the daemon's streams write and wait on. One 64-byte line per group, so
// the two sides never write the same line for different purposes.
//
//   line 0 (header):
//     word 0  kStepCounter   worker: incremented by step_begin's kernel
//     word 1  kStepIdWord    worker: the counter's new value (the step id)
//     word 2  kCancelWord    daemon control stream: != 0 = cancelled
//     word 3  kStatusWord    sticky status bits (kStatus*), OR-ed by kernels
//     word 4  kOutOfRange    device-resident entries turned into -1
//     word 5  kDaemonDone    daemon work stream: id of the last finished step
//     word 6  kMagicWord     kDoorbellMagic once the daemon initialized it
//   line 1 + p (phase p, p in [0, num_phases)):
//     word 0  flag           worker writes 1; daemon waits == 1, resets 0
//     word 1  done           daemon writes 1; worker waits == 1, resets 0
//
// Phases: p = 0 is the step's begin phase (S: the SWA decode index), then
// layer l has phase A at 1 + 2l (stores) and phase B at 2 + 2l
// (convert_topk). num_phases = 1 + 2 * layers.
#ifndef KVDEPOT_PROTO_STEP_DOORBELL_H_
#define KVDEPOT_PROTO_STEP_DOORBELL_H_

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

namespace kvdepot::doorbell {

inline constexpr int64_t kLineBytes = 64;
inline constexpr int64_t kWordsPerLine = kLineBytes / 8;

// Header words (index in uint64 words from the region's base).
inline constexpr int64_t kStepCounter = 0;
inline constexpr int64_t kStepIdWord = 1;
inline constexpr int64_t kCancelWord = 2;
inline constexpr int64_t kStatusWord = 3;
inline constexpr int64_t kOutOfRange = 4;
inline constexpr int64_t kDaemonDone = 5;
inline constexpr int64_t kMagicWord = 6;
inline constexpr uint64_t kDoorbellMagic = 0x6b7664627374ull;  // "kvdbst"

// Sticky status bits (kStatusWord).
inline constexpr uint64_t kStatusStepMismatch = 1;    // step id word != step
inline constexpr uint64_t kStatusCancelled = 2;       // cancel word was set
inline constexpr uint64_t kStatusOutOfRange = 4;      // some entry became -1
inline constexpr uint64_t kStatusWorkerWatchdog = 8;  // worker released itself
inline constexpr uint64_t kStatusDaemonError = 16;    // a launch failed (host)

inline constexpr int64_t kMaxLayers = 1024;

inline constexpr int64_t NumPhases(int64_t layers) { return 1 + 2 * layers; }
inline constexpr int64_t BeginPhase() { return 0; }
inline constexpr int64_t PhaseA(int64_t layer) { return 1 + 2 * layer; }
inline constexpr int64_t PhaseB(int64_t layer) { return 2 + 2 * layer; }

// Word index of phase p's flag and done words.
inline constexpr int64_t FlagWord(int64_t phase) {
  return (1 + phase) * kWordsPerLine;
}
inline constexpr int64_t DoneWord(int64_t phase) {
  return (1 + phase) * kWordsPerLine + 1;
}

// Bytes of the region for `layers` layers.
inline constexpr int64_t RegionBytes(int64_t layers) {
  return (1 + NumPhases(layers)) * kLineBytes;
}

// The GPU host's hazards (GPU_HOST.md) designed out: both the daemon and
// the worker's library refuse to run the step path unless every kernel is
// loaded at start (CUDA_MODULE_LOADING=EAGER) and the context has at least
// 8 hardware connections (CUDA_DEVICE_MAX_CONNECTIONS unset = 8, or >= 8).
// Returns "" when the environment is right, else what is wrong.
inline std::string CheckStepEnvironment() {
  const char* loading = std::getenv("CUDA_MODULE_LOADING");
  if (loading == nullptr || std::strcmp(loading, "EAGER") != 0) {
    return "CUDA_MODULE_LOADING must be EAGER before CUDA starts (a lazily "
           "loaded kernel launched while a stream waits on a doorbell hangs "
           "the launching thread)";
  }
  const char* conns = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  if (conns != nullptr) {
    char* end = nullptr;
    const long n = std::strtol(conns, &end, 10);
    if (end == conns || *end != '\0' || n < 8) {
      return "CUDA_DEVICE_MAX_CONNECTIONS must be unset or >= 8 (with fewer, "
             "a stream parked on a doorbell blocks the others)";
    }
  }
  return "";
}

}  // namespace kvdepot::doorbell

#endif  // KVDEPOT_PROTO_STEP_DOORBELL_H_
