"""The decode step path's RPCs (SPEC §10, docs/STEP_PATH.md), service
kvdepot.v1.Step: a worker registers its doorbell, pools and per-layer
caches once (register_worker); a scheduler sends one step() per engine
step. The worker's GPU side (mark/wait on its stream) is
kvdepot.torch.StepWorker. No torch needed here.

    reg = register_worker(kv, doorbell=buf, layers=[
        layer(main=cache("main", 0, buf_in, offset=0, row_stride=1024),
              window=128)], max_tokens=256, max_seqs=64)
    step(kv, reg.registration_id, step_id=1, slot_mapping=[...],
         seq_lens=[...], query_lens=[...])
"""

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from kvdepot.v1 import step_pb2 as spb
from kvdepot.v1 import step_pb2_grpc as spb_grpc

from ._arrays import pack_int32, pack_int32_2d
from ._buffers import Buffer
from ._errors import invalid_argument


@dataclass
class Registration:
    registration_id: int
    doorbell_bytes: int   # the part of the doorbell buffer the daemon uses
    num_phases: int       # 1 + 2 * layers
    num_layers: int
    doorbell: Buffer      # the doorbell buffer (its vmm_fd opens a worker)


def doorbell_bytes(num_layers: int) -> int:
    """Bytes a doorbell buffer needs: 64 * (2 + 2 * layers)
    (proto/step_doorbell.h RegionBytes)."""
    if num_layers < 1:
        raise invalid_argument(f"num_layers = {num_layers} is not >= 1")
    return 64 * (2 + 2 * num_layers)


def _stub(client: Any) -> Any:
    stub = getattr(client, "_step_stub", None)
    if stub is None:
        client._check()
        stub = spb_grpc.StepStub(client._channel)
        client._step_stub = stub
    return stub


def buffer_ref(buffer: Any, offset: int = 0,
               row_stride: int = 0) -> "spb.StepBufferRef":
    """Rows of a buffer (a Buffer or a buffer id) for a registration."""
    buffer_id = buffer.id if isinstance(buffer, Buffer) else int(buffer)
    if offset < 0 or row_stride < 0:
        raise invalid_argument(
            f"offset = {offset}, row_stride = {row_stride}: not >= 0")
    return spb.StepBufferRef(buffer_id=buffer_id, offset=offset,
                             row_stride=row_stride)


def cache(pool: str, pool_layer: int, buffer: Any, *, offset: int = 0,
          row_stride: int) -> "spb.StepCache":
    """One cache of a layer: the pool layer and the worker's BF16 input rows
    ([tokens][elements], `row_stride` bytes apart) it is stored from."""
    return spb.StepCache(pool=pool, layer=pool_layer,
                         input=buffer_ref(buffer, offset, row_stride))


def layer(*, main: Optional["spb.StepCache"] = None,
          swa: Optional["spb.StepCache"] = None,
          index: Optional["spb.StepCache"] = None, ratio: int = 1,
          window: int = 0, topk: Optional["spb.StepBufferRef"] = None,
          index_out: Optional["spb.StepBufferRef"] = None
          ) -> "spb.StepLayer":
    """One layer's configuration (step.proto StepLayer)."""
    out = spb.StepLayer(ratio=ratio, window=window)
    for name, value in (("main", main), ("swa", swa), ("index", index),
                        ("topk", topk), ("index_out", index_out)):
        if value is not None:
            getattr(out, name).CopyFrom(value)
    return out


