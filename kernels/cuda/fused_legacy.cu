// The fused store's round-1 kernel shape (LaunchOptions::legacy_fused):
// fused.cu's legacy kernels only, defining LaunchFusedStoreLegacy. Linked
// into the test and the benchmark only (//kernels/cuda:fused_legacy_device).
#define KVDEPOT_FUSED_LEGACY 1
#include "kernels/cuda/fused.cu"  // IWYU pragma: keep
