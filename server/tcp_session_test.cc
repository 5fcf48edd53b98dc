// TCP sessions (SPEC §11) attacked from outside: each client is a channel
// with its own certificate (tls_test_certs.h) against an in-process daemon.
// A session lives as long as its TcpSessions.Open stream and its identity
// is the certificate's subject: one subject cannot use, grant or delete
// another's pools; a config grant (or the owner's) to a subject lets it in;
// cancelling the stream ends the session; plain loopback TCP is anonymous;
// shutdown ends open streams.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/kvdepot_client.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "kvdepot/v1/kvdepot.grpc.pb.h"
#include "server/daemon.h"
#include "server/log_limiter.h"
#include "server/logging.h"
#include "server/tls_test_certs.h"

namespace kvdepot {
namespace {

using testing::CertDir;
using testing::ClientCreds;
using ::testing::HasSubstr;
using testing::MakeCa;
using testing::MakeCert;

constexpr char kPool[] =
    "format: \"BF16\" elements: 8 block_size: 4 num_blocks: 2 num_layers: 1";

// The IPv4 loopback address of a daemon's "127.0.0.1:<port>" target.
sockaddr_in LoopbackAddressOf(const std::string& target) {
  const int port = std::stoi(target.substr(target.rfind(':') + 1));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return addr;
}

// One client: a channel, its session stream and the session id.
class Client {
 public:
  Client(const std::string& target,
         std::shared_ptr<grpc::ChannelCredentials> creds) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 200);
    auto channel = grpc::CreateCustomChannel(target, creds, args);
    stub_ = v1::KVCache::NewStub(channel);
    sessions_ = v1::TcpSessions::NewStub(channel);
  }
  ~Client() { Close(); }

  // Opens the session stream and reads its first event.
  grpc::Status Open(v1::SessionEvent* event) {
    ctx_ = std::make_unique<grpc::ClientContext>();
    v1::OpenSessionRequest r;
    r.set_client_name("tcp-session-test");
    stream_ = sessions_->Open(ctx_.get(), r);
    if (!stream_->Read(event)) return stream_->Finish();
    session_id_ = event->session_id();
    return grpc::Status::OK;
  }
  // Cancels the stream (as a client that exits does) and collects it.
  grpc::Status Close() {
    if (stream_ == nullptr) return grpc::Status::OK;
    ctx_->TryCancel();
    v1::SessionEvent e;
    while (stream_->Read(&e)) {
    }
    grpc::Status s = stream_->Finish();
    stream_.reset();
    return s;
  }
  // Waits for the end of the stream the daemon ends.
  grpc::Status AwaitEnd() {
    v1::SessionEvent e;
    while (stream_->Read(&e)) {
    }
    grpc::Status s = stream_->Finish();
    stream_.reset();
    return s;
  }

  template <typename Req>
  void Prepare(grpc::ClientContext* ctx, Req* /*r*/) {
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::seconds(10));
    ctx->AddMetadata("kvdepot-session-id", session_id_);
  }
  grpc::StatusCode CreatePool(const std::string& name) {
    v1::CreatePoolRequest r;
    EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(kPool, &r));
    r.set_name(name);
    grpc::ClientContext ctx;
    Prepare(&ctx, &r);
    v1::PoolInfo out;
    return stub_->CreatePool(&ctx, r, &out).error_code();
  }
  // A BF16 store of one token into slot 0: a write.
  grpc::Status Store(const std::string& pool) {
    v1::StoreRequest r;
    r.set_pool(pool);
    r.set_num_tokens(1);
    r.set_slot_mapping(std::string(4, '\0'));
    r.set_dtype(v1::INPUT_DTYPE_BF16);
    r.mutable_kv()->set_inline_data(std::string(16, '\x3f'));
    grpc::ClientContext ctx;
    Prepare(&ctx, &r);
    v1::StoreResponse out;
    return stub_->Store(&ctx, r, &out);
  }
  grpc::StatusCode Inspect(const std::string& pool) {
    v1::InspectRequest r;
    r.set_pool(pool);
    r.set_slot(0);
    grpc::ClientContext ctx;
    Prepare(&ctx, &r);
    v1::InspectResponse out;
    return stub_->Inspect(&ctx, r, &out).error_code();
  }
  grpc::StatusCode Delete(const std::string& pool) {
    v1::DeletePoolRequest r;
    r.set_name(pool);
    grpc::ClientContext ctx;
    Prepare(&ctx, &r);
    v1::DeletePoolResponse out;
    return stub_->DeletePool(&ctx, r, &out).error_code();
  }
  grpc::Status Grant(const std::string& pool,
                     const std::vector<std::string>& subjects) {
    v1::GrantRequest r;
    r.set_pool(pool);
    for (const std::string& s : subjects) r.add_tls_subjects(s);
    grpc::ClientContext ctx;
    Prepare(&ctx, &r);
    v1::GrantResponse out;
    return stub_->Grant(&ctx, r, &out);
  }
  v1::StatsResponse Stats() {
    grpc::ClientContext ctx;
    v1::StatsResponse out;
    EXPECT_TRUE(stub_->Stats(&ctx, v1::StatsRequest(), &out).ok());
    return out;
  }
  int64_t Sessions() { return Stats().sessions(); }
  const std::string& session_id() const { return session_id_; }

 private:
  std::unique_ptr<v1::KVCache::Stub> stub_;
  std::unique_ptr<v1::TcpSessions::Stub> sessions_;
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<grpc::ClientReader<v1::SessionEvent>> stream_;
  std::string session_id_;
};

