import sys, struct, os
# Seeds of //tests/fuzz:service_fuzz: one call per RPC (rpc byte, 2-byte
# length, serialized request). Regenerate with Debian's python3:
#   protoc -Iproto --python_out=/tmp/pb proto/kvdepot/v1/kvdepot.proto
#   /usr/bin/python3 tests/fuzz/gen_service_seeds.py tests/fuzz/corpus/service_fuzz
sys.path.insert(0, '/tmp/pb')
from kvdepot.v1 import kvdepot_pb2 as pb
RPC = ['OpenSession','KeepAlive','CloseSession','CreatePool','GetPool','ListPools','DeletePool','AllocateBuffer','ImportBuffer','ReleaseBuffer','Store','Load','BuildPlan','PrefillLoad','ConvertTopk','SwaDecodeIndex','PrefillIndex','Stats','Ping','Inspect','Verify','Drain']
def i32s(v): return struct.pack('<%di' % len(v), *v)
def call(rpc, msg):
    b = msg.SerializeToString()
    assert len(b) <= 4096
    return bytes([RPC.index(rpc), len(b) >> 8, len(b) & 0xff]) + b
seeds = {}
S = 's'
seeds['open_keepalive_close'] = call('OpenSession', pb.OpenSessionRequest(client_name='fuzz')) + call('KeepAlive', pb.KeepAliveRequest(session_id=S)) + call('CloseSession', pb.CloseSessionRequest(session_id=S))
seeds['pools'] = call('CreatePool', pb.CreatePoolRequest(name='q', format='MXFP8_INDEX', block_size=5, num_blocks=3, num_layers=1)) + call('GetPool', pb.GetPoolRequest(name='q')) + call('ListPools', pb.ListPoolsRequest()) + call('DeletePool', pb.DeletePoolRequest(name='q'))
seeds['buffers'] = call('AllocateBuffer', pb.AllocateBufferRequest(session_id=S, size=4096)) + call('ImportBuffer', pb.ImportBufferRequest(session_id=S, handle=pb.SharedHandle(shm_name='i', size=4096))) + call('ReleaseBuffer', pb.ReleaseBufferRequest(session_id=S, buffer_id=2)) + call('ReleaseBuffer', pb.ReleaseBufferRequest(session_id=S, buffer_id=3))
kv = struct.pack('<%df' % (2*128), *[((i*37) % 19 - 9) * 0.25 for i in range(256)])
seeds['store_inline_load_slice'] = call('Store', pb.StoreRequest(session_id=S, pool='p', layer=1, num_tokens=2, slot_mapping=i32s([3, 17]), dtype=pb.INPUT_DTYPE_FP32, kv=pb.DataRef(inline_data=kv))) + call('Load', pb.LoadRequest(session_id=S, pool='p', layer=1, segments=pb.Segments(num_segments=1, segments=i32s([0, 3, 5, 0]), total_k=2), data=pb.DataRef(slice=pb.BufferSlice(buffer_id=1, offset=0, length=256)), scales=pb.DataRef(inline_output=True)))
seeds['store_slice_bf16'] = call('Store', pb.StoreRequest(session_id=S, pool='b', layer=0, num_tokens=3, slot_mapping=i32s([0, -1, 34]), dtype=pb.INPUT_DTYPE_BF16, kv=pb.DataRef(slice=pb.BufferSlice(buffer_id=1, offset=64, length=48)))) + call('Inspect', pb.InspectRequest(pool='b', layer=0, slot=34, all_values=True))
seqplan = pb.SequencePlan(num_seqs=2, seqlen_k=i32s([20, 3]), max_blocks_per_seq=2, block_table=i32s([1, 2, 3, 0]), compress_ratio=1)
seeds['buildplan_load_sequences'] = call('BuildPlan', pb.BuildPlanRequest(pool='p', sequences=seqplan)) + call('Load', pb.LoadRequest(session_id=S, pool='p', layer=0, sequences=seqplan, data=pb.DataRef(inline_output=True), scales=pb.DataRef(inline_output=True)))
seeds['prefill_load'] = call('PrefillLoad', pb.PrefillLoadRequest(session_id=S, swa_pool='v', swa_layer=0, main_pool='v', main_layer=0, num_seqs=1, seqlen_k=i32s([40]), seqlen_q=i32s([8]), swa_state_id=i32s([2]), window=16, compress_ratio=4, max_blocks_per_seq=1, block_table=i32s([1]), dtype=pb.INPUT_DTYPE_BF16, chunk_kv=pb.DataRef(slice=pb.BufferSlice(buffer_id=1, offset=0, length=8*512*2)), output=pb.DataRef(inline_output=True)))
seeds['convert_topk'] = call('ConvertTopk', pb.ConvertTopkRequest(pool='p', batch=2, k=3, topk=i32s([0, 5, 40, 1, 2, 3]), valid_count=i32s([3, 2]), num_tokens=i32s([30, 4]), max_blocks_per_seq=2, block_table=i32s([7, 1, 0, 9])))
seeds['convert_topk_k0'] = call('ConvertTopk', pb.ConvertTopkRequest(pool='p', batch=1, k=0, valid_count=i32s([0]), num_tokens=i32s([5]), max_blocks_per_seq=1, block_table=i32s([0])))
seeds['swa_decode_index'] = call('SwaDecodeIndex', pb.SwaDecodeIndexRequest(pool='v', window=8, num_queries=2, queries=i32s([0, 60, 8, 3, 5, 2])))
seeds['swa_decode_index_num_queries_overflow'] = call('SwaDecodeIndex', pb.SwaDecodeIndexRequest(pool='v', window=3, num_queries=-6148914691236517205, queries=i32s([0])))
seeds['prefill_index'] = call('PrefillIndex', pb.PrefillIndexRequest(num_seqs=2, seqlen_k=i32s([10, 4]), seqlen_q=i32s([3, 4]), window=4, compress_ratio=2, topk_k=2, compressed_index=i32s([0, -1, 1, 2, 3, 4, -1, -1, 0, 1, 5, 6, 7, 0])))
seeds['ops'] = call('Stats', pb.StatsRequest()) + call('Ping', pb.PingRequest()) + call('Inspect', pb.InspectRequest(pool='p', layer=1, block=0, max_values=4)) + call('Verify', pb.VerifyRequest(pool='p', layers=[0, 1], progress_every=2)) + call('Drain', pb.DrainRequest()) + call('Store', pb.StoreRequest(session_id=S, pool='p', layer=0, num_tokens=0))
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
for k, v in seeds.items():
    open(os.path.join(out, 'seed_' + k), 'wb').write(v)
print(len(seeds), 'seeds')
