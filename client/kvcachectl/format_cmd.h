// `kvcachectl format ...`: offline tools for the byte contract (SPEC §2-§3).
// They need no daemon, so anyone can check a record byte for byte:
//   list                       the supported formats and their sizes
//   layout FORMAT              a pool layer's layout for a block size
//   encode FORMAT --in --out   raw little-endian BF16 [n][elements] -> n
//                              records of bytes_per_token ([data | scales])
//   decode FORMAT --in --out   records -> BF16 (cast formats), or raw data
//                              (+ --scales_out, packed as the load packs
//                              them) for index formats; --dequantize gives
//                              BF16 for index formats too
#ifndef KVDEPOT_CLIENT_KVCACHECTL_FORMAT_CMD_H_
#define KVDEPOT_CLIENT_KVCACHECTL_FORMAT_CMD_H_

#include <ostream>
#include <string>
#include <vector>

namespace kvdepot::ctl {

// Runs `kvcachectl format <args...>`; returns the process exit code.
int RunFormatCommand(const std::vector<std::string>& args, std::ostream& out,
                     std::ostream& err);

}  // namespace kvdepot::ctl

#endif  // KVDEPOT_CLIENT_KVCACHECTL_FORMAT_CMD_H_
