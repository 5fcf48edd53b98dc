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
    # Block tables in device memory (register_worker(block_tables=
    # buffer_ref(tables, 0, row_stride))): each step names the columns.
    step(kv, reg.registration_id, step_id=2, ..., top_k=64,
         block_tables_in_buffer=True, block_table_cols=cols)
    # Slot mappings too (register_worker(slot_mappings=buffer_ref(...))):
    # each step names its tokens.
    step(kv, reg.registration_id, step_id=3, seq_lens=[...],
         query_lens=[...], slot_mappings_in_buffer=True, num_tokens=n)
    f = step_async(kv, reg.registration_id, step_id=2, ...)  # no wait
    ...; f.result()   # before the next step is sent
    with StepStream(kv) as s:   # one call for every step: cheaper
        s.send(reg.registration_id, step_id=3, slot_mapping=[...], ...)
    with StepRing(kv) as r:     # shared memory, no gRPC call per step
        r.send(reg.registration_id, step_id=4, slot_mapping=[...], ...)
    # Library mode on the daemon's metadata: the worker launches the
    # kernels itself (docs/LIBRARY_MODE.md).
    p = plan_step(kv, reg.registration_id, slot_mapping=[...], ...)
"""

import os
import queue
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import grpc

from kvdepot.v1 import kvdepot_pb2 as pb
from kvdepot.v1 import step_pb2 as spb
from kvdepot.v1 import step_pb2_grpc as spb_grpc

from . import _step_ring as _ring
from ._arrays import pack_int32, pack_int32_2d
from ._buffers import Buffer
from ._errors import ClientClosed, KVCacheError, invalid_argument


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


# StepFused.rope_style (kvdepot.proto RopeStyle).
_ROPE_STYLES = {"none": 0, "neox": 1, "interleaved": 2}


def _bytes_of(value: Any, field: str, unit: int) -> bytes:
    """bytes-like (or an object with tobytes(), e.g. a NumPy array) whose
    size is a multiple of `unit`."""
    if hasattr(value, "tobytes") and not isinstance(
            value, (bytes, bytearray, memoryview)):
        value = value.tobytes()
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise invalid_argument(
            f"{field}: expected bytes-like, got {type(value).__name__}")
    out = bytes(value)
    if len(out) % unit:
        raise invalid_argument(
            f"{field}: {len(out)} bytes is not a multiple of {unit}")
    return out


def step_fused(*, norm_begin: int = 0, norm_end: int = 0,
               norm_weight: Any = b"", eps: float = 1e-6,
               rope: str = "none", rope_offset: int = 0, rope_dim: int = 0,
               cos_sin: Any = b"", hadamard_begin: int = 0,
               hadamard_len: int = 0) -> "spb.StepFused":
    """Fused-store parameters of one cache, registered once (SPEC §8,
    step.proto StepFused): RMSNorm over [norm_begin, norm_end) with
    norm_weight (BF16 bit patterns, 2 bytes each, [norm_end - norm_begin]),
    eps; RoPE ("none", "neox" or "interleaved") on [rope_offset, rope_offset
    + rope_dim) from cos_sin (fp32 [max_position][rope_dim], cos | sin;
    bytes-like or a NumPy array); a Hadamard on [hadamard_begin, +
    hadamard_len) (0 = off). Every Step of a registration with a RoPE cache
    then carries `positions`. The daemon checks the rest (INVALID_ARGUMENT
    naming layers[i].CACHE.fused.FIELD)."""
    if rope not in _ROPE_STYLES:
        raise invalid_argument(
            f"fused.rope: \"{rope}\" is not one of "
            + ", ".join(f'"{k}"' for k in _ROPE_STYLES))
    return spb.StepFused(
        norm_begin=norm_begin, norm_end=norm_end,
        norm_weight=_bytes_of(norm_weight, "fused.norm_weight", 2),
        eps=eps, rope_style=_ROPE_STYLES[rope], rope_offset=rope_offset,
        rope_dim=rope_dim, cos_sin=_bytes_of(cos_sin, "fused.cos_sin", 4),
        hadamard_begin=hadamard_begin, hadamard_len=hadamard_len)


def cache(pool: str, pool_layer: int, buffer: Any, *, offset: int = 0,
          row_stride: int,
          fused: Optional["spb.StepFused"] = None) -> "spb.StepCache":
    """One cache of a layer: the pool layer and the worker's BF16 input rows
    ([tokens][elements], `row_stride` bytes apart) it is stored from; with
    `fused` (step_fused()) phase A stores it with the fused kernel (the rows
    are then the raw projection: the daemon normalizes, rotates and
    quantizes)."""
    out = spb.StepCache(pool=pool, layer=pool_layer,
                        input=buffer_ref(buffer, offset, row_stride))
    if fused is not None:
        out.fused.CopyFrom(fused)
    return out


def layer(*, main: Optional["spb.StepCache"] = None,
          swa: Optional["spb.StepCache"] = None,
          index: Optional["spb.StepCache"] = None, ratio: int = 1,
          window: int = 0, topk: Optional["spb.StepBufferRef"] = None,
          index_out: Optional["spb.StepBufferRef"] = None
          ) -> "spb.StepLayer":
    """One layer's configuration (step.proto StepLayer). ratio > 1: its
    main and index caches hold compressed rows, stored from each step's
    compressed slot mapping of that ratio (layers may differ: at most 8
    distinct ratios > 1 per registration, one mapping each per step)."""
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
                    name: str = "",
                    block_tables: Optional["spb.StepBufferRef"] = None,
                    slot_mappings: Optional["spb.StepBufferRef"] = None
                    ) -> Registration:
    """RegisterWorker: `doorbell` a buffer of this client's session of at
    least doorbell_bytes(len(layers)) bytes (on the CUDA backend a VMM
    export; the daemon zeroes it). The CPU backend has no step path
    (FAILED_PRECONDITION).

    block_tables (buffer_ref(buffer, offset, row_stride)): the worker's
    block tables in device memory, int32, row r (sequence r of a step) at
    offset + r * row_stride bytes (row_stride >= 4 * max_blocks_per_seq, 0
    = that; offset and row_stride multiples of 4), max_seqs rows inside the
    buffer; needs a layer with top-k. Steps sent with
    block_tables_in_buffer=True read rows [0, num_seqs) of it. The worker
    writes step s's tables on its stream before mark(phase_b(0)) and
    leaves them until it has waited for phase_b(layers - 1) of step s
    (docs/STEP_PATH.md).

    slot_mappings (buffer_ref(buffer, offset, row_stride)): the step's slot
    mappings in device memory, int32 rows of max_tokens entries (row_stride
    >= 4 * max_tokens, 0 = that): row 0 the main mapping, row 1 + k the
    compressed mapping of the k-th ratio > 1 of the layers, ascending.
    Steps sent with slot_mappings_in_buffer=True (and num_tokens) read
    entries [0, num_tokens) of every row; the worker writes them on its
    stream before mark(phase_a(0)) and leaves them until it has waited for
    phase_a(0). Entries outside the pools become -1 and are counted
    (StepWorker.status().out_of_range); duplicates are not checked."""
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
    if block_tables is not None:
        if not isinstance(block_tables, spb.StepBufferRef):
            raise invalid_argument(
                "block_tables: pass buffer_ref(buffer, offset, row_stride)")
        req.block_tables.CopyFrom(block_tables)
    if slot_mappings is not None:
        if not isinstance(slot_mappings, spb.StepBufferRef):
            raise invalid_argument(
                "slot_mappings: pass buffer_ref(buffer, offset, row_stride)")
        req.slot_mappings.CopyFrom(slot_mappings)
    r = client._call("RegisterWorker", req, _stub(client))
    return Registration(registration_id=r.registration_id,
                        doorbell_bytes=r.doorbell_bytes,
                        num_phases=r.num_phases, num_layers=len(layers),
                        doorbell=doorbell)


def _main_slots(slot_mapping: Any, in_buffer: bool, num_tokens: int,
                compressed: Any, compressed_by_ratio: Any) -> tuple:
    """(slot_mapping's bytes, num_tokens): packed from slot_mapping, or
    with in_buffer (the registration's slot-mapping buffer holds every
    mapping) empty bytes and num_tokens as given."""
    if not in_buffer:
        if slot_mapping is None:
            raise invalid_argument(
                "slot_mapping: needed unless slot_mappings_in_buffer=True")
        slots, count, _ = pack_int32(slot_mapping, "slot_mapping")
        if num_tokens not in (0, count):
            raise invalid_argument(
                f"num_tokens = {num_tokens}: slot_mapping has {count} "
                "entries (num_tokens is for slot_mappings_in_buffer=True)")
        return slots, count
    for name, value in (("slot_mapping", slot_mapping),
                        ("compressed_slot_mapping", compressed),
                        ("compressed_slot_mappings", compressed_by_ratio)):
        if value is not None:
            raise invalid_argument(
                f"{name}: pass it or slot_mappings_in_buffer=True (the "
                "mappings are the registered buffer's rows), not both")
    if num_tokens < 1:
        raise invalid_argument(
            f"num_tokens = {num_tokens}: with slot_mappings_in_buffer the "
            "step names its tokens (>= 1)")
    return b"", num_tokens


def step_request(client: Any, registration_id: int, *, step_id: int,
                 seq_lens: Any, query_lens: Any, slot_mapping: Any = None,
                 compressed_slot_mapping: Any = None,
                 compressed_slot_mappings: Optional[Mapping[int, Any]] = None,
                 swa_state_ids: Any = None, swa_valid_starts: Any = None,
                 block_tables: Any = None, top_k: int = 0,
                 deadline_ms: int = 0,
                 positions: Any = None,
                 block_tables_in_buffer: bool = False,
                 block_table_cols: int = 0,
                 slot_mappings_in_buffer: bool = False,
                 num_tokens: int = 0) -> "spb.StepRequest":
    """The StepRequest step() and step_async() send (arguments as
    step()'s), checked and packed; nothing is sent."""
    slots, num_tokens = _main_slots(slot_mapping, slot_mappings_in_buffer,
                                    num_tokens, compressed_slot_mapping,
                                    compressed_slot_mappings)
    lens, num_seqs, _ = pack_int32(seq_lens, "seq_lens")
    req = spb.StepRequest(
        session_id=client.session_id, registration_id=registration_id,
        step_id=step_id, slot_mapping=slots, num_tokens=num_tokens,
        slot_mappings_in_buffer=slot_mappings_in_buffer,
        num_seqs=num_seqs, seq_lens=lens,
        query_lens=pack_int32(query_lens, "query_lens")[0], top_k=top_k,
        deadline_ms=deadline_ms)
    if compressed_slot_mapping is not None:
        if compressed_slot_mappings is not None:
            raise invalid_argument(
                "compressed_slot_mapping: pass it or compressed_slot_mappings"
                " ({ratio: mapping}), not both")
        req.compressed_slot_mapping = pack_int32(
            compressed_slot_mapping, "compressed_slot_mapping")[0]
    if compressed_slot_mappings is not None:
        for ratio in sorted(compressed_slot_mappings):
            field = f"compressed_slot_mappings[{ratio}]"
            if not isinstance(ratio, int) or ratio < 2:
                raise invalid_argument(
                    f"{field}: the key is a layer ratio > 1 (an int)")
            data, count, _ = pack_int32(compressed_slot_mappings[ratio],
                                        field)
            if count != num_tokens:
                raise invalid_argument(
                    f"{field}: {count} entries, slot_mapping {num_tokens}")
            req.compressed.add(ratio=ratio, slot_mapping=data)
    if positions is not None:
        if isinstance(positions, (bytes, bytearray, memoryview)):
            req.positions = bytes(positions)
        else:
            values = [int(p) for p in positions]
            req.positions = struct.pack(f"<{len(values)}q", *values)
        if len(req.positions) != 8 * num_tokens:
            raise invalid_argument(
                f"positions: {len(req.positions) // 8} int64 entries, "
                f"slot_mapping {num_tokens}")
    if swa_state_ids is not None:
        req.swa_state_ids = pack_int32(swa_state_ids, "swa_state_ids")[0]
    if swa_valid_starts is not None:
        req.swa_valid_starts = pack_int32(swa_valid_starts,
                                          "swa_valid_starts")[0]
    if block_tables_in_buffer:
        if block_tables is not None:
            raise invalid_argument(
                "block_tables: pass the tables or block_tables_in_buffer="
                "True (they are the registered buffer's rows), not both")
        if block_table_cols < 1:
            raise invalid_argument(
                f"block_table_cols = {block_table_cols}: with "
                "block_tables_in_buffer the step names its columns (>= 1)")
        req.block_tables_in_buffer = True
        req.block_table_cols = block_table_cols
    elif block_table_cols:
        raise invalid_argument(
            "block_table_cols: only with block_tables_in_buffer=True (inline "
            "block_tables give their own)")
    if block_tables is not None:
        table, _, cols = pack_int32_2d(block_tables, "block_tables",
                                       rows=num_seqs)
        req.block_tables, req.block_table_cols = table, cols
    return req


def step(client: Any, registration_id: int, *, step_id: int,
         seq_lens: Any, query_lens: Any, slot_mapping: Any = None,
         compressed_slot_mapping: Any = None,
         compressed_slot_mappings: Optional[Mapping[int, Any]] = None,
         swa_state_ids: Any = None,
         swa_valid_starts: Any = None, block_tables: Any = None,
         top_k: int = 0, deadline_ms: int = 0,
         positions: Any = None, block_tables_in_buffer: bool = False,
         block_table_cols: int = 0, slot_mappings_in_buffer: bool = False,
         num_tokens: int = 0) -> "spb.StepResponse":
    """One Step request (the scheduler's side): step_id is the previous
    one + 1 (the first is 1). Arrays are int32 (lists, NumPy, array('i'),
    bytes); block_tables is [num_seqs][cols]. compressed_slot_mapping
    (main and index caches of ratio > 1, a registration with one such
    ratio): per token the slot of the compressed row it completes, -1
    where it completes none. compressed_slot_mappings ({ratio: mapping},
    e.g. {4: m4, 128: m128}): the same per ratio, one entry for each
    ratio > 1 of the registration (required with several; never with
    compressed_slot_mapping). positions:
    int64 per token (ints, or their little-endian bytes), needed when a
    cache was registered with fused RoPE. block_tables_in_buffer=True
    (with block_table_cols, no block_tables): the tables are rows [0,
    num_seqs), columns [0, block_table_cols) of the registration's
    block-table buffer, as the worker's stream writes them before
    phase_b(0); the kernel turns every entry it reads outside the index
    pool into -1 and counts it (StepWorker.status().out_of_range).
    slot_mappings_in_buffer=True (with num_tokens; no slot_mapping,
    compressed_slot_mapping or compressed_slot_mappings): every slot
    mapping is entries [0, num_tokens) of the rows of the registration's
    slot-mapping buffer, as the worker's stream writes them before
    phase_a(0) (register_worker's slot_mappings). Replies
    at once (a third step in flight: RESOURCE_EXHAUSTED, raised;
    step_async() sends it again)."""
    req = step_request(
        client, registration_id, step_id=step_id, slot_mapping=slot_mapping,
        seq_lens=seq_lens, query_lens=query_lens,
        compressed_slot_mapping=compressed_slot_mapping,
        compressed_slot_mappings=compressed_slot_mappings,
        swa_state_ids=swa_state_ids, swa_valid_starts=swa_valid_starts,
        block_tables=block_tables, top_k=top_k, deadline_ms=deadline_ms,
        positions=positions, block_tables_in_buffer=block_tables_in_buffer,
        block_table_cols=block_table_cols,
        slot_mappings_in_buffer=slot_mappings_in_buffer,
        num_tokens=num_tokens)
    return client._call("Step", req, _stub(client))


# tests/gpu/step_send_retry.h's InFlightRetry: the first backoff after a
# RESOURCE_EXHAUSTED (doubled per retry) and its cap, in seconds.
IN_FLIGHT_FIRST_BACKOFF_S = 20e-6
IN_FLIGHT_MAX_BACKOFF_S = 1e-3


class StepFuture:
    """A Step sent without waiting for its reply (step_async). The daemon
    enqueues the step's phases as soon as it accepts it, whether or not
    result() was called; result() waits for the reply and raises its error
    as step() would. A RESOURCE_EXHAUSTED reply (two steps of the
    registration in flight: the daemon's completion report of an earlier
    step can come after the worker's stream finished it,
    docs/STEP_PATH.md) is sent again, the same request, with a short
    backoff (20 us doubling to 1 ms) for up to in_flight_retry_s from the
    first refusal, inside result(); `retries` counts those sends."""

    def __init__(self, client: Any, request: "spb.StepRequest",
                 in_flight_retry_s: float = 10.0):
        self._client = client
        self.request = request
        self.in_flight_retry_s = in_flight_retry_s
        self.retries = 0
        self._reply: Optional["spb.StepResponse"] = None
        self._error: Optional[KVCacheError] = None
        self._future, self._session = client._call_future(
            "Step", request, _stub(client))

    @property
    def step_id(self) -> int:
        return int(self.request.step_id)

    def done(self) -> bool:
        """True once result() would not wait (it may still send again
        after a refusal)."""
        return (self._reply is not None or self._error is not None
                or self._future.done())

    def result(self) -> "spb.StepResponse":
        """The StepResponse; KVCacheError as step() raises it (also on a
        later call)."""
        if self._reply is not None:
            return self._reply
        if self._error is not None:
            raise self._error
        try:
            self._reply = self._wait()
        except KVCacheError as e:
            self._error = e
            raise
        return self._reply

    def _wait(self) -> "spb.StepResponse":
        give_up: Optional[float] = None
        backoff = IN_FLIGHT_FIRST_BACKOFF_S
        while True:
            try:
                return self._client._future_result(self._future,
                                                   self._session)
            except KVCacheError as e:
                if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                now = time.monotonic()
                if give_up is None:
                    give_up = now + self.in_flight_retry_s
                if now >= give_up:
                    raise KVCacheError(
                        e.code, f"{e.message} (still refused after "
                        f"{self.retries} retries over "
                        f"{self.in_flight_retry_s:g} s)") from None
                time.sleep(min(backoff, give_up - now))
            backoff = min(2 * backoff, IN_FLIGHT_MAX_BACKOFF_S)
            self.retries += 1
            self._future, self._session = self._client._call_future(
                "Step", self.request, _stub(self._client))


def step_async(client: Any, registration_id: int, *, step_id: int,
               seq_lens: Any, query_lens: Any, slot_mapping: Any = None,
               compressed_slot_mapping: Any = None,
               compressed_slot_mappings: Optional[Mapping[int, Any]] = None,
               swa_state_ids: Any = None, swa_valid_starts: Any = None,
               block_tables: Any = None, top_k: int = 0,
               deadline_ms: int = 0, positions: Any = None,
               block_tables_in_buffer: bool = False,
               block_table_cols: int = 0,
               slot_mappings_in_buffer: bool = False, num_tokens: int = 0,
               in_flight_retry_s: float = 10.0) -> StepFuture:
    """step() without waiting for the reply: checks and packs the request
    (errors in the arguments raise here), sends it and returns a
    StepFuture at once. What an engine's scheduler does to send step s + 1
    while the GPU runs step s (the worker's stream and the daemon's
    phases meet at the doorbell whichever comes first). Call result()
    before sending the next step: it raises the step's error, and sends
    it again while the daemon answers RESOURCE_EXHAUSTED (up to
    in_flight_retry_s; 0 = raise at once)."""
    req = step_request(
        client, registration_id, step_id=step_id, slot_mapping=slot_mapping,
        seq_lens=seq_lens, query_lens=query_lens,
        compressed_slot_mapping=compressed_slot_mapping,
        compressed_slot_mappings=compressed_slot_mappings,
        swa_state_ids=swa_state_ids, swa_valid_starts=swa_valid_starts,
        block_tables=block_tables, top_k=top_k, deadline_ms=deadline_ms,
        positions=positions, block_tables_in_buffer=block_tables_in_buffer,
        block_table_cols=block_table_cols,
        slot_mappings_in_buffer=slot_mappings_in_buffer,
        num_tokens=num_tokens)
    return StepFuture(client, req, in_flight_retry_s)


class PlannedStep:
    """Step.PlanStep's reply (library mode on daemon-built metadata,
    docs/LIBRARY_MODE.md): `metadata` is the step's int32 little-endian
    metadata to upload with one copy; every offset (reply fields, and
    the helpers below) counts int32 elements from its start, -1 = absent.
    With torch: meta = torch.frombuffer(bytearray(p.metadata),
    dtype=torch.int32).cuda(); a section's pointer is meta.data_ptr() +
    4 * offset, what the kvdk_*_cuda entry points take."""

    def __init__(self, reply: "spb.PlanStepResponse"):
        self.reply = reply
        self.metadata: bytes = reply.metadata
        self.num_tokens: int = reply.num_tokens

    def slots(self, ratio: int = 1) -> int:
        """The offset of the slots the main and index caches of `ratio`
        are stored from (ratio 1: the request's slot_mapping); -1 when the
        mappings are the worker's own (slot_mappings_in_buffer)."""
        if ratio == 1:
            return int(self.reply.slots)
        for c in self.reply.compressed:
            if c.ratio == ratio:
                return int(c.slots)
        raise invalid_argument(f"ratio {ratio}: not a ratio of this "
                               "registration's main or index caches")

    def topk_inputs(self, ratio: int = 1) -> "tuple[int, int]":
        """(valid_count, num_tokens) offsets of convert_topk's per-row
        inputs for the phase-B layers of `ratio`."""
        for t in self.reply.topk_inputs:
            if t.ratio == ratio:
                return int(t.valid_count), int(t.num_tokens)
        raise invalid_argument(f"ratio {ratio}: no layer of that ratio "
                               "has phase B (topk)")

    def array(self, offset: int, count: int) -> list:
        """The int32 values of a section, on the host (tests, logs)."""
        if offset < 0 or count < 0 or 4 * (offset + count) > len(
                self.metadata):
            raise invalid_argument(
                f"section [{offset}, {offset + count}) is outside the "
                f"metadata's {len(self.metadata) // 4} int32")
        return list(struct.unpack_from(f"<{count}i", self.metadata,
                                       4 * offset))


def plan_step(client: Any, registration_id: int, *, seq_lens: Any,
              query_lens: Any, slot_mapping: Any = None,
              compressed_slot_mapping: Any = None,
              compressed_slot_mappings: Optional[Mapping[int, Any]] = None,
              swa_state_ids: Any = None, swa_valid_starts: Any = None,
              block_tables: Any = None, top_k: int = 0,
              positions: Any = None, block_tables_in_buffer: bool = False,
              block_table_cols: int = 0, slot_mappings_in_buffer: bool = False,
              num_tokens: int = 0) -> PlannedStep:
    """Step.PlanStep: the same arguments as step() (no step id) checked by
    the daemon against the registration as a Step is; returns the step's
    metadata for a worker that launches kvdepot's kernels itself
    (PlannedStep). Nothing is enqueued and no step id is consumed. With
    slot_mappings_in_buffer / block_tables_in_buffer the worker passes its
    own device arrays (the reply's slots / row_block_tables are -1; tables
    in the buffer need one query token per sequence)."""
    req = step_request(
        client, registration_id, step_id=0, slot_mapping=slot_mapping,
        seq_lens=seq_lens, query_lens=query_lens,
        compressed_slot_mapping=compressed_slot_mapping,
        compressed_slot_mappings=compressed_slot_mappings,
        swa_state_ids=swa_state_ids, swa_valid_starts=swa_valid_starts,
        block_tables=block_tables, top_k=top_k, positions=positions,
        block_tables_in_buffer=block_tables_in_buffer,
        block_table_cols=block_table_cols,
        slot_mappings_in_buffer=slot_mappings_in_buffer,
        num_tokens=num_tokens)
    return PlannedStep(client._call("PlanStep", req, _stub(client)))


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


_CODES = {c.value[0]: c for c in grpc.StatusCode}
_END = object()   # ends a StepStream's request iterator


class _Stepper:
    """step()'s loop, shared by StepStream and StepRing: _round_trip(request)
    returns the daemon's StepResponse for one send; a refusal raises as
    KVCacheError (with .field), RESOURCE_EXHAUSTED (two steps in flight)
    is sent again with step_async()'s backoff for up to in_flight_retry_s,
    and UNAUTHENTICATED for the client's own session marks the client
    lost."""

    _client: Any
    _session: str
    _lock: threading.Lock
    in_flight_retry_s: float
    retries: int

    def _round_trip(self, request: "spb.StepRequest") -> "spb.StepResponse":
        raise NotImplementedError

    def step(self, request: "spb.StepRequest") -> "spb.StepResponse":
        """Sends `request`, returns its StepResponse (accepted), or raises
        the refusal as KVCacheError."""
        with self._lock:
            return self._settle(request, self._round_trip(request))

    def _settle(self, request: "spb.StepRequest",
                reply: "spb.StepResponse") -> "spb.StepResponse":
        """`reply` if accepted; else the refusal raised, or the request
        sent again while it is refused for depth. REQUIRES: _lock held."""
        give_up: Optional[float] = None
        backoff = IN_FLIGHT_FIRST_BACKOFF_S
        while True:
            if reply.error_code == 0:
                return reply
            code = _CODES.get(reply.error_code, grpc.StatusCode.UNKNOWN)
            error = KVCacheError(code, reply.error_message,
                                 reply.error_field)
            if code == grpc.StatusCode.UNAUTHENTICATED and \
                    self._session and \
                    self._session == self._client.session_id:
                raise self._client._lose(
                    "the daemon no longer knows the session "
                    f"({reply.error_message})")
            if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise error
            now = time.monotonic()
            if give_up is None:
                give_up = now + self.in_flight_retry_s
            if now >= give_up:
                raise KVCacheError(
                    code, f"{reply.error_message} (still refused after "
                    f"{self.retries} retries over "
                    f"{self.in_flight_retry_s:g} s)") from None
            time.sleep(min(backoff, give_up - now))
            backoff = min(2 * backoff, IN_FLIGHT_MAX_BACKOFF_S)
            self.retries += 1
            reply = self._round_trip(request)


class StepStream(_Stepper):
    """The scheduler's steps on one StepStream call (docs/STEP_PATH.md,
    "StepStream"): step(request) sends one StepRequest (step_request()'s)
    and waits for its reply; send() builds it from step()'s arguments.
    Cheaper than a unary call per step (no per-call setup). Errors raise
    KVCacheError as step() raises them (with .field, the field the daemon
    named), and the stream stays open for the next step: a refusal is
    that message's reply. RESOURCE_EXHAUSTED (two steps of the
    registration in flight) is sent again on the same stream, with
    step_async()'s backoff, for up to in_flight_retry_s (0 = raise at
    once); `retries` counts those sends.

    The stream is bound to the client's session (its kvdepot-session-id
    metadata): a request naming another session is refused
    (PERMISSION_DENIED). The daemon caps open streams per session and in
    all (--max_step_streams_per_session, --max_step_streams): beyond them
    the first step() raises RESOURCE_EXHAUSTED and the stream is closed.
    close() (or the with block's end) ends the call and gives its slot
    back. One thread at a time."""

    def __init__(self, client: Any, in_flight_retry_s: float = 10.0):
        client._check()
        self._client = client
        self._session = client.session_id
        self.in_flight_retry_s = in_flight_retry_s
        self.retries = 0
        self._requests: "queue.Queue[Any]" = queue.Queue()
        self._closed = False
        self._lock = threading.Lock()
        self._call = _stub(client).StepStream(
            iter(self._requests.get, _END), metadata=client._metadata)

    def __enter__(self) -> "StepStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Ends the call (idempotent); later step()s raise ClientClosed."""
        if self._closed:
            return
        self._closed = True
        self._requests.put(_END)
        self._call.cancel()

    def send(self, registration_id: int, **step_args: Any
             ) -> "spb.StepResponse":
        """step(step_request(client, registration_id, **step_args))."""
        return self.step(step_request(self._client, registration_id,
                                      **step_args))

    def _round_trip(self, request: "spb.StepRequest") -> "spb.StepResponse":
        if self._closed:
            raise ClientClosed("the step stream is closed (close() was "
                               "called, or the call ended)")
        self._client._check()
        self._requests.put(request)
        try:
            return next(self._call)
        except grpc.RpcError as e:
            self.close()
            raise self._client._rpc_error(e, self._session) from None
        except StopIteration:
            self.close()
            raise KVCacheError(grpc.StatusCode.UNAVAILABLE,
                               "the step stream ended") from None


class StepRing(_Stepper):
    """The scheduler's steps through a step ring (docs/STEP_PATH.md, "Step
    ring"): shared memory with the daemon instead of a gRPC call per step,
    for a scheduler on the daemon's host. Opened on the client's companion
    connection (a Unix-socket session); its requests run as that session,
    and refusals raise exactly as on a StepStream (step(), send(),
    in_flight_retry_s, retries). submit() and collect() are the two halves
    of a step for a scheduler that keeps up to `slots` requests
    outstanding; step() needs none outstanding.

    `slots` (a power of two up to 64) and `request_bytes` per slot (a
    multiple of 64 in [4096, 16 MiB]; 0 = 1 MiB) size the ring; a request
    that does not fit raises INVALID_ARGUMENT. collect() waits at most
    timeout_s (DEADLINE_EXCEEDED). A ring the daemon closed (the drain,
    the session's end) raises UNAVAILABLE with its closing message; one
    this side broke, FAILED_PRECONDITION. close() (or the with block's
    end) closes the daemon's side and gives its slot in the stream limits
    back. One thread at a time."""

    def __init__(self, client: Any, slots: int = 4, request_bytes: int = 0,
                 in_flight_retry_s: float = 10.0, timeout_s: float = 10.0):
        client._check()
        self._client = client
        self._session = client.session_id
        self.in_flight_retry_s = in_flight_retry_s
        self.timeout_s = timeout_s
        self.retries = 0
        self._lock = threading.Lock()
        reply, fd = client._companion_call(
            "a step ring", pb.CompanionRequest(
                open_step_ring=pb.OpenStepRingRequest(
                    slots=slots, request_bytes=request_bytes)))
        info = reply.step_ring
        self.ring_id = info.ring_id
        self._remote_open = True   # the daemon's side, until close()
        self._mem: Optional[_ring.RingMemory] = None
        try:
            if fd is None or reply.fd_size != _ring.ring_bytes(
                    info.slots, info.request_bytes):
                raise KVCacheError(grpc.StatusCode.INTERNAL,
                                   "the daemon's open_step_ring reply does "
                                   "not describe a ring")
            self._mem = _ring.RingMemory(fd, reply.fd_size, info.slots,
                                         info.request_bytes)
            if self._mem.header() != (_ring.MAGIC, _ring.VERSION, info.slots,
                                      info.request_bytes, _ring.REPLY_BYTES):
                raise KVCacheError(grpc.StatusCode.INTERNAL,
                                   "the step ring's header does not match "
                                   "the daemon's reply")
        except BaseException:
            self.close()
            raise
        finally:
            if fd is not None:
                os.close(fd)
        self.slots = info.slots
        self.request_capacity = info.request_bytes - _ring.SLOT_HEADER_BYTES
        self._submitted = self._mem.load(_ring.SUBMITTED)
        self._collected = self._mem.load(_ring.DONE)

    def __enter__(self) -> "StepRing":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def uncollected(self) -> int:
        return (self._submitted - self._collected) & 0xFFFFFFFF

    def close(self) -> None:
        """Closes the daemon's side and unmaps (idempotent); later calls
        raise ClientClosed."""
        mem, self._mem = self._mem, None
        if mem is not None:
            mem.close()
        if not self._remote_open:
            return
        self._remote_open = False
        try:
            self._client._companion_call(
                "close_step_ring", pb.CompanionRequest(
                    close_step_ring=pb.CloseStepRingRequest(
                        ring_id=self.ring_id)))
        except (KVCacheError, ClientClosed):
            pass   # the ring ends with the session anyway

    def _memory(self) -> "_ring.RingMemory":
        if self._mem is None:
            raise ClientClosed("the step ring is closed (close() was "
                               "called)")
        return self._mem

    def _closed_error(self, mem: "_ring.RingMemory") -> Optional[Exception]:
        state = mem.load(_ring.STATE)
        if state == _ring.OPEN:
            return None
        code = (grpc.StatusCode.FAILED_PRECONDITION
                if state == _ring.FAILED else grpc.StatusCode.UNAVAILABLE)
        return KVCacheError(code, f"step ring {self.ring_id}: "
                                  f"{mem.message()}")

    def submit(self, request: "spb.StepRequest") -> int:
        """Publishes `request` (no wait); returns its number."""
        mem = self._memory()
        error = self._closed_error(mem)
        if error is not None:
            raise error
        if self.uncollected >= self.slots:
            raise KVCacheError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"step ring {self.ring_id}: {self.slots} "
                               "requests are uncollected, all its slots; "
                               "collect() a reply first")
        data = request.SerializeToString()
        if len(data) > self.request_capacity:
            raise invalid_argument(
                f"request: {len(data)} bytes serialized, more "
                f"than the step ring's {self.request_capacity}-byte slots; "
                "open a ring with a larger request_bytes")
        at = mem.request_slot(self._submitted)
        mem.mm[at + _ring.SLOT_HEADER_BYTES:
               at + _ring.SLOT_HEADER_BYTES + len(data)] = data
        struct.pack_into("<I", mem.mm, at, len(data))
        n = self._submitted
        self._submitted = (n + 1) & 0xFFFFFFFF
        mem.store(_ring.SUBMITTED, self._submitted)
        mem.wake(_ring.SUBMITTED)
        return n

    def collect(self, timeout_s: Optional[float] = None
                ) -> "spb.StepResponse":
        """The oldest uncollected reply, waiting at most timeout_s
        (default: the ring's timeout_s)."""
        mem = self._memory()
        if self.uncollected == 0:
            raise KVCacheError(grpc.StatusCode.FAILED_PRECONDITION,
                               "step ring: nothing submitted is "
                               "uncollected")
        wait = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait
        while True:
            done = mem.load(_ring.DONE)
            ready = (done - self._collected) & 0xFFFFFFFF
            if 1 <= ready <= self.uncollected:
                break
            error = self._closed_error(mem)
            if error is not None:
                raise error
            left = deadline - time.monotonic()
            if left <= 0:
                raise KVCacheError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"step ring {self.ring_id}: no reply to request "
                    f"{self._collected} within {wait:g} s")
            mem.store(_ring.CLIENT_SLEEPING, 1)
            if mem.load(_ring.DONE) == done:
                mem.wait(_ring.DONE, done, min(left, 0.1))
            mem.store(_ring.CLIENT_SLEEPING, 0)
        at = mem.reply_slot(self._collected)
        (length,) = struct.unpack_from("<I", mem.mm, at)
        reply = spb.StepResponse()
        if length > _ring.REPLY_BYTES - _ring.SLOT_HEADER_BYTES:
            raise KVCacheError(grpc.StatusCode.INTERNAL,
                               f"step ring {self.ring_id}: reply "
                               f"{self._collected} is not readable")
        reply.ParseFromString(bytes(
            mem.mm[at + _ring.SLOT_HEADER_BYTES:
                   at + _ring.SLOT_HEADER_BYTES + length]))
        self._collected = (self._collected + 1) & 0xFFFFFFFF
        return reply

    def send(self, registration_id: int, **step_args: Any
             ) -> "spb.StepResponse":
        """step(step_request(client, registration_id, **step_args))."""
        return self.step(step_request(self._client, registration_id,
                                      **step_args))

    def step_async(self, request: "spb.StepRequest") -> "RingStepFuture":
        """Publishes `request` and returns at once, as step_async() does
        for a unary call: the daemon enqueues the step as soon as its ring
        thread reads it. Call the future's result() before the next
        step_async() or step()."""
        with self._lock:
            self._submit_alone(request, "step_async()")
            return RingStepFuture(self, request)

    def _round_trip(self, request: "spb.StepRequest") -> "spb.StepResponse":
        self._submit_alone(request, "step()")
        return self.collect()

    def _submit_alone(self, request: "spb.StepRequest", what: str) -> None:
        """Submits `request` when no earlier reply is left to collect (the
        replies of step() and step_async() come back one at a time)."""
        self._client._check()
        if self.uncollected:
            raise KVCacheError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"step ring: {what} needs every earlier "
                               "reply collected")
        self.submit(request)


class RingStepFuture:
    """A Step published on a StepRing without waiting (StepRing.step_async):
    result() collects its reply and settles it as StepRing.step() does
    (the refusal raised; RESOURCE_EXHAUSTED sent again on the ring with
    step_async()'s backoff, counted in `retries`)."""

    def __init__(self, ring: StepRing, request: "spb.StepRequest"):
        self._ring = ring
        self.request = request
        self.retries = 0
        self._reply: Optional["spb.StepResponse"] = None
        self._error: Optional[KVCacheError] = None

    @property
    def step_id(self) -> int:
        return int(self.request.step_id)

    def done(self) -> bool:
        """True once result() has run (a ring reply is read, not pushed)."""
        return self._reply is not None or self._error is not None

    def result(self) -> "spb.StepResponse":
        """The StepResponse; KVCacheError as StepRing.step() raises it
        (also on a later call)."""
        if self._reply is not None:
            return self._reply
        if self._error is not None:
            raise self._error
        ring = self._ring
        with ring._lock:
            before = ring.retries
            try:
                self._reply = ring._settle(self.request, ring.collect())
                return self._reply
            except KVCacheError as e:
                self._error = e
                raise
            finally:
                self.retries = ring.retries - before
