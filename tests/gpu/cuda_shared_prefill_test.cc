// The cross-layer shared prefill load on the CUDA backend (kvdepotd
// --backend=cuda in a child process, this test as the worker): the source
// layer's full PrefillLoad into a device buffer, then each consumer layer's
// shared_compressed load into the same slice, byte-identical to a full
// PrefillLoad of that layer into a fresh output, the SWA rings too.
//
// The ordering: before each consumer load the worker queues its previous
// layer's "attention", artificially delayed (a kernel spinning kDelay on
// the GPU timer), then a kernel reading rows [0, main_kv_offset) of the
// buffer into a snapshot, and records an interprocess event after it; the
// consumer request carries that event. The daemon must await it before it
// overwrites those rows: the snapshot must hold the previous layer's rows
// (not the consumer's), the event must have fired by the reply, and the
// reply must come no sooner than the delay. A control without the event
// shows the race the event prevents.
#include <cuda_runtime_api.h>

#include <cstring>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "common/cuda/cuda_events.h"
#include "common/cuda/cuda_mappings.h"
#include "gtest/gtest.h"
#include "tests/e2e_util.h"
#include "tests/gpu/gpu_fixture.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/shared_prefill_kernels.h"
#include "tests/shared_prefill_util.h"

namespace kvdepot::testing {
namespace {

constexpr absl::Duration kDelay = absl::Milliseconds(300);

class CudaSharedPrefillTest : public GpuTest,
                              public ::testing::WithParamInterface<SharedCase> {
 protected:
  void SetUpGroup(const SharedCase& c) {
    g_ = SharedGroup::Make(c, 501);
    swa_ = "sp_swa_" + c.name;
    main_ = "sp_main_" + c.name;
    absl::StatusOr<v1::PoolInfo> s = client_->CreatePool(g_.SwaPool(swa_));
    ASSERT_TRUE(s.ok()) << s.status();
    absl::StatusOr<v1::PoolInfo> m = client_->CreatePool(g_.MainPool(main_));
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_OK(FillGroupPools(*client_, g_, swa_, main_, 502));
    chunks_ = GroupChunks(g_, 503);
    absl::StatusOr<v1::BufferInfo> b =
        AllocateCudaBuffer(*client_, g_.output_bytes());
    ASSERT_TRUE(b.ok()) << b.status();
    buffer_id_ = b->buffer_id();
    absl::StatusOr<CudaIpcMapping> map = CudaIpcMapping::Open(b->handle());
    ASSERT_TRUE(map.ok()) << map.status();
    out_.emplace(*std::move(map));
    void* snapshot = nullptr;
    ASSERT_OK(Cuda(cudaMalloc(&snapshot, g_.main_kv_offset * g_.row_bytes()),
                   "the snapshot buffer"));
    snapshot_ = static_cast<uint8_t*>(snapshot);
  }

  void TearDown() override {
    if (snapshot_ != nullptr) (void)cudaFree(snapshot_);
    out_.reset();
    if (client_ != nullptr && buffer_id_ != 0) {
      (void)client_->ReleaseBuffer(buffer_id_);
      (void)client_->DeletePool(swa_);
      (void)client_->DeletePool(main_);
    }
  }

  v1::DataRef Slice() const {
    return SliceRef(buffer_id_, 0, g_.output_bytes());
  }

  std::string Reference(int64_t l) {
    v1::PrefillLoadRequest r = g_.Full(swa_, main_, g_.mirror(l));
    r.mutable_chunk_kv()->set_inline_data(chunks_[l]);
    r.mutable_output()->set_inline_output(true);
    absl::StatusOr<v1::PrefillLoadResponse> resp = client_->PrefillLoad(r);
    EXPECT_TRUE(resp.ok()) << "reference of layer " << l << ": "
                           << resp.status();
    return resp.ok() ? resp->output() : std::string();
  }

  std::vector<uint8_t> Read(const void* device, int64_t bytes) {
    std::vector<uint8_t> host(static_cast<size_t>(bytes));
    EXPECT_TRUE(Cuda(cudaMemcpy(host.data(), device, static_cast<size_t>(bytes),
                                cudaMemcpyDeviceToHost),
                     "reading device memory")
                    .ok());
    return host;
  }

  std::string CompareRows(const uint8_t* want, const uint8_t* got,
                          int64_t bytes) const {
    const int64_t rb = g_.row_bytes();
    return CompareBytes(want, got, bytes, [rb](int64_t o) {
      return "row " + std::to_string(o / rb) + " byte " +
             std::to_string(o % rb);
    });
  }

  void ExpectRingsEqual(int64_t l) {
    absl::StatusOr<v1::PoolInfo> info = client_->GetPool(swa_);
    ASSERT_TRUE(info.ok()) << info.status();
    absl::StatusOr<CudaIpcMapping> pool = CudaIpcMapping::Open(info->handle());
    ASSERT_TRUE(pool.ok()) << pool.status();
    const v1::PoolLayout& lay = info->layout();
    const std::vector<uint8_t> a =
        Read(pool->data() + l * lay.layer_stride(), lay.layer_bytes());
    const std::vector<uint8_t> b = Read(
        pool->data() + g_.mirror(l) * lay.layer_stride(), lay.layer_bytes());
    EXPECT_EQ(CompareBytes(b.data(), a.data(), lay.layer_bytes(),
                           [](int64_t o) { return std::to_string(o); }),
              "")
        << "SWA ring of layer " << l << " after the chunk's store";
  }

  // Queues the delayed "attention" of the layer before `l` and records
  // `event` after it.
  void QueueDelayedAttention(CudaIpcEvent& event) {
    const int e = LaunchDelayedRead(
        out_->data(), snapshot_, g_.main_kv_offset * g_.row_bytes(),
        absl::ToInt64Nanoseconds(kDelay), stream_->get());
    ASSERT_EQ(e, 0) << cudaGetErrorString(static_cast<cudaError_t>(e));
    ASSERT_OK(event.Record(stream_->get()));
  }

  SharedGroup g_;
  std::string swa_, main_;
  std::vector<std::string> chunks_;
  uint64_t buffer_id_ = 0;
  std::optional<CudaIpcMapping> out_;
  uint8_t* snapshot_ = nullptr;
};

TEST_P(CudaSharedPrefillTest, ConsumersEqualFullLoadsAndWaitForTheAttention) {
  ASSERT_NO_FATAL_FAILURE(SetUpGroup(GetParam()));
  const int64_t rb = g_.row_bytes();
  const int64_t swa_bytes = g_.main_kv_offset * rb;
  absl::StatusOr<CudaIpcEvent> event = CudaIpcEvent::Create(0);
  ASSERT_TRUE(event.ok()) << event.status();
  // A full load takes the event too (here one that fires at once).
  ASSERT_OK(event->Record(stream_->get()));
  v1::PrefillLoadRequest src = g_.Full(swa_, main_, 0);
  src.mutable_chunk_kv()->set_inline_data(chunks_[0]);
  *src.mutable_output() = Slice();
  src.set_wait_event_ipc_handle(event->handle());
  absl::StatusOr<v1::PrefillLoadResponse> s = client_->PrefillLoad(src);
  ASSERT_TRUE(s.ok()) << "source PrefillLoad: " << s.status();
  ASSERT_EQ(s->main_kv_offset(), g_.main_kv_offset);
  const std::string want0 = Reference(0);
  ASSERT_EQ(static_cast<int64_t>(want0.size()), g_.output_bytes());
  ASSERT_EQ(CompareRows(reinterpret_cast<const uint8_t*>(want0.data()),
                        Read(out_->data(), g_.output_bytes()).data(),
                        g_.output_bytes()),
            "")
      << "source layer";
  for (int64_t l = 1; l <= g_.c.consumers; ++l) {
    SCOPED_TRACE("consumer layer " + std::to_string(l));
    const std::string want = Reference(l);
    ASSERT_EQ(static_cast<int64_t>(want.size()), g_.output_bytes());
    const std::vector<uint8_t> before = Read(out_->data(), swa_bytes);
    ASSERT_NE(0, std::memcmp(before.data(), want.data(), swa_bytes))
        << "the consumer's rows must differ from the previous layer's";
    ASSERT_NO_FATAL_FAILURE(QueueDelayedAttention(*event));
    v1::PrefillLoadRequest r = g_.Consumer(swa_, main_, l);
    r.mutable_chunk_kv()->set_inline_data(chunks_[l]);
    *r.mutable_output() = Slice();
    r.set_wait_event_ipc_handle(event->handle());
    const absl::Time sent = absl::Now();
    absl::StatusOr<v1::PrefillLoadResponse> got = client_->PrefillLoad(r);
    const absl::Duration took = absl::Now() - sent;
    ASSERT_TRUE(got.ok()) << "consumer PrefillLoad: " << got.status();
    EXPECT_EQ(got->main_segments(), 0);
    EXPECT_EQ(cudaEventQuery(event->get()), cudaSuccess)
        << "the reply came before the worker's event fired";
    EXPECT_GE(took, kDelay / 2) << "the daemon did not wait for the event";
    ASSERT_OK(stream_->Sync());
    EXPECT_EQ(CompareRows(before.data(), Read(snapshot_, swa_bytes).data(),
                          swa_bytes),
              "")
        << "the delayed attention must read the previous layer's rows, not "
           "the consumer's (a read-after-write race)";
    EXPECT_EQ(CompareRows(reinterpret_cast<const uint8_t*>(want.data()),
                          Read(out_->data(), g_.output_bytes()).data(),
                          g_.output_bytes()),
              "")
        << "consumer output vs a full load into a fresh buffer";
    ASSERT_NO_FATAL_FAILURE(ExpectRingsEqual(l));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Sizes, CudaSharedPrefillTest,
    ::testing::Values(
        SharedCase{"bs1_r1_w1", "V41", "V41", 512, 1, 1, 1, 1, 2},
        SharedCase{"bs7_r4_w5", "V41", "V41_FP4", 512, 7, 4, 5, 7, 3},
        SharedCase{"bs133_r2_w100", "V41_FP4", "V41", 512, 133, 2, 100, 133, 2},
        SharedCase{"bs64_r4_w4096", "V41", "V41", 512, 16, 4, 4096, 4096, 2}),
    [](const ::testing::TestParamInfo<SharedCase>& i) { return i.param.name; });

// The control: the same without the event. When the reply comes back
// while the worker's event is still pending (the daemon did not wait), the
// snapshot holds the consumer's rows: the race the event prevents. (When
// the GPU ran the daemon's work only after the delay, the control cannot
// show it and says so.)
using CudaSharedPrefillControlTest = CudaSharedPrefillTest;

TEST_F(CudaSharedPrefillControlTest, WithoutTheEventTheRaceShows) {
  ASSERT_NO_FATAL_FAILURE(
      SetUpGroup(SharedCase{"control", "V41", "V41", 512, 7, 4, 5, 7, 1}));
  const int64_t swa_bytes = g_.main_kv_offset * g_.row_bytes();
  v1::PrefillLoadRequest src = g_.Full(swa_, main_, 0);
  src.mutable_chunk_kv()->set_inline_data(chunks_[0]);
  *src.mutable_output() = Slice();
  ASSERT_TRUE(client_->PrefillLoad(src).ok());
  absl::StatusOr<CudaIpcEvent> event = CudaIpcEvent::Create(0);
  ASSERT_TRUE(event.ok()) << event.status();
  ASSERT_NO_FATAL_FAILURE(QueueDelayedAttention(*event));
  v1::PrefillLoadRequest r = g_.Consumer(swa_, main_, 1);
  r.mutable_chunk_kv()->set_inline_data(chunks_[1]);
  *r.mutable_output() = Slice();
  ASSERT_TRUE(client_->PrefillLoad(r).ok());
  const bool pending = cudaEventQuery(event->get()) == cudaErrorNotReady;
  ASSERT_OK(stream_->Sync());
  if (!pending) {
    std::cout << "[control] inconclusive: the worker's event had fired by "
                 "the reply\n";
    return;
  }
  const std::vector<uint8_t> after = Read(out_->data(), swa_bytes);
  EXPECT_EQ(
      CompareRows(after.data(), Read(snapshot_, swa_bytes).data(), swa_bytes),
      "")
      << "without the event the delayed attention read the consumer's rows";
  std::cout << "[control] the race showed without the event\n";
}

// record_event: the source sent by one session and replied at once, the
// consumers sent at once by a second session granted the buffer and the
// pools, each replied at once too. The daemon queues the consumers behind
// the source (the SWA pool and the buffer are both still in use on the
// source's stream); after both sessions' events the buffer equals a full
// load of the last consumer layer and every ring its mirror.
using CudaSharedPrefillAsyncTest = CudaSharedPrefillTest;

TEST_F(CudaSharedPrefillAsyncTest, RecordEventSourceThenConsumersElsewhere) {
  ASSERT_NO_FATAL_FAILURE(
      SetUpGroup(SharedCase{"async", "V41", "V41", 512, 16, 4, 4096, 4096, 3}));
  std::unique_ptr<KVCacheClient> b = ConnectOrDie(DaemonSocket());
  ASSERT_NE(b, nullptr);
  for (int i = 0; i < 3; ++i) {
    v1::GrantRequest g;
    if (i == 0) g.set_buffer_id(buffer_id_);
    if (i == 1) g.set_pool(swa_);
    if (i == 2) g.set_pool(main_);
    g.add_sessions(b->session_number());
    ASSERT_OK(client_->Grant(g));
  }
  auto wait = [](const std::string& handle, const char* what) {
    ASSERT_FALSE(handle.empty()) << what << ": no recorded event";
    absl::StatusOr<CudaIpcEvent> e =
        CudaIpcEvent::Open("recorded_event_ipc_handle", handle, 0);
    ASSERT_TRUE(e.ok()) << what << ": " << e.status();
    ASSERT_OK(Cuda(cudaEventSynchronize(e->get()), what));
  };
  v1::PrefillLoadRequest src = g_.Full(swa_, main_, 0);
  src.mutable_chunk_kv()->set_inline_data(chunks_[0]);
  *src.mutable_output() = Slice();
  src.set_record_event(true);
  absl::StatusOr<v1::PrefillLoadResponse> s = client_->PrefillLoad(src);
  ASSERT_TRUE(s.ok()) << "source PrefillLoad: " << s.status();
  std::string last;
  for (int64_t l = 1; l <= g_.c.consumers; ++l) {
    v1::PrefillLoadRequest r = g_.Consumer(swa_, main_, l);
    r.mutable_chunk_kv()->set_inline_data(chunks_[l]);
    *r.mutable_output() = Slice();
    r.set_record_event(true);
    absl::StatusOr<v1::PrefillLoadResponse> got = b->PrefillLoad(r);
    ASSERT_TRUE(got.ok()) << "consumer " << l << ": " << got.status();
    last = got->recorded_event_ipc_handle();
  }
  ASSERT_NO_FATAL_FAILURE(wait(s->recorded_event_ipc_handle(), "source"));
  ASSERT_NO_FATAL_FAILURE(wait(last, "last consumer"));
  const std::string want = Reference(g_.c.consumers);
  ASSERT_EQ(static_cast<int64_t>(want.size()), g_.output_bytes());
  EXPECT_EQ(CompareRows(reinterpret_cast<const uint8_t*>(want.data()),
                        Read(out_->data(), g_.output_bytes()).data(),
                        g_.output_bytes()),
            "")
      << "the buffer after the last consumer vs its full load";
  for (int64_t l = 1; l < g_.c.consumers; ++l) (void)Reference(l);
  (void)Reference(0);
  for (int64_t l = 0; l <= g_.c.consumers; ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    ASSERT_NO_FATAL_FAILURE(ExpectRingsEqual(l));
  }
}

}  // namespace
}  // namespace kvdepot::testing
