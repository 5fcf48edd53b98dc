// Requests the fuzzers and issue #12 found crashing or answering UNKNOWN,
// through the service in process (service_world.h). Each must now be an
// ordinary answer: OK for documented-valid requests, INVALID_ARGUMENT
// naming the field otherwise.
#include <grpcpp/test/server_context_test_spouse.h>

#include <cstdint>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/wire.h"
#include "tests/fuzz/service_world.h"

namespace kvdepot::fuzz {
namespace {

using ::testing::HasSubstr;

// Issue #12: batch >= 1 with k = 0 is valid and aborted the daemon
// (SIGABRT, absl span bounds assertion in the planner).
TEST(ServiceRegressionTest, ConvertTopkKZeroWithBatch) {
  ServiceWorld w;
  for (int64_t batch : {1, 3}) {
    v1::ConvertTopkRequest r;
    r.set_pool("p");
    r.set_batch(batch);
    r.set_k(0);
    EncodeInt32s(std::vector<int32_t>(batch, 0), r.mutable_valid_count());
    EncodeInt32s(std::vector<int32_t>(batch, 5), r.mutable_num_tokens());
    r.set_max_blocks_per_seq(1);
    EncodeInt32s(std::vector<int32_t>(batch, 0), r.mutable_block_table());
    v1::ConvertTopkResponse out;
    grpc::ServerContext ctx;
    grpc::testing::ServerContextTestSpouse spouse(&ctx);  // holds the strings
    spouse.AddClientMetadata(kSessionMetadataKey, w.session);
    const grpc::Status s = w.service.ConvertTopk(&ctx, &r, &out);
    ASSERT_TRUE(s.ok()) << "batch " << batch << ": " << s.error_message();
    EXPECT_TRUE(out.slots().empty());
    EXPECT_EQ(out.invalid_count(), 0);
  }
}

// Issue #12: 3 * num_queries wrapped for a negative count (to 1 for this
// one), the decode passed and resize() threw: UNKNOWN over gRPC.
TEST(ServiceRegressionTest, SwaDecodeIndexNumQueriesOverflow) {
  ServiceWorld w;
  for (int64_t n : {int64_t{-6148914691236517205}, int64_t{-1},
                    int64_t{INT64_MIN}, int64_t{INT64_MAX}}) {
    v1::SwaDecodeIndexRequest r;
    r.set_pool("v");
    r.set_window(3);
    r.set_num_queries(n);
    EncodeInt32s({0}, r.mutable_queries());
    v1::SwaDecodeIndexResponse out;
    grpc::ServerContext ctx;
    grpc::testing::ServerContextTestSpouse spouse(&ctx);  // holds the strings
    spouse.AddClientMetadata(kSessionMetadataKey, w.session);
    const grpc::Status s = w.service.SwaDecodeIndex(&ctx, &r, &out);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << n;
    EXPECT_THAT(
        s.error_message(),
        HasSubstr("num_queries = " + std::to_string(n) + " is outside [0, "));
  }
}

}  // namespace
}  // namespace kvdepot::fuzz