std::string WriteConfig(const std::string& text) {
  const std::string path = CertDir() + "/config.textproto";
  std::ofstream(path) << text;
  return path;
}

class TcpSessionTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    MakeCa("ca");
    MakeCert("ca", "server", "kvdepotd");
    for (const char* c : {"worker-a", "worker-b", "worker-c", "ops"}) {
      MakeCert("ca", c, c);
    }
  }

  std::unique_ptr<Daemon> StartTls(const std::string& config) {
    DaemonOptions o;
    o.backend = "cpu";
    o.listen = "127.0.0.1:0";
    o.tls.cert_path = CertDir() + "/server.pem";
    o.tls.key_path = CertDir() + "/server.key";
    o.tls.client_ca_path = CertDir() + "/ca.pem";
    o.memory_budget_bytes = int64_t{64} << 20;
    o.drain_timeout = absl::Seconds(60);
    o.config_path = WriteConfig(config);
    absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
    EXPECT_TRUE(d.ok()) << d.status();
    return d.ok() ? *std::move(d) : nullptr;
  }
};

TEST_F(TcpSessionTest, SubjectsOwnTheirPoolsAndOnlyGrantsLetOthersIn) {
  std::unique_ptr<Daemon> d = StartTls(absl::StrCat(
      "pools { name: \"shared\" ", kPool, " }\n",
      "grants { pool: \"shared\" tls_subjects: \"CN=worker-b\" }\n",
      "admin_tls_subjects: \"CN=ops\"\n"));
  ASSERT_NE(d, nullptr);
  Client a(d->target(), ClientCreds("ca", "worker-a"));
  Client b(d->target(), ClientCreds("ca", "worker-b"));
  Client c(d->target(), ClientCreds("ca", "worker-c"));
  v1::SessionEvent ea, eb, ec;
  ASSERT_TRUE(a.Open(&ea).ok());
  ASSERT_TRUE(b.Open(&eb).ok());
  ASSERT_TRUE(c.Open(&ec).ok());
  EXPECT_EQ(ea.tls_subject(), "CN=worker-a");
  EXPECT_EQ(eb.tls_subject(), "CN=worker-b");
  EXPECT_NE(ea.session_id(), eb.session_id());
  EXPECT_NE(ea.session_number(), eb.session_number());

  // A's pool is A's: B and C can neither read, write, grant nor delete it.
  ASSERT_EQ(a.CreatePool("a-pool"), grpc::StatusCode::OK);
  ASSERT_TRUE(a.Store("a-pool").ok());
  for (Client* other : {&b, &c}) {
    grpc::Status st = other->Store("a-pool");
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_THAT(st.error_message(), HasSubstr("neither the pool's owner"));
    EXPECT_EQ(other->Inspect("a-pool"), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_EQ(other->Delete("a-pool"), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_EQ(other->Grant("a-pool", {"CN=worker-c"}).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }
  EXPECT_EQ(c.Store("a-pool").error_code(), grpc::StatusCode::PERMISSION_DENIED)
      << "a refused grant must not have let C in";

  // The config grants "shared" to subject B only (the daemon owns it).
  EXPECT_TRUE(b.Store("shared").ok());
  EXPECT_EQ(a.Store("shared").error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(c.Inspect("shared"), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(b.Delete("shared"), grpc::StatusCode::PERMISSION_DENIED)
      << "a grant is use, not ownership";

  // The owner grants B by subject: B may use it, C still not.
  grpc::Status bad = a.Grant("a-pool", {std::string(2000, 'x')});
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(bad.error_message(), HasSubstr("tls_subjects[0]"));
  EXPECT_EQ(
      a.Grant("a-pool", std::vector<std::string>(65, "CN=x")).error_code(),
      grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(b.Store("a-pool").error_code(), grpc::StatusCode::PERMISSION_DENIED)
      << "a refused grant changed the access list";
  ASSERT_TRUE(a.Grant("a-pool", {"CN=worker-b"}).ok());
  EXPECT_TRUE(b.Store("a-pool").ok());
  EXPECT_EQ(c.Store("a-pool").error_code(),
            grpc::StatusCode::PERMISSION_DENIED);

  // The admin subject may delete anyone's pool; nobody else could.
  Client ops(d->target(), ClientCreds("ca", "ops"));
  v1::SessionEvent eo;
  ASSERT_TRUE(ops.Open(&eo).ok());
  EXPECT_EQ(ops.Delete("a-pool"), grpc::StatusCode::OK);
  d->Shutdown();
}

TEST_F(TcpSessionTest, ClosingTheStreamEndsTheSessionNotTheOwnership) {
  std::unique_ptr<Daemon> d = StartTls("");
  ASSERT_NE(d, nullptr);
  Client a(d->target(), ClientCreds("ca", "worker-a"));
  v1::SessionEvent e;
  ASSERT_TRUE(a.Open(&e).ok());
  ASSERT_EQ(a.CreatePool("a-pool"), grpc::StatusCode::OK);
  const int64_t before = a.Sessions();
  ASSERT_GE(before, 1);
  a.Close();
  // The id of the ended session is refused (UNAUTHENTICATED), and it is
  // gone from the daemon's count.
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  grpc::Status st = a.Store("a-pool");
  while (st.error_code() != grpc::StatusCode::UNAUTHENTICATED &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
    st = a.Store("a-pool");
  }
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(st.error_message(), ::testing::Not(HasSubstr(e.session_id())));
  EXPECT_EQ(a.Sessions(), before - 1);
  // The pool belongs to the subject: a new session of it still owns it.
  v1::SessionEvent again;
  ASSERT_TRUE(a.Open(&again).ok());
  EXPECT_NE(again.session_id(), e.session_id());
  EXPECT_TRUE(a.Store("a-pool").ok());
  EXPECT_EQ(a.Delete("a-pool"), grpc::StatusCode::OK);
  d->Shutdown();
}

TEST_F(TcpSessionTest, LoopbackWithoutTlsIsAnonymousAndShutdownEndsStreams) {
  DaemonOptions o;
  o.backend = "cpu";
  o.listen = "127.0.0.1:0";
  o.memory_budget_bytes = int64_t{64} << 20;
  o.drain_timeout = absl::Seconds(60);
  o.config_path = WriteConfig(absl::StrCat(
      "pools { name: \"open\" ", kPool, " }\n", "pools { name: \"closed\" ",
      kPool, " }\n", "grants { pool: \"open\" anonymous: true }\n",
      "grants { pool: \"closed\" tls_subjects: \"CN=worker-a\" }\n"));
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  ASSERT_TRUE(d.ok()) << d.status();
  Client anon((*d)->target(), grpc::InsecureChannelCredentials());
  v1::SessionEvent e;
  ASSERT_TRUE(anon.Open(&e).ok());
  EXPECT_EQ(e.tls_subject(), "");
  EXPECT_FALSE(e.session_id().empty());
  EXPECT_TRUE(anon.Store("open").ok());
  EXPECT_EQ(anon.Store("closed").error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(anon.CreatePool("mine"), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(anon.Delete("open"), grpc::StatusCode::PERMISSION_DENIED);
  // Shutdown ends the open stream itself (UNAVAILABLE) instead of waiting
  // out the 60 s drain deadline and cancelling it.
  std::thread stop([&] { (*d)->Shutdown(); });
  grpc::Status end = anon.AwaitEnd();
  stop.join();
  EXPECT_EQ(end.error_code(), grpc::StatusCode::UNAVAILABLE)
      << end.error_message();
  EXPECT_THAT(end.error_message(), HasSubstr("shutting down"));
}

// The C++ client over TCP: it opens the session stream by itself, with its
// certificate's identity, and ends the session when it is destroyed.
TEST_F(TcpSessionTest, ClientLibraryHoldsAStreamSession) {
  std::unique_ptr<Daemon> d = StartTls("");
  ASSERT_NE(d, nullptr);
  auto connect = [&](const std::string& who) {
    ClientOptions o;
    o.address = d->target();
    o.tls_ca_path = CertDir() + "/ca.pem";
    o.tls_cert_path = CertDir() + "/" + who + ".pem";
    o.tls_key_path = CertDir() + "/" + who + ".key";
    absl::StatusOr<std::unique_ptr<KVCacheClient>> c =
        KVCacheClient::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  };
  std::unique_ptr<KVCacheClient> a = connect("worker-a");
  std::unique_ptr<KVCacheClient> b = connect("worker-b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(a->tls_subject(), "CN=worker-a");
  EXPECT_NE(a->session_number(), 0u);
  v1::CreatePoolRequest r;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(kPool, &r));
  r.set_name("a-pool");
  ASSERT_TRUE(a->CreatePool(r).ok());
  EXPECT_EQ(b->DeletePool("a-pool").code(),
            absl::StatusCode::kPermissionDenied);
  absl::StatusOr<v1::StatsResponse> st = b->Stats();
  ASSERT_TRUE(st.ok());
  const int64_t before = st->sessions();
  a.reset();
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (absl::Now() < deadline) {
    st = b->Stats();
    ASSERT_TRUE(st.ok());
    if (st->sessions() == before - 1) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(st->sessions(), before - 1);
  // Without a certificate the mutual-TLS daemon lets nobody in; a
  // certificate file that is missing is refused before connecting.
  ClientOptions missing;
  missing.address = d->target();
  missing.tls_ca_path = CertDir() + "/ca.pem";
  missing.tls_cert_path = CertDir() + "/nobody.pem";
  missing.tls_key_path = CertDir() + "/nobody.key";
  EXPECT_EQ(KVCacheClient::Connect(missing).status().code(),
            absl::StatusCode::kInvalidArgument);
  d->Shutdown();
}

// Subjects in the config are checked like those of a Grant: the daemon
// refuses to start on an empty or oversized one, naming it.
TEST_F(TcpSessionTest, ConfigSubjectsAreChecked) {
  for (const auto& [config, field] :
       std::vector<std::pair<std::string, std::string>>{
           {"admin_tls_subjects: \"\"\n", "admin_tls_subjects[0]"},
           {absl::StrCat("pools { name: \"p\" ", kPool,
                         " }\ngrants { pool: \"p\" tls_subjects: \"",
                         std::string(2000, 'x'), "\" }\n"),
            "grants[0].tls_subjects[0]"}}) {
    DaemonOptions o;
    o.backend = "cpu";
    o.listen = "127.0.0.1:0";
    o.memory_budget_bytes = int64_t{64} << 20;
    o.config_path = WriteConfig(config);
    absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_THAT(std::string(d.status().message()), HasSubstr(field));
  }
}

// docs/SPEC.md §11: anyone who reaches the TLS port may open connections
// until the daemon has no descriptor left. gRPC 1.51's own TCP listener then
// stopped accepting for good (one EMFILE), and the port stayed dead after
// the flood; the daemon's listener refuses what would eat into its
// headroom, and its relay lets go of every connection the flood closes.
// The flood comes from another process, as an attacker's would: only the
// daemon's side of each connection is in this process's table.
TEST_F(TcpSessionTest, AConnectionFloodCannotStopTheTlsPort) {
  std::unique_ptr<Daemon> d = StartTls("");
  ASSERT_NE(d, nullptr);
  const std::string target = d->target();
  const sockaddr_in addr = LoopbackAddressOf(target);
  int ready[2];
  ASSERT_EQ(pipe2(ready, O_CLOEXEC), 0);
  constexpr int kFlood = 3000;
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // only system calls from here: no allocation
    close(ready[0]);
    rlimit more{};
    getrlimit(RLIMIT_NOFILE, &more);
    more.rlim_cur = more.rlim_max;
    setrlimit(RLIMIT_NOFILE, &more);
    for (int i = 0; i < kFlood; ++i) {
      const int s = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
      if (s < 0) break;
      connect(s, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
    }
    const char b = 1;
    (void)!write(ready[1], &b, 1);
    pause();  // holds them until killed
    _exit(0);
  }
  close(ready[1]);
  // The daemon's table: a little over its 256 descriptors of headroom.
  rlimit own{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &own), 0);
  {
    const int probe = open("/dev/null", O_RDONLY | O_CLOEXEC);
    ASSERT_GE(probe, 0);
    close(probe);
    rlimit low = own;
    low.rlim_cur = static_cast<rlim_t>(probe) + 600;
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  }
  char b = 0;
  EXPECT_EQ(read(ready[0], &b, 1), 1);
  close(ready[0]);
  // The table fills while the daemon takes what is waiting.
  absl::SleepFor(absl::Seconds(1));
  kill(child, SIGKILL);
  int status = 0;
  waitpid(child, &status, 0);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &own), 0);

  // A client with a certificate is served after the flood.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 200);
  auto channel =
      grpc::CreateCustomChannel(target, ClientCreds("ca", "worker-a"), args);
  ASSERT_TRUE(channel->WaitForConnected(std::chrono::system_clock::now() +
                                        std::chrono::seconds(15)))
      << "the TLS port stopped accepting";
  Client a(target, ClientCreds("ca", "worker-a"));
  v1::SessionEvent e;
  ASSERT_TRUE(a.Open(&e).ok());
  EXPECT_EQ(e.tls_subject(), "CN=worker-a");
  // The relay let go of every connection of the flood: what it carries
  // now is the two channels of this test.
  int64_t relayed = -1;
  for (int i = 0; i < 200 && relayed != 2; ++i) {
    relayed = a.Stats().tls_connections();
    if (relayed != 2) absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(relayed, 2);
  d->Shutdown();
}

// Every connection to the TLS port whose handshake fails makes gRPC write
// an ERROR line ("Handshake failed with fatal error ..."), whatever the
// bytes: anyone who can reach the port could write lines to the daemon's
// log as fast as they connect. Those lines now pass the rate limit of
// their kind (kvdepotd's InitLogging routes gRPC's lines): a flood of
// failed handshakes gets the share of one second, and the rest are
// counted and reported as dropped.
TEST_F(TcpSessionTest, AFloodOfFailedHandshakesCannotFloodTheLog) {
  ASSERT_TRUE(InitLogging("info", "text").ok());
  constexpr int kRate = 6;  // gRPC's lines get the unidentified half: 3/s
  SetClientLogRate(kRate);
  std::unique_ptr<Daemon> d = StartTls("");
  ASSERT_NE(d, nullptr);
  const sockaddr_in addr = LoopbackAddressOf(d->target());
  constexpr int kConnections = 60;
  ::testing::internal::CaptureStderr();
  const absl::Time start = absl::Now();
  for (int i = 0; i < kConnections; ++i) {
    const int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(s, 0);
    ASSERT_EQ(
        connect(s, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
    const char kHttp[] = "GET / HTTP/1.1\r\n\r\n";  // not TLS
    ASSERT_EQ(send(s, kHttp, sizeof(kHttp) - 1, MSG_NOSIGNAL),
              static_cast<ssize_t>(sizeof(kHttp) - 1));
    timeval tv{10, 0};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char buf[256];
    while (recv(s, buf, sizeof(buf), 0) > 0) {
    }
    close(s);  // gRPC has closed it: the handshake failed and was logged
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  d->Shutdown();  // reports the dropped lines
  d.reset();
  const std::string log = ::testing::internal::GetCapturedStderr();
  SetClientLogRate(kDefaultClientLogLinesPerSecond);
  int handshake_lines = 0;
  for (size_t at = log.find("Handshake failed"); at != std::string::npos;
       at = log.find("Handshake failed", at + 1)) {
    ++handshake_lines;
  }
  // gRPC's lines are in the log, as log lines.
  EXPECT_THAT(log, HasSubstr(" error kvdepotd grpc ")) << log;
  EXPECT_GE(handshake_lines, 1) << log;
  // A burst of one second's share, then the share per second.
  EXPECT_LE(handshake_lines, (kRate / 2) * (1 + static_cast<int>(seconds) + 1))
      << seconds << " s\n"
      << log;
  EXPECT_THAT(log, HasSubstr(" grpc lines dropped since ")) << log;
}

}  // namespace
}  // namespace kvdepot
