// Test helper: stores random values (fixed seed) into slots of a pool
// through the C++ client and loads block 0 back, `rounds` times; exits 0
// when every call succeeded, 1 otherwise (printing the error).
//   traffic --addr=/tmp/x.sock --pool=mx --layer=1 --first_slot=14
//           --tokens=7 --seed=301 --rounds=1
#include <cstdio>
#include <random>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "client/kvdepot_client.h"
#include "proto/wire.h"

ABSL_FLAG(std::string, addr, "", "daemon address");
ABSL_FLAG(std::string, pool, "", "pool");
ABSL_FLAG(int64_t, layer, 0, "layer");
ABSL_FLAG(int64_t, first_slot, 0, "first slot written");
ABSL_FLAG(int64_t, tokens, 1, "consecutive slots written");
ABSL_FLAG(int, seed, 301, "random seed");
ABSL_FLAG(int, rounds, 1, "store+load rounds");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  kvdepot::ClientOptions o;
  o.address = absl::GetFlag(FLAGS_addr);
  o.client_name = "ops_traffic";
  auto client = kvdepot::KVCacheClient::Connect(o);
  if (!client.ok()) {
    std::fprintf(stderr, "connect: %s\n", client.status().ToString().c_str());
    return 1;
  }
  auto pool = (*client)->GetPool(absl::GetFlag(FLAGS_pool));
  if (!pool.ok()) {
    std::fprintf(stderr, "get pool: %s\n", pool.status().ToString().c_str());
    return 1;
  }
  const kvdepot::v1::PoolLayout& l = pool->layout();
  const int64_t n = absl::GetFlag(FLAGS_tokens);
  std::mt19937 rng(absl::GetFlag(FLAGS_seed));
  std::normal_distribution<float> dist(0.0f, 3.0f);
  std::vector<int32_t> slots(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    slots[i] = static_cast<int32_t>(absl::GetFlag(FLAGS_first_slot) + i);
  }
  for (int round = 0; round < absl::GetFlag(FLAGS_rounds); ++round) {
    std::vector<float> kv(static_cast<size_t>(n * l.elements()));
    for (float& v : kv) v = dist(rng);
    kvdepot::v1::StoreRequest s;
    s.set_pool(pool->name());
    s.set_layer(absl::GetFlag(FLAGS_layer));
    s.set_num_tokens(n);
    kvdepot::EncodeInt32s(slots, s.mutable_slot_mapping());
    s.set_dtype(kvdepot::v1::INPUT_DTYPE_FP32);
    s.mutable_kv()->set_inline_data(kv.data(), kv.size() * sizeof(float));
    auto stored = (*client)->Store(s);
    if (!stored.ok()) {
      std::fprintf(stderr, "store: %s\n", stored.status().ToString().c_str());
      return 1;
    }
    kvdepot::v1::LoadRequest r;
    r.set_pool(pool->name());
    r.set_layer(absl::GetFlag(FLAGS_layer));
    const int32_t rows = static_cast<int32_t>(l.block_size());
    kvdepot::EncodeInt32s({0, 0, rows, 0},
                          r.mutable_segments()->mutable_segments());
    r.mutable_segments()->set_num_segments(1);
    r.mutable_segments()->set_total_k(rows);
    r.mutable_data()->set_inline_output(true);
    if (!l.do_cast()) r.mutable_scales()->set_inline_output(true);
    auto loaded = (*client)->Load(r);
    if (!loaded.ok()) {
      std::fprintf(stderr, "load: %s\n", loaded.status().ToString().c_str());
      return 1;
    }
  }
  return 0;
}
