// The kvcached release version, reported by Stats and /metrics.
#ifndef KVCACHED_SERVER_VERSION_H_
#define KVCACHED_SERVER_VERSION_H_

namespace kvcache {

inline constexpr char kKvcachedVersion[] = "0.1.0";

}  // namespace kvcache

#endif  // KVCACHED_SERVER_VERSION_H_
