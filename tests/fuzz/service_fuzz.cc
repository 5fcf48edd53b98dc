// The request path of every kvdepot.v1.KVCache RPC in process: a fresh
// KVCacheService on the CPU backend per input (service_world.h: pools "p",
// "v", "b"; one session with one 1 MiB buffer, id 1), then up
// to 8 calls. Each call is one byte choosing the RPC and a length-prefixed
// protobuf request that is parsed as the gRPC layer would (unparseable
// bytes are skipped) and handed to the handler: decode, validate, plan,
// CPU backend. Verify, a server stream, goes through an in-process gRPC
// channel. Fix-ups keep inputs meaningful and the host safe: session_id
// "s" is the live session; every ImportBuffer shm_name gets a prefix no
// object has (the CPU backend refuses gRPC imports anyway, but the fuzzer
// must never map other processes' memory). Imported memory is a memfd the
// world imported as buffer 2, as the companion socket would.
// Property: no crash, no sanitizer report, never UNKNOWN (an exception or an
// unconverted error) or INTERNAL.
#include <grpcpp/grpcpp.h>
#include <grpcpp/test/server_context_test_spouse.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "kvdepot/v1/kvdepot.grpc.pb.h"
#include "server/service.h"
#include "spdlog/spdlog.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/service_world.h"

namespace kvdepot::fuzz {
namespace {

using Ctx = grpc::ServerContext;

void CheckStatus(const grpc::Status& s, const char* rpc) {
  FUZZ_CHECK(s.error_code() != grpc::StatusCode::UNKNOWN &&
                 s.error_code() != grpc::StatusCode::INTERNAL,
             "%s returned %d: %s", rpc, static_cast<int>(s.error_code()),
             s.error_message().c_str());
}

// Forwards Verify (a server stream needs a real ServerWriter) to the
// service of the current input.
class VerifyForwarder final : public v1::KVCache::Service {
 public:
  std::atomic<KVCacheService*> target{nullptr};
  grpc::Status Verify(Ctx* ctx, const v1::VerifyRequest* r,
                      grpc::ServerWriter<v1::VerifyProgress>* w) override {
    return target.load()->Verify(ctx, r, w);
  }
};

struct Harness {
  VerifyForwarder forwarder;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<v1::KVCache::Stub> stub;