def register_worker(client: Any, *, doorbell: Buffer,
                    layers: Sequence["spb.StepLayer"],
                    swa_index: Optional["spb.StepSwaIndex"] = None,
                    max_tokens: int, max_seqs: int, max_top_k: int = 0,
                    max_blocks_per_seq: int = 1,
                    name: str = "") -> Registration:
    """RegisterWorker: `doorbell` a buffer of this client's session of at
    least doorbell_bytes(len(layers)) bytes (on the CUDA backend a VMM
    export; the daemon zeroes it). The CPU backend has no step path
    (FAILED_PRECONDITION)."""
    if not isinstance(doorbell, Buffer):
        raise invalid_argument("doorbell: pass the Buffer from "
                               "allocate_buffer(doorbell_bytes(layers))")
    if not layers:
        raise invalid_argument("layers: at least one layer")
    need = doorbell_bytes(len(layers))
    if doorbell.size < need:
        raise invalid_argument(
            f"doorbell buffer {doorbell.id} has {doorbell.size} bytes; "
            f"{len(layers)} layers need {need}")
    req = spb.RegisterWorkerRequest(
        session_id=client.session_id, doorbell_buffer_id=doorbell.id,
        layers=list(layers), max_tokens=max_tokens, max_seqs=max_seqs,
        max_top_k=max_top_k, max_blocks_per_seq=max_blocks_per_seq,
        name=name)
    if swa_index is not None:
        req.swa_index.CopyFrom(swa_index)
    r = client._call("RegisterWorker", req, _stub(client))
    return Registration(registration_id=r.registration_id,
                        doorbell_bytes=r.doorbell_bytes,
                        num_phases=r.num_phases, num_layers=len(layers),
                        doorbell=doorbell)


def step(client: Any, registration_id: int, *, step_id: int,
         slot_mapping: Any, seq_lens: Any, query_lens: Any,
         compressed_slot_mapping: Any = None, swa_state_ids: Any = None,
         swa_valid_starts: Any = None, block_tables: Any = None,
         top_k: int = 0, deadline_ms: int = 0) -> "spb.StepResponse":
    """One Step request (the scheduler's side): step_id is the previous
    one + 1 (the first is 1). Arrays are int32 (lists, NumPy, array('i'),
    bytes); block_tables is [num_seqs][cols]. Replies at once."""
    slots, num_tokens, _ = pack_int32(slot_mapping, "slot_mapping")
    lens, num_seqs, _ = pack_int32(seq_lens, "seq_lens")
    req = spb.StepRequest(
        session_id=client.session_id, registration_id=registration_id,
        step_id=step_id, slot_mapping=slots, num_tokens=num_tokens,
        num_seqs=num_seqs, seq_lens=lens,
        query_lens=pack_int32(query_lens, "query_lens")[0], top_k=top_k,
        deadline_ms=deadline_ms)
    if compressed_slot_mapping is not None:
        req.compressed_slot_mapping = pack_int32(
            compressed_slot_mapping, "compressed_slot_mapping")[0]
    if swa_state_ids is not None:
        req.swa_state_ids = pack_int32(swa_state_ids, "swa_state_ids")[0]
    if swa_valid_starts is not None:
        req.swa_valid_starts = pack_int32(swa_valid_starts,
                                          "swa_valid_starts")[0]
    if block_tables is not None:
        table, _, cols = pack_int32_2d(block_tables, "block_tables",
                                       rows=num_seqs)
        req.block_tables, req.block_table_cols = table, cols
    return client._call("Step", req, _stub(client))


def step_status(client: Any, registration_id: int) -> Any:
    """StepStatus: the registration's RegistrationInfo."""
    return client._call("StepStatus", spb.StepStatusRequest(
        session_id=client.session_id, registration_id=registration_id),
        _stub(client)).registration


def unregister(client: Any, registration_id: int) -> None:
    client._call("Unregister", spb.UnregisterRequest(
        session_id=client.session_id, registration_id=registration_id),
        _stub(client))


def grant_registration(client: Any, registration_id: int, *,
                       uids: Sequence[int] = (),
                       sessions: Sequence[int] = ()) -> None:
    """Lets uids or sessions (by session_number) send steps."""
    client._call("GrantRegistration", spb.GrantRegistrationRequest(
        session_id=client.session_id, registration_id=registration_id,
        uids=list(uids), sessions=list(sessions)), _stub(client))


def list_registrations(client: Any) -> list:
    return list(client._call("ListRegistrations",
                             spb.ListRegistrationsRequest(
                                 session_id=client.session_id),
                             _stub(client)).registrations)
