// Helper of e2e_access_test, run as a second uid: connects to the daemon at
// argv[1] and tries what that uid must not do (and what the config grants
// it), printing one "<what> <CODE>" line per attempt.
#include <cstdio>
#include <string>

#include "client/kvdepot_client.h"

namespace {

void Report(const char* what, const absl::Status& s) {
  std::printf("%s %s\n", what, absl::StatusCodeToString(s.code()).c_str());
}

kvdepot::v1::StoreRequest InlineStore(const std::string& pool) {
  kvdepot::v1::StoreRequest r;
  r.set_pool(pool);
  r.set_num_tokens(0);
  r.set_dtype(kvdepot::v1::INPUT_DTYPE_FP32);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: access_probe SOCKET\n");
    return 2;
  }
  kvdepot::ClientOptions options;
  options.address = argv[1];
  options.client_name = "access_probe";
  absl::StatusOr<std::unique_ptr<kvdepot::KVCacheClient>> c =
      kvdepot::KVCacheClient::Connect(options);
  Report("connect", c.status());
  if (!c.ok()) {
    std::fprintf(stderr, "%s\n", c.status().ToString().c_str());
    return 1;
  }
  kvdepot::KVCacheClient& k = **c;
  Report("map_owned", k.MapPool("owned").status());
  Report("store_owned", k.Store(InlineStore("owned")).status());
  Report("delete_owned", k.DeletePool("owned"));
  {
    grpc::ClientContext ctx;
    kvdepot::v1::DrainResponse d;
    Report("drain", kvdepot::FromGrpcStatus(k.stub()->Drain(&ctx, {}, &d)));
  }
  kvdepot::v1::GrantRequest g;
  g.set_pool("owned");
  g.add_uids(getuid());
  Report("grant_owned", k.Grant(g));
  Report("map_granted", k.MapPool("granted").status());
  Report("store_granted", k.Store(InlineStore("granted")).status());
  Report("delete_granted", k.DeletePool("granted"));
  kvdepot::v1::CreatePoolRequest p;
  p.set_name("mine");
  p.set_format("V41");
  p.set_block_size(4);
  p.set_num_blocks(2);
  p.set_num_layers(1);
  Report("create_mine", k.CreatePool(p).status());
  Report("store_mine", k.Store(InlineStore("mine")).status());
  std::fflush(stdout);
  return 0;
}
