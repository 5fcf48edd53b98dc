// The kvdepot release version: kvdepotd --version, kvcachectl version,
// Stats and /metrics.
#ifndef KVDEPOT_COMMON_VERSION_H_
#define KVDEPOT_COMMON_VERSION_H_

namespace kvdepot {

inline constexpr char kKvdepotVersion[] = "0.1.0";

}  // namespace kvdepot

#endif  // KVDEPOT_COMMON_VERSION_H_
