// PrefillLoad on the CUDA backend against the CPU backend: the same pools,
// the same stored K/V and the same request go to kvdepotd --backend=cuda
// (chunk and output in device buffers shared by IPC) and to a second
// kvdepotd --backend=cpu (inline bytes). The outputs, the replies and the
// SWA rings after the chunk's store must be byte-identical (SPEC §3: the
// GPU kernels are bit-exact with the CPU reference). Run twice: the reply
// meaning done, and with record_event (the reply at once with the session
// stream's event, waited for here before anything is read).
#include <cuda_runtime_api.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/cuda/cuda_events.h"
#include "common/cuda/cuda_mappings.h"
#include "gtest/gtest.h"
#include "tests/daemon_process.h"
#include "tests/e2e_util.h"
#include "tests/gpu/gpu_fixture.h"
#include "tests/gpu/gpu_test_util.h"

namespace kvdepot::testing {
namespace {

constexpr int kElements = 512;  // V41

// Fills every slot of layer 0 of `pool` with random K/V (inline Store).
void FillPool(KVCacheClient& c, const std::string& pool, int64_t slots,
              uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> all(static_cast<size_t>(slots));
  for (int64_t i = 0; i < slots; ++i) all[i] = static_cast<int32_t>(i);
  v1::StoreRequest r = StoreRequest(pool, 0, all, v1::INPUT_DTYPE_BF16);
  r.mutable_kv()->set_inline_data(Bf16Bytes(RandomKv(slots, kElements, rng)));
  absl::StatusOr<v1::StoreResponse> s = c.Store(r);
  ASSERT_TRUE(s.ok()) << pool << ": " << s.status();
}

class CudaPrefillTest : public GpuTest,
                        public ::testing::WithParamInterface<bool> {};

TEST_P(CudaPrefillTest, MatchesTheCpuBackendByteForByte) {
  const bool record_event = GetParam();
  absl::StatusOr<std::unique_ptr<DaemonProcess>> cpu_daemon =
      DaemonProcess::Start({"--backend=cpu", "--log_level=warn"},
                           DaemonBinary());
  ASSERT_TRUE(cpu_daemon.ok())
      << "starting the CPU daemon: " << cpu_daemon.status();
  std::unique_ptr<KVCacheClient> cpu =
      ConnectOrDie((*cpu_daemon)->socket_path());
  ASSERT_NE(cpu, nullptr);
  KVCacheClient* clients[2] = {client_.get(), cpu.get()};

  // SWA rings of B = 64 slots (4 states), compressed pool of blocks of 16.
  for (KVCacheClient* c : clients) {
    absl::StatusOr<v1::PoolInfo> swa =
        c->CreatePool(PoolRequest("pf_swa", "V41", 0, 64, 4, 1));
    ASSERT_TRUE(swa.ok()) << swa.status();
    absl::StatusOr<v1::PoolInfo> main =
        c->CreatePool(PoolRequest("pf_main", "V41", 0, 16, 32, 1));
    ASSERT_TRUE(main.ok()) << main.status();
    FillPool(*c, "pf_swa", 64 * 4, 301);
    FillPool(*c, "pf_main", 16 * 32, 302);
  }

  // Two sequences: one with a full window of history, one whose window
  // starts before position 0 (zero rows) and whose first queries fall out
  // of the ring (-1 store slots).
  const std::vector<int32_t> seqlen_k = {300, 90}, seqlen_q = {40, 90};
  v1::PrefillLoadRequest r;
  r.set_swa_pool("pf_swa");
  r.set_main_pool("pf_main");
  r.set_num_seqs(2);
  r.set_seqlen_k(Pack(seqlen_k));
  r.set_seqlen_q(Pack(seqlen_q));
  r.set_swa_state_id(Pack({2, 0}));
  r.set_swa_valid_start(Pack({0, 0}));
  r.set_window(48);
  r.set_compress_ratio(4);
  r.set_max_blocks_per_seq(5);
  r.set_block_table(Pack({7, 30, 1, 12, 25, 3, 19, 0, 0, 0}));
  r.set_dtype(v1::INPUT_DTYPE_BF16);
  std::mt19937 rng(303);
  const int64_t chunk_rows = 40 + 90;
  const std::string chunk = Bf16Bytes(RandomKv(chunk_rows, kElements, rng));
  ASSERT_FALSE(AllZero(reinterpret_cast<const uint8_t*>(chunk.data()),
                       static_cast<int64_t>(chunk.size())));

  // CPU: inline bytes.
  v1::PrefillLoadRequest on_cpu = r;
  on_cpu.mutable_chunk_kv()->set_inline_data(chunk);
  on_cpu.mutable_output()->set_inline_output(true);
  absl::StatusOr<v1::PrefillLoadResponse> want = cpu->PrefillLoad(on_cpu);
  ASSERT_TRUE(want.ok()) << "CPU PrefillLoad: " << want.status();
  const int64_t out_bytes = want->total_rows() * kElements * 2;
  ASSERT_EQ(static_cast<int64_t>(want->output().size()), out_bytes);

  // CUDA: chunk and output in device buffers of the daemon, mapped here.
  absl::StatusOr<v1::BufferInfo> in_buf =
      AllocateCudaBuffer(*client_, chunk.size());
  ASSERT_TRUE(in_buf.ok()) << in_buf.status();
  absl::StatusOr<v1::BufferInfo> out_buf =
      AllocateCudaBuffer(*client_, out_bytes);
  ASSERT_TRUE(out_buf.ok()) << out_buf.status();
  absl::StatusOr<CudaIpcMapping> in = CudaIpcMapping::Open(in_buf->handle());
  ASSERT_TRUE(in.ok()) << in.status();
  absl::StatusOr<CudaIpcMapping> out = CudaIpcMapping::Open(out_buf->handle());
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_OK(Cuda(cudaMemcpy(in->data(), chunk.data(), chunk.size(),
                            cudaMemcpyHostToDevice),
                 "writing the chunk"));
  v1::PrefillLoadRequest on_gpu = r;
  *on_gpu.mutable_chunk_kv() = SliceRef(in_buf->buffer_id(), 0, chunk.size());
  *on_gpu.mutable_output() = SliceRef(out_buf->buffer_id(), 0, out_bytes);
  on_gpu.set_record_event(record_event);
  absl::StatusOr<v1::PrefillLoadResponse> got = client_->PrefillLoad(on_gpu);
  ASSERT_TRUE(got.ok()) << "CUDA PrefillLoad: " << got.status();
  EXPECT_TRUE(want->recorded_event_ipc_handle().empty());
  if (record_event) {
    absl::StatusOr<CudaIpcEvent> done = CudaIpcEvent::Open(
        "recorded_event_ipc_handle", got->recorded_event_ipc_handle(), 0);
    ASSERT_TRUE(done.ok()) << done.status();
    ASSERT_OK(Cuda(cudaEventSynchronize(done->get()), "waiting on the event"));
  } else {
    EXPECT_TRUE(got->recorded_event_ipc_handle().empty());
  }
  EXPECT_EQ(got->total_k_swa(), want->total_k_swa());
  EXPECT_EQ(got->chunk_offset(), want->chunk_offset());
  EXPECT_EQ(got->main_kv_offset(), want->main_kv_offset());
  EXPECT_EQ(got->total_rows(), want->total_rows());
  EXPECT_EQ(got->cu_compressed(), want->cu_compressed());
  std::vector<uint8_t> bytes(static_cast<size_t>(out_bytes));
  ASSERT_OK(Cuda(
      cudaMemcpy(bytes.data(), out->data(), out_bytes, cudaMemcpyDeviceToHost),
      "reading the output"));
  const int64_t row = kElements * 2;
  EXPECT_EQ(
      CompareBytes(reinterpret_cast<const uint8_t*>(want->output().data()),
                   bytes.data(), out_bytes,
                   [&](int64_t o) {
                     return "row " + std::to_string(o / row) + " byte " +
                            std::to_string(o % row);
                   }),
      "")
      << "PrefillLoad output (history rows, chunk rows, compressed rows)";

  // The rings after the chunk's store.
  absl::StatusOr<const PoolMapping*> cpu_swa = cpu->MapPool("pf_swa");
  ASSERT_TRUE(cpu_swa.ok()) << cpu_swa.status();
  absl::StatusOr<v1::PoolInfo> gpu_info = client_->GetPool("pf_swa");
  ASSERT_TRUE(gpu_info.ok()) << gpu_info.status();
  absl::StatusOr<CudaIpcMapping> gpu_swa =
      CudaIpcMapping::Open(gpu_info->handle());
  ASSERT_TRUE(gpu_swa.ok()) << gpu_swa.status();
  const int64_t total = gpu_info->layout().total_bytes();
  std::vector<uint8_t> ring(static_cast<size_t>(total));
  ASSERT_OK(Cuda(
      cudaMemcpy(ring.data(), gpu_swa->data(), total, cudaMemcpyDeviceToHost),
      "reading the SWA pool"));
  EXPECT_EQ(CompareBytes((*cpu_swa)->data(), ring.data(), total,
                         [](int64_t o) { return std::to_string(o); }),
            "")
      << "SWA pool after the chunk's store";
  for (KVCacheClient* c : clients) {
    ASSERT_OK(c->DeletePool("pf_swa"));
    ASSERT_OK(c->DeletePool("pf_main"));
  }
}

INSTANTIATE_TEST_SUITE_P(Ordering, CudaPrefillTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& i) {
                           return i.param ? "RecordEvent" : "ReplyMeansDone";
                         });

}  // namespace
}  // namespace kvdepot::testing
