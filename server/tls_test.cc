// The listener's transport security: TCP beyond loopback is refused without
// mutual TLS; with it, only clients whose certificate chains to the client CA
// get in; rotated certificates are picked up without a restart. The
// certificates are made by the openssl command line in the test's tmpdir
// (tls_test_certs.h).
#include "server/tls.h"

#include <grpcpp/grpcpp.h>

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvdepot/v1/kvdepot.grpc.pb.h"
#include "server/daemon.h"
#include "server/tls_test_certs.h"

namespace kvdepot {
namespace {

using ::testing::HasSubstr;

using testing::ClientCreds;
using testing::MakeCa;
using testing::MakeCert;

std::string Dir() { return testing::CertDir(); }

TEST(TlsTest, LoopbackTargets) {
  EXPECT_TRUE(IsLoopbackTarget("127.0.0.1:50051"));
  EXPECT_TRUE(IsLoopbackTarget("127.9.8.7:1"));
  EXPECT_TRUE(IsLoopbackTarget("localhost:0"));
  EXPECT_TRUE(IsLoopbackTarget("[::1]:9000"));
  EXPECT_FALSE(IsLoopbackTarget("0.0.0.0:9000"));
  EXPECT_FALSE(IsLoopbackTarget("[::]:9000"));
  EXPECT_FALSE(IsLoopbackTarget("10.0.0.1:9000"));
  EXPECT_FALSE(IsLoopbackTarget("127.0.0.1.example.com:9000"));
  EXPECT_FALSE(IsLoopbackTarget("1270.0.0.1:9000"));
}

TEST(TlsTest, RefusesTcpBeyondLoopbackWithoutMutualTls) {
  DaemonOptions o;
  o.backend = "cpu";
  for (const char* listen : {"0.0.0.0:0", "[::]:0", "192.0.2.1:0"}) {
    o.listen = listen;
    absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
    EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition)
        << listen;
    EXPECT_THAT(std::string(d.status().message()), HasSubstr("mutual TLS"));
  }
  o.listen = "0.0.0.0:0";
  o.tls.cert_path = Dir() + "/missing.pem";
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("all three"));
  o.tls.key_path = o.tls.client_ca_path = o.tls.cert_path;
  d = Daemon::Start(o);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(d.status().message()),
              HasSubstr("--tls_cert: cannot read"));
  o.listen = absl::StrCat(Dir(), "/x.sock");
  d = Daemon::Start(o);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("Unix socket"));
}

// Ping over a channel; returns the status and the server certificate's CN.
grpc::Status Ping(const std::string& target,
                  std::shared_ptr<grpc::ChannelCredentials> creds,
                  std::string* server_cn = nullptr) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 200);
  auto stub =
      v1::KVCache::NewStub(grpc::CreateCustomChannel(target, creds, args));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::PingRequest req;
  v1::PingResponse resp;
  grpc::Status s = stub->Ping(&ctx, req, &resp);
  if (server_cn != nullptr && ctx.auth_context() != nullptr) {
    for (const grpc::string_ref& v :
         ctx.auth_context()->FindPropertyValues("x509_common_name")) {
      *server_cn = std::string(v.data(), v.size());
    }
  }
  return s;
}

TEST(TlsTest, MutualTlsAdmitsOnlyClientsOfTheCaAndReloadsCertificates) {
  MakeCa("ca");
  MakeCa("other_ca");
  MakeCert("ca", "server", "daemon-1");
  MakeCert("ca", "client", "scheduler-7");
  MakeCert("other_ca", "stranger", "scheduler-8");
  DaemonOptions o;
  o.backend = "cpu";
  o.listen = "127.0.0.1:0";
  o.tls.cert_path = Dir() + "/server.pem";
  o.tls.key_path = Dir() + "/server.key";
  o.tls.client_ca_path = Dir() + "/ca.pem";
  o.tls.refresh = absl::Seconds(1);
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string target = (*d)->target();

  std::string cn;
  grpc::Status s = Ping(target, ClientCreds("ca", "client"), &cn);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(cn, "daemon-1");
  EXPECT_FALSE(Ping(target, ClientCreds("ca", "")).ok())
      << "a client without a certificate got in";
  EXPECT_FALSE(Ping(target, ClientCreds("ca", "stranger")).ok())
      << "a certificate of another CA got in";
  EXPECT_FALSE(Ping(target, grpc::InsecureChannelCredentials()).ok())
      << "a plaintext client got in";

  // Rotation: a new server certificate, picked up by new connections.
  MakeCert("ca", "server", "daemon-2");
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (cn != "daemon-2" && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(200));
    cn.clear();
    ASSERT_TRUE(Ping(target, ClientCreds("ca", "client"), &cn).ok());
  }
  EXPECT_EQ(cn, "daemon-2") << "the rotated certificate was not served";
  (*d)->Shutdown();
}

}  // namespace
}  // namespace kvdepot
