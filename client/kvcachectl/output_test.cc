#include "client/kvcachectl/output.h"

#include <cmath>
#include <sstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvdepot/v1/kvdepot.pb.h"

namespace kvdepot::ctl {
namespace {

TEST(ProtoToJsonTest, NumbersStayNumbersHashesBecomeHex) {
  v1::PoolInfo p;
  p.set_name("main");
  p.mutable_layout()->set_total_bytes(int64_t{1} << 40);
  p.mutable_layout()->set_block_size(64);
  p.mutable_handle()->set_shm_name("/kvdepot-x");
  const Json j = ProtoToJson(p);
  EXPECT_TRUE(j["layout"]["total_bytes"].is_number_integer());
  EXPECT_EQ(j["layout"]["total_bytes"], int64_t{1} << 40);
  EXPECT_TRUE(j["layout"]["do_cast"].is_boolean());  // defaults printed
  EXPECT_EQ(j["handle"]["shm_name"], "/kvdepot-x");
  EXPECT_FALSE(j["handle"].contains("cuda_ipc_handle"));  // unset oneof
  v1::BlockChecksum c;
  c.set_xxh3(0xabcdef0123456789ull);
  EXPECT_EQ(ProtoToJson(c)["xxh3"], "abcdef0123456789");
  c.set_xxh3(0x12);
  EXPECT_EQ(ProtoToJson(c)["xxh3"], "0000000000000012");
}

TEST(ProtoToJsonTest, CountersDoNotClashWithLists) {
  v1::StatsResponse s;
  s.set_pools(2);
  const Json j = ProtoToJson(s);
  EXPECT_EQ(j["num_pools"], 2);
  EXPECT_FALSE(j.contains("pools"));
  EXPECT_TRUE(j.contains("num_sessions"));
  v1::DrainResponse d;
  EXPECT_TRUE(ProtoToJson(d).contains("num_buffers"));
}

TEST(ProtoToJsonTest, NonFiniteFloatsAreStrings) {
  v1::InspectRecord r;
  r.add_values(1.5f);
  r.add_values(std::nanf(""));
  r.add_values(-INFINITY);
  const Json j = ProtoToJson(r);
  EXPECT_EQ(j["values"][0], 1.5);
  EXPECT_EQ(j["values"][1], "NaN");
  EXPECT_EQ(j["values"][2], "-Infinity");
}

TEST(YamlTest, NestedBlocksAndQuotedStrings) {
  Json j = Json::object();
  j["name"] = "main";
  j["hash"] = "0000000000000012";
  j["n"] = 3;
  j["empty"] = Json::array();
  j["list"] = Json::array({Json{{"a", 1}, {"b", "x: y"}}, 2});
  EXPECT_EQ(ToYaml(j),
            "---\n"
            "name: main\n"
            "hash: \"0000000000000012\"\n"
            "n: 3\n"
            "empty: []\n"
            "list:\n"
            "  - a: 1\n"
            "    b: \"x: y\"\n"
            "  - 2\n");
  std::ostringstream out;
  PrintStructured(j, OutputFormat::kJson, out);
  EXPECT_EQ(out.str().back(), '\n');
  EXPECT_EQ(Json::parse(out.str()), j);
}

}  // namespace
}  // namespace kvdepot::ctl