  Harness() {
    grpc::ServerBuilder builder;
    builder.RegisterService(&forwarder);
    server = builder.BuildAndStart();
    FUZZ_CHECK(server != nullptr, "in-process server");
    stub = v1::KVCache::NewStub(
        server->InProcessChannel(grpc::ChannelArguments()));
  }
};

Harness& GetHarness() {
  static Harness* h = new Harness();  // lives as long as the process
  return *h;
}

using World = ServiceWorld;

// Session "s" -> the live session; ImportBuffer names as the header says.
void FixUp(const World& w, google::protobuf::Message* m) {
  const google::protobuf::FieldDescriptor* f =
      m->GetDescriptor()->FindFieldByName("session_id");
  if (f != nullptr && m->GetReflection()->GetString(*m, f) == "s") {
    m->GetReflection()->SetString(m, f, w.session);
  }
  if (auto* imp = dynamic_cast<v1::ImportBufferRequest*>(m);
      imp != nullptr && imp->handle().has_shm_name()) {
    const std::string& name = imp->handle().shm_name();
    imp->mutable_handle()->set_shm_name("/kvdepot-fuzz-absent-" +
                                        name.substr(name.empty() ? 0 : 1));
  }
}

// Parses `bytes` as Req, calls the handler, checks the status.
template <typename Req, typename Resp>
void Call(World& w, const std::string& bytes, const char* rpc,
          grpc::Status (KVCacheService::*handler)(KVCacheService::Ctx*,
                                                  const Req*, Resp*)) {
  Req req;
  if (!req.ParseFromString(bytes)) return;  // gRPC would not deliver it
  FixUp(w, &req);
  Resp resp;
  Ctx ctx;
  // The live session also in the metadata, as the client library sends it
  // for requests without a session_id field (index RPCs).
  grpc::testing::ServerContextTestSpouse spouse(&ctx);  // holds the strings
  spouse.AddClientMetadata(kSessionMetadataKey, w.session);
  CheckStatus((w.service.*handler)(&ctx, &req, &resp), rpc);
}

void CallVerify(World& w, const std::string& bytes) {
  v1::VerifyRequest req;
  if (!req.ParseFromString(bytes)) return;
  Harness& h = GetHarness();
  h.forwarder.target.store(&w.service);
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<v1::VerifyProgress>> reader =
      h.stub->Verify(&ctx, req);
  v1::VerifyProgress progress;
  while (reader->Read(&progress)) {
  }
  CheckStatus(reader->Finish(), "Verify");
}

void OneCall(World& w, int rpc, const std::string& b) {
  using S = KVCacheService;
  switch (static_cast<Rpc>(rpc)) {
    case Rpc::kOpenSession:
      return Call(w, b, "OpenSession", &S::OpenSession);
    case Rpc::kKeepAlive:
      return Call(w, b, "KeepAlive", &S::KeepAlive);
    case Rpc::kCloseSession:
      return Call(w, b, "CloseSession", &S::CloseSession);
    case Rpc::kCreatePool:
      return Call(w, b, "CreatePool", &S::CreatePool);
    case Rpc::kGetPool:
      return Call(w, b, "GetPool", &S::GetPool);
    case Rpc::kListPools:
      return Call(w, b, "ListPools", &S::ListPools);
    case Rpc::kDeletePool:
      return Call(w, b, "DeletePool", &S::DeletePool);
    case Rpc::kAllocateBuffer:
      return Call(w, b, "AllocateBuffer", &S::AllocateBuffer);
    case Rpc::kImportBuffer:
      return Call(w, b, "ImportBuffer", &S::ImportBuffer);
    case Rpc::kReleaseBuffer:
      return Call(w, b, "ReleaseBuffer", &S::ReleaseBuffer);
    case Rpc::kGrant:
      return Call(w, b, "Grant", &S::Grant);
    case Rpc::kStore:
      return Call(w, b, "Store", &S::Store);
    case Rpc::kLoad:
      return Call(w, b, "Load", &S::Load);
    case Rpc::kBuildPlan:
      return Call(w, b, "BuildPlan", &S::BuildPlan);
    case Rpc::kPrefillLoad:
      return Call(w, b, "PrefillLoad", &S::PrefillLoad);
    case Rpc::kConvertTopk:
      return Call(w, b, "ConvertTopk", &S::ConvertTopk);
    case Rpc::kSwaDecodeIndex:
      return Call(w, b, "SwaDecodeIndex", &S::SwaDecodeIndex);
    case Rpc::kPrefillIndex:
      return Call(w, b, "PrefillIndex", &S::PrefillIndex);
    case Rpc::kStats:
      return Call(w, b, "Stats", &S::Stats);
    case Rpc::kPing:
      return Call(w, b, "Ping", &S::Ping);
    case Rpc::kInspect:
      return Call(w, b, "Inspect", &S::Inspect);
    case Rpc::kVerify:
      return CallVerify(w, b);
    case Rpc::kDrain:
      return Call(w, b, "Drain", &S::Drain);
    case Rpc::kCount:
      return;
  }
}

}  // namespace
}  // namespace kvdepot::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);  // one log line per call otherwise
  kvdepot::fuzz::GetHarness();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvdepot::fuzz;
  FuzzInput in(data, size);
  World w;
  for (int i = 0; i < 8 && in.remaining() > 0; ++i) {
    const int rpc = in.Byte() % static_cast<int>(kvdepot::Rpc::kCount);
    OneCall(w, rpc, in.Bytes(4096));
  }
  return 0;
}
