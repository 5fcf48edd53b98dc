// The kvdepot release version, reported by Stats and /metrics.
#ifndef KVDEPOT_SERVER_VERSION_H_
#define KVDEPOT_SERVER_VERSION_H_

namespace kvdepot {

inline constexpr char kKvdepotVersion[] = "0.1.0";

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_VERSION_H_
