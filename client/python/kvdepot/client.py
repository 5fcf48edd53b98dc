"""The Python client of kvdepot: a typed wrapper over the gRPC stubs.

    with kvdepot.connect() as kv:          # default socket, session
        kv.create_or_get_pool("main", "V41", block_size=64, num_blocks=1024,
                              num_layers=1)
        n = kv.store("main", 0, slot_mapping=range(256), kv=bf16_bytes)
        r = kv.load("main", 0, seqlen_k=[256], block_table=[[0, 1, 2, 3]])

Every method raises KVCacheError (gRPC code + the daemon's message) on
failure; ClientClosed after close(), SessionLost once the session ended under
the client (a daemon restart) until reconnect(). Pool, stats and buffer-info replies are the proto messages
(kvdepot.v1.PoolInfo ...); the cache operations return small dataclasses
whose int32 arrays are array.array('i') (numpy.asarray() views them).
"""

import logging
import struct
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple, Union

import grpc

from kvdepot.v1 import kvdepot_pb2 as pb
from kvdepot.v1 import kvdepot_pb2_grpc as pb_grpc

from ._address import resolve_target
from ._companion import Companion, check_socket_directory, companion_path
from ._arrays import (data_bytes, infer_dtype, pack_int32, pack_int32_2d,
                      unpack_int32)
from ._buffers import INLINE, Buffer, PoolMapping, SessionToken, Slice
from ._errors import (ClientClosed, KVCacheError, SessionLost,
                      from_rpc_error, invalid_argument)

_log = logging.getLogger("kvdepot")
# The channel redials a restarted daemon by itself, waiting 0.1 s after the
# first failure and at most 2 s between attempts (gRPC's default is 1 s and
# 120 s). The session does not come back: see SessionLost.
_RECONNECT_BACKOFF_MS = (100, 2000)
_DTYPES = {"bf16": pb.INPUT_DTYPE_BF16, "fp32": pb.INPUT_DTYPE_FP32}


@dataclass
class LoadResult:
    total_k: int
    data: Optional[bytes]      # inline rows: total_k * load_data_row_bytes
    scales: Optional[bytes]    # inline scale rows of index formats
    cu_rows: Any               # int32[num_seqs + 1] (sequence plans) or None
    recorded_event: bytes = b""  # with record_event: the daemon's event


class StoreResult(int):
    """Store's result: the tokens written (an int, as before), and with
    record_event the 64 bytes of the daemon's cudaIpcEventHandle_t that
    fires once the store is done (`recorded_event`, else b"")."""

    recorded_event: bytes

    def __new__(cls, tokens_written: int,
                recorded_event: bytes = b"") -> "StoreResult":
        r = super().__new__(cls, tokens_written)
        r.recorded_event = recorded_event
        return r


@dataclass
class Plan:
    num_segments: int
    segments: Any              # int32[num_segments * 4], rows {src_block_id,
                               # src_begin, src_end, dst_offset}
    total_k: int
    cu_rows: Any               # int32[num_seqs + 1]


@dataclass
class PrefillLoadResult:
    total_k_swa: int
    chunk_offset: int
    main_kv_offset: int
    total_rows: int
    cu_compressed: Any         # int32[num_seqs + 1], relative to main_kv_offset
    output: Optional[bytes]    # inline output: total_rows BF16 rows
    swa_segments: int
    main_segments: int
    recorded_event: bytes = b""  # with record_event: the daemon's event


@dataclass
class IndexResult:
    slots: Any                 # int32[rows * cols], -1 = none; None with
                               # out=Buffer.slice() (the slots are there)
    rows: int
    cols: int
    invalid_count: int = 0     # convert_topk: entries out of range (-1:
                               # not known yet, with record_event)
    recorded_event: bytes = b""  # with record_event: the daemon's event


@dataclass
class PrefillIndexResult:
    index: Any                 # int32[sum seqlen_q * row_width], -1 = none;
                               # None with out=Buffer.slice()
    row_width: int
    main_kv_offset: int
    total_rows: int
    invalid_count: int = 0     # compressed_index (buffer) entries out of
                               # range (-1: not known yet, record_event)
    recorded_event: bytes = b""  # with record_event: the daemon's event


DataLike = Union[bytes, bytearray, memoryview, Slice, Any]


_ROPE = {"none": pb.ROPE_STYLE_NONE, "neox": pb.ROPE_STYLE_NEOX,
         "interleaved": pb.ROPE_STYLE_INTERLEAVED}


@dataclass
class FusedStore:
    """The fused store's options (SPEC §8, proto FusedStoreOptions), for
    Client.store(..., fused=...): per token RMSNorm over [norm_begin,
    norm_end) with norm_weight (BF16 bit patterns [norm_end - norm_begin],
    bytes-like or a Slice), then RoPE on [rope_offset, rope_offset +
    rope_dim) at positions (int64 [num_tokens]: ints, or their little-endian
    bytes) from cos_sin (fp32 [max_position][rope_dim], cos | sin), then
    a Hadamard on [hadamard_begin, + hadamard_len) (len 0: off).
    rope: "interleaved" (DeepSeek MLA), "neox" or "none"."""

    norm_end: int
    norm_weight: DataLike
    positions: Any
    cos_sin: DataLike
    max_position: int
    rope_dim: int
    rope_offset: int = 0
    norm_begin: int = 0
    eps: float = 1e-6
    rope: str = "interleaved"
    hadamard_begin: int = 0
    hadamard_len: int = 0

    def to_proto(self, num_tokens: int) -> "pb.FusedStoreOptions":
        if self.rope not in _ROPE:
            raise invalid_argument(
                f"fused.rope: \"{self.rope}\" is not one of "
                + ", ".join(f'"{k}"' for k in _ROPE))
        if isinstance(self.positions, (bytes, bytearray, memoryview)):
            positions = bytes(self.positions)
        else:
            values = [int(p) for p in self.positions]
            positions = struct.pack(f"<{len(values)}q", *values)
        if len(positions) != 8 * num_tokens:
            raise invalid_argument(
                f"fused.positions: {len(positions) // 8} int64 entries, "
                f"slot_mapping {num_tokens}")
        return pb.FusedStoreOptions(
            norm_begin=self.norm_begin, norm_end=self.norm_end,
            norm_weight=_data_ref(self.norm_weight, "fused.norm_weight"),
            eps=self.eps, rope=_ROPE[self.rope],
            rope_offset=self.rope_offset, rope_dim=self.rope_dim,
            positions=pb.DataRef(inline_data=positions),
            cos_sin=_data_ref(self.cos_sin, "fused.cos_sin"),
            max_position=self.max_position,
            hadamard_begin=self.hadamard_begin,
            hadamard_len=self.hadamard_len)


@dataclass(frozen=True)
class TLS:
    """TLS for a TCP address: each field a PEM file's path or its bytes.

    ca:   the root certificate(s) the daemon's certificate must chain to
          (None: the system's roots)
    cert, key: this client's certificate chain and private key, for mutual
          TLS (the daemon's --tls_client_ca); both or neither. The
          certificate's subject is the session's identity (SPEC §11).
    server_name: the name to check the daemon's certificate against when it
          differs from the address's host (gRPC's ssl_target_name_override).
    """

    ca: Union[str, bytes, None] = None
    cert: Union[str, bytes, None] = None
    key: Union[str, bytes, None] = None
    server_name: str = ""


def _pem(value: Union[str, bytes, None], field: str) -> Optional[bytes]:
    if value is None or isinstance(value, bytes):
        return value
    if not isinstance(value, str):
        raise invalid_argument(f"tls.{field}: a path or PEM bytes")
    try:
        with open(value, "rb") as f:
            data = f.read()
    except OSError as e:
        raise invalid_argument(
            f"tls.{field} = \"{value}\": {e.strerror}") from None
    if b"-----BEGIN" not in data:
        raise invalid_argument(f"tls.{field} = \"{value}\" is not PEM")
    return data


def _credentials(tls: Union[TLS, bool]) -> Tuple[Any, List[Any]]:
    """Channel credentials and options for `tls` (True: system roots)."""
    if tls is True:
        tls = TLS()
    if not isinstance(tls, TLS):
        raise invalid_argument("tls: pass kvdepot.TLS(...) or True")
    cert, key = _pem(tls.cert, "cert"), _pem(tls.key, "key")
    if (cert is None) != (key is None):
        raise invalid_argument(
            "tls: cert and key go together (mutual TLS needs both)")
    creds = grpc.ssl_channel_credentials(
        root_certificates=_pem(tls.ca, "ca"), private_key=key,
        certificate_chain=cert)
    options = [("grpc.ssl_target_name_override", tls.server_name)] \
        if tls.server_name else []
    return creds, options


def _first_event(call: Any) -> Any:
    """The first SessionEvent of a TcpSessions.Open stream, or the
    KVCacheError saying why there is none."""
    try:
        return next(call)
    except grpc.RpcError as e:
        return from_rpc_error(e)
    except StopIteration:
        return KVCacheError(grpc.StatusCode.UNAVAILABLE,
                            "the daemon ended the session stream at once")


def _data_ref(value: DataLike, field: str) -> "pb.DataRef":
    if isinstance(value, Slice):
        _check_slice(value, field)
        return pb.DataRef(slice=pb.BufferSlice(
            buffer_id=value.buffer_id, offset=value.offset,
            length=value.length))
    return pb.DataRef(inline_data=data_bytes(value, field))


def _check_slice(value: Slice, field: str) -> None:
    """A slice of a buffer from a session that ended names an id the
    (restarted) daemon may have given to another buffer: refused."""
    if value.session is not None and not value.session.alive:
        raise SessionLost(
            f"{field}: buffer {value.buffer_id} belongs to a session that "
            "ended (daemon restart, reconnect() or close()); allocate the "
            "buffer again and take a new slice")


def _out_ref(value: Any, field: str) -> "pb.DataRef":
    if value is INLINE:
        return pb.DataRef(inline_output=True)
    if isinstance(value, Slice):
        return _data_ref(value, field)
    raise invalid_argument(f"{field}: pass INLINE or a Buffer.slice()")


def _count_ref(value: Any) -> "pb.BufferSlice":
    """invalid_count_out of the index calls: a Buffer.slice() of 8 bytes."""
    if not isinstance(value, Slice):
        raise invalid_argument(
            "invalid_count_out: pass None or a Buffer.slice() of 8 bytes")
    return _data_ref(value, "invalid_count_out").slice


def _dtype(value: Any, dtype: Optional[str], field: str) -> int:
    name = dtype if dtype is not None else (
        "bf16" if isinstance(value, Slice) else infer_dtype(value, field))
    if name not in _DTYPES:
        raise invalid_argument(f"dtype \"{name}\" is not \"bf16\" or \"fp32\"")
    return _DTYPES[name]


def _ints(value: Any, field: str) -> bytes:
    return pack_int32(value, field)[0]


def _optional_ints(value: Any, field: str) -> bytes:
    return b"" if value is None else _ints(value, field)


class Client:
    """A connection to kvdepot with an open session (unless
    open_session=False). On a Unix socket the session lives on the companion
    socket for as long as this client (SPEC §11; the daemon's uid is checked
    first: KVDEPOT_DAEMON_UID or daemon_uid, else ours or root); over TCP it
    is a TcpSessions.Open stream that lives as long as the client (identity:
    the mutual-TLS certificate's subject, `tls_subject`; tls=kvdepot.TLS)
    or, with tcp_session="lease", an anonymous lease renewed every
    lease / 3 by a background thread."""

    def __init__(self, address: str = "", *,
                 client_name: str = "kvdepot.py",
                 open_session: bool = True, lease_ms: int = 0,
                 keep_alive: bool = True, timeout: float = 30.0,
                 connect_timeout: float = 10.0,
                 max_message_bytes: int = 64 << 20,
                 daemon_uid: Optional[int] = None,
                 tls: Union[TLS, bool, None] = None,
                 tcp_session: str = "stream"):
        self.target = resolve_target(address)
        if tcp_session not in ("stream", "lease"):
            raise invalid_argument(
                f"tcp_session = \"{tcp_session}\" is not \"stream\" or "
                "\"lease\"")
        if tls and self.target.startswith("unix:"):
            raise invalid_argument(
                "tls: TLS is for TCP; a Unix socket is protected by its "
                "directory and the companion socket's peer credentials")
        self._tcp_session_kind = tcp_session
        self._tcp_call: Any = None
        self._tcp_ended: Optional[str] = None
        self.tls_subject = ""
        self._client_name = client_name
        self._open_session = open_session
        self._lease_ms_asked = lease_ms
        self._keep_alive_wanted = keep_alive
        self._connect_timeout = connect_timeout
        self._daemon_uid = daemon_uid
        self._closed = False
        self._lost: Optional[SessionLost] = None
        # Identifies this session in the Slices of its buffers; a new one
        # per reconnect().
        self._session_token = SessionToken()
        self._handed_out: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._companion: Optional[Companion] = None
        self._metadata: tuple = ()
        self.timeout = timeout
        self.session_id = ""
        self.lease_ms = 0
        self.session_number = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", _RECONNECT_BACKOFF_MS[0]),
            ("grpc.min_reconnect_backoff_ms", _RECONNECT_BACKOFF_MS[0]),
            ("grpc.max_reconnect_backoff_ms", _RECONNECT_BACKOFF_MS[1]),
        ]
        if tls:
            creds, extra = _credentials(tls)
            self._channel = grpc.secure_channel(self.target, creds,
                                                options + extra)
        else:
            self._channel = grpc.insecure_channel(self.target,
                                                  options=options)
        ready = grpc.channel_ready_future(self._channel)
        try:
            ready.result(timeout=connect_timeout)
        except grpc.FutureTimeoutError:
            ready.cancel()
            self._channel.close()
            raise KVCacheError(
                grpc.StatusCode.UNAVAILABLE,
                f"kvdepot at {self.target} did not answer within "
                f"{connect_timeout:g} s") from None
        self._stub = pb_grpc.KVCacheStub(self._channel)
        try:
            self._start_session()
        except KVCacheError:
            self._channel.close()
            raise

    def _start_session(self) -> None:
        """Opens the session: on the companion socket for a Unix socket
        target, else an OpenSession lease kept alive by a thread."""
        if self.target.startswith("unix:"):
            sock = self.target[len("unix:"):]
            check_socket_directory(sock)
            if self._open_session:
                self._companion = Companion(companion_path(sock),
                                            self._client_name,
                                            self._daemon_uid)
                self.session_id = self._companion.hello.session_id
                self.session_number = self._companion.hello.session_number
                self._metadata = (("kvdepot-session-id", self.session_id),)
        elif self._open_session and self._tcp_session_kind == "stream":
            self._open_tcp_session()
        elif self._open_session:
            r = self._call("OpenSession", pb.OpenSessionRequest(
                client_name=self._client_name, lease_ms=self._lease_ms_asked))
            self.session_id, self.lease_ms = r.session_id, r.lease_ms
            self._metadata = (("kvdepot-session-id", self.session_id),)
            if self._keep_alive_wanted:
                self._stop = threading.Event()
                self._thread = threading.Thread(
                    target=self._keep_alive_loop, args=(self._stop,),
                    name="kvdepot-keepalive", daemon=True)
                self._thread.start()

    def _open_tcp_session(self) -> None:
        """TcpSessions.Open: the first event carries the session; the
        session lives as long as the stream (cancelled by close())."""
        stub = pb_grpc.TcpSessionsStub(self._channel)
        call = stub.Open(pb.OpenSessionRequest(
            client_name=self._client_name))
        # The first event, within connect_timeout (a reader thread: the
        # stream itself has no deadline, it lives as long as the session).
        first: List[Any] = []
        reader = threading.Thread(target=lambda: first.append(
            _first_event(call)), name="kvdepot-session-open", daemon=True)
        reader.start()
        reader.join(self._connect_timeout)
        if reader.is_alive():
            call.cancel()
            reader.join()
            raise KVCacheError(
                grpc.StatusCode.UNAVAILABLE,
                f"kvdepot at {self.target} opened no session within "
                f"{self._connect_timeout:g} s")
        event = first[0]
        if isinstance(event, KVCacheError):
            raise event
        self._tcp_ended = None
        self._tcp_call = call
        self.session_id = event.session_id
        self.session_number = event.session_number
        self.tls_subject = event.tls_subject
        self._metadata = (("kvdepot-session-id", self.session_id),)

        def ended(c: Any, self_ref: Any = weakref.ref(self)) -> None:
            me = self_ref()
            if me is not None and me._tcp_call is c:
                me._tcp_ended = ("the daemon ended the session stream "
                                 f"({c.code().name}: {c.details()})")

        call.add_done_callback(ended)

    def reconnect(self, timeout: Optional[float] = None) -> None:
        """Starts over after SessionLost: waits (up to `timeout`, default
        connect_timeout) for the daemon and opens a new session. Pools,
        buffers and mappings of the old session stay invalid; register
        them again. Also usable while the session is alive: it is closed
        first."""
        if self._closed:
            raise ClientClosed("reconnect() on a closed client; make a new "
                               "one with kvdepot.connect()")
        self._end_session(SessionLost(
            "this object belongs to a session the client left by "
            "reconnect(); map or allocate it again"))
        if self._lost is None:
            self._lost = SessionLost(
                "reconnect() closed the session and has not opened a new "
                "one yet; call reconnect() again")
        deadline = time.monotonic() + (
            self._connect_timeout if timeout is None else timeout)
        while True:
            ready = grpc.channel_ready_future(self._channel)
            try:
                ready.result(timeout=max(deadline - time.monotonic(), 0.0))
                self._start_session()
                break
            except grpc.FutureTimeoutError:
                ready.cancel()
                raise KVCacheError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"kvdepot at {self.target} did not answer within the "
                    "reconnect timeout") from None
            except KVCacheError as e:
                # The gRPC socket can be up a moment before the companion.
                if (e.code != grpc.StatusCode.UNAVAILABLE or
                        time.monotonic() >= deadline):
                    raise
                time.sleep(0.05)
        self._session_token = SessionToken()
        self._lost = None

    # ------------------------------------------------------------ plumbing

    @property
    def stub(self) -> Any:
        """The raw kvdepot.v1.KVCache stub, for anything not wrapped."""
        self._check()
        return self._stub

    def _check(self) -> None:
        """Raises ClientClosed or SessionLost before anything is sent."""
        if self._closed:
            raise ClientClosed("the client is closed (close() was called); "
                               "make a new one with kvdepot.connect()")
        if self._lost is None and self._companion is not None and \
                self._companion.peer_closed():
            self._lose("the daemon closed the companion connection "
                       "(it stopped or restarted)")
        if self._lost is None and self._tcp_ended is not None:
            self._lose(self._tcp_ended)
        if self._lost is not None:
            raise self._lost

    def _lose(self, why: str) -> SessionLost:
        """Marks the session lost (once) and invalidates what it handed out."""
        if self._lost is None:
            self._lost = SessionLost(
                f"the session with kvdepot at {self.target} was lost: {why}. "
                "Its buffers and pool mappings are gone; call reconnect() "
                "(or make a new client) and register them again")
            _log.warning("%s", self._lost.message)
            self._end_session(self._lost)
        return self._lost

    def _end_session(self, error: KVCacheError) -> None:
        """Stops the keep-alive, drops the companion connection and makes
        every buffer and mapping of the session raise `error`."""
        self._stop.set()
        if self._thread is not None and \
                self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
        if self._companion is not None:
            self._companion.close()
            self._companion = None
        if self._tcp_call is not None:
            call, self._tcp_call = self._tcp_call, None
            call.cancel()   # ends the session in the daemon
        self._tcp_ended = None
        self.tls_subject = ""
        self._session_token.alive = False
        for obj in list(self._handed_out):
            obj.invalidate(error)
        self._handed_out = weakref.WeakSet()
        self.session_id = ""
        self.session_number = 0
        self.lease_ms = 0
        self._metadata = ()

    def _call(self, method: str, request: Any, stub: Any = None) -> Any:
        """One unary call on `stub` (default: the KVCache stub) with the
        session's metadata and the client's deadline."""
        self._check()
        session = self.session_id
        try:
            return getattr(stub or self._stub, method)(
                request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._rpc_error(e, session) from None

    def _call_future(self, method: str, request: Any,
                     stub: Any = None) -> Tuple[Any, str]:
        """_call without waiting: (the gRPC future, the session it was sent
        in) for _future_result."""
        self._check()
        return getattr(stub or self._stub, method).future(
            request, timeout=self.timeout,
            metadata=self._metadata), self.session_id

    def _future_result(self, future: Any, session: str) -> Any:
        """The reply of a _call_future, or its error as _call raises it."""
        try:
            return future.result()
        except grpc.RpcError as e:
            raise self._rpc_error(e, session) from None

    def _rpc_error(self, e: grpc.RpcError, session: str) -> KVCacheError:
        error = from_rpc_error(e)
        if error.code == grpc.StatusCode.UNAUTHENTICATED and session and \
                session == self.session_id:
            return self._lose(f"the daemon no longer knows the session "
                              f"({error.message})")
        return error

    def _companion_call(self, what: str, request: "pb.CompanionRequest",
                        fd: int = -1) -> Any:
        self._check()
        if self._companion is None:
            raise KVCacheError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{what} needs a session on the companion socket (a Unix "
                "socket address and open_session=True)")
        try:
            return self._companion.call(request, fd)
        except SessionLost as e:
            raise self._lose(e.message) from None

    def _keep_alive_loop(self, stop: threading.Event) -> None:
        period = max(self.lease_ms / 3000.0, 0.01)
        while not stop.wait(period):
            try:
                self.keep_alive()
            except KVCacheError as e:
                _log.warning("kvdepot keep-alive failed: %s", e)

    def keep_alive(self) -> int:
        """Renews the session's lease; returns the milliseconds left."""
        return self._call("KeepAlive", pb.KeepAliveRequest(
            session_id=self.session_id)).lease_ms

    def close(self) -> None:
        """Stops the keep-alive, closes the session (releasing its buffers in
        the daemon; their mappings here raise ClientClosed) and the channel.
        Best effort; safe to call twice. Every later call raises
        ClientClosed."""
        if self._closed:
            return
        if self._companion is None and self._tcp_call is None and \
                self.session_id and self._lost is None:
            try:
                self._call("CloseSession", pb.CloseSessionRequest(
                    session_id=self.session_id))
            except KVCacheError as e:
                _log.info("kvdepot CloseSession: %s", e)
        # A companion session ends with its connection (buffers released).
        self._end_session(ClientClosed(
            "this object belongs to a closed client's session"))
        self._closed = True
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------ pools

    def create_pool(self, name: str, format: str, *, block_size: int,
                    num_blocks: int, num_layers: int, elements: int = 0,
                    device: str = "") -> "pb.PoolInfo":
        """format: "V41", "V41_FP4", "FP4_INDEX", "FP8_FP32SF_INDEX",
        "MXFP8_INDEX", or "BF16" with `elements` (or "BF16(N)")."""
        return self._call("CreatePool", pb.CreatePoolRequest(
            name=name, device=device, format=format, elements=elements,
            block_size=block_size, num_blocks=num_blocks,
            num_layers=num_layers))

    def create_or_get_pool(self, name: str, format: str, *, block_size: int,
                           num_blocks: int, num_layers: int,
                           elements: int = 0,
                           device: str = "") -> "pb.PoolInfo":
        """Creates the pool, or returns the existing one when its layout
        matches (FAILED_PRECONDITION when it does not)."""
        try:
            return self.create_pool(name, format, block_size=block_size,
                                    num_blocks=num_blocks,
                                    num_layers=num_layers, elements=elements,
                                    device=device)
        except KVCacheError as e:
            if e.code != grpc.StatusCode.ALREADY_EXISTS:
                raise
        info = self.get_pool(name)
        l = info.layout
        if (l.format not in (format, f"BF16({elements})") or
                l.block_size != block_size or l.num_blocks != num_blocks or
                l.num_layers != num_layers):
            raise KVCacheError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"pool \"{name}\" exists with another layout ({l.format}, "
                f"block_size {l.block_size}, num_blocks {l.num_blocks}, "
                f"num_layers {l.num_layers})")
        return info

    def get_pool(self, name: str) -> "pb.PoolInfo":
        return self._call("GetPool", pb.GetPoolRequest(name=name))

    def list_pools(self) -> List["pb.PoolInfo"]:
        """All pools, sorted by name."""
        return list(self._call("ListPools", pb.ListPoolsRequest()).pools)

    def delete_pool(self, name: str) -> None:
        self._call("DeletePool", pb.DeletePoolRequest(name=name))

    def map_pool(self, name: str) -> PoolMapping:
        """Maps a pool into this process (its memfd from the companion
        socket: a writable view of layout.total_bytes). Close it with
        .close() when done."""
        reply, fd = self._companion_call(
            "map_pool",
            pb.CompanionRequest(map_pool=pb.MapPoolRequest(name=name)))
        mapping = PoolMapping(reply.pool, fd, reply.fd_size, reply.fd_device)
        self._handed_out.add(mapping)
        return mapping

    # ------------------------------------------------------------ buffers

    def allocate_buffer(self, size: int) -> Buffer:
        """A daemon-allocated buffer of this session (a memfd from the
        companion socket), mapped. Buffer.release() (or `with`) gives it
        back."""
        reply, fd = self._companion_call(
            "allocate_buffer", pb.CompanionRequest(
                allocate_buffer=pb.AllocateBufferRequest(size=size)))
        try:
            buf = Buffer(reply.buffer, fd, self.release_buffer,
                         self._session_token, reply.fd_size, reply.fd_device)
        except (OSError, KVCacheError) as e:
            self.release_buffer(reply.buffer.buffer_id)
            raise KVCacheError(
                grpc.StatusCode.INTERNAL,
                f"mapping buffer {reply.buffer.buffer_id}: {e}") from None
        self._handed_out.add(buf)
        return buf

    def import_buffer(self, fd: int, size: int) -> "pb.BufferInfo":
        """Hands memory this process owns to the daemon as a buffer of the
        session: `fd` a memfd of exactly `size` bytes, sealed with
        F_SEAL_SHRINK | F_SEAL_GROW and fully allocated (os.posix_fallocate).
        The descriptor stays ours."""
        reply, _ = self._companion_call(
            "import_buffer", pb.CompanionRequest(
                import_buffer=pb.ImportMemfdRequest(size=size)), fd)
        return reply.buffer

    def grant(self, *, pool: str = "", buffer_id: int = 0,
              uids: Any = (), gids: Any = (), sessions: Any = (),
              tls_subjects: Any = ()) -> None:
        """Lets uids, gids, sessions (by session_number) or TLS client
        certificate subjects ("CN=worker-b", as tls_subject shows them) use
        a pool or a buffer this session owns. An object's access list holds
        at most 256 uids, 256 gids, 256 sessions and 64 subjects; a grant
        past that raises (RESOURCE_EXHAUSTED) and grants nothing."""
        r = pb.GrantRequest(session_id=self.session_id, uids=list(uids),
                            gids=list(gids), sessions=list(sessions),
                            tls_subjects=list(tls_subjects))
        if pool:
            r.pool = pool
        else:
            r.buffer_id = buffer_id
        self._call("Grant", r)

    def release_buffer(self, buffer: Union[int, Buffer]) -> None:
        buffer_id = buffer.id if isinstance(buffer, Buffer) else buffer
        self._call("ReleaseBuffer", pb.ReleaseBufferRequest(
            session_id=self.session_id, buffer_id=buffer_id))

    # ------------------------------------------------------------ store/load

    def store(self, pool: str, layer: int, slot_mapping: Any, kv: DataLike,
              *, dtype: Optional[str] = None,
              wait_event: bytes = b"", record_event: bool = False,
              fused: Optional[FusedStore] = None) -> StoreResult:
        """Stores kv[num_tokens, elements] (BF16 bit patterns or fp32,
        little-endian) into the slots of `slot_mapping` (int32[num_tokens];
        slot = block_id * block_size + offset, -1 = padding). kv is
        bytes-like, a NumPy array (float32 -> "fp32", uint16 -> "bf16") or a
        Buffer.slice(). Returns the tokens written (a StoreResult, an
        int). wait_event (CUDA backend): the 64 bytes of a
        cudaIpcEventHandle_t the daemon waits for before its kernels
        (kvdepot.torch passes the current stream's). record_event (CUDA
        backend): the daemon replies once its kernels are queued, with its
        event in .recorded_event; wait on that event (a stream wait,
        kvdepot.torch does it) before reading what the call wrote or
        writing what it reads. Without it the reply means done.
        fused: a FusedStore, the daemon normalizes and rotates kv before
        storing it (SPEC §8); None: a plain store."""
        slots, n, _ = pack_int32(slot_mapping, "slot_mapping")
        req = pb.StoreRequest(
            session_id=self.session_id, pool=pool, layer=layer, num_tokens=n,
            slot_mapping=slots, dtype=_dtype(kv, dtype, "kv"),
            kv=_data_ref(kv, "kv"), wait_event_ipc_handle=wait_event,
            record_event=record_event)
        if fused is not None:
            if not isinstance(fused, FusedStore):
                raise invalid_argument(
                    "fused: expected a kvdepot.FusedStore, got "
                    f"{type(fused).__name__}")
            req.fused.CopyFrom(fused.to_proto(n))
        r = self._call("Store", req)
        return StoreResult(r.tokens_written, r.recorded_event_ipc_handle)

    @staticmethod
    def _sequences(seqlen_k: Any, block_table: Any,
                   max_blocks_per_seq: Optional[int],
                   compress_ratio: int) -> "pb.SequencePlan":
        seqlens, num_seqs, _ = pack_int32(seqlen_k, "seqlen_k")
        table, _, cols = pack_int32_2d(block_table, "block_table",
                                       rows=num_seqs, cols=max_blocks_per_seq)
        return pb.SequencePlan(num_seqs=num_seqs, seqlen_k=seqlens,
                               max_blocks_per_seq=cols, block_table=table,
                               compress_ratio=compress_ratio)

    def load(self, pool: str, layer: int, *, segments: Any = None,
             total_k: Optional[int] = None, seqlen_k: Any = None,
             block_table: Any = None, max_blocks_per_seq: Optional[int] = None,
             compress_ratio: int = 1, out: Any = INLINE,
             scales: Any = None, wait_event: bytes = b"",
             record_event: bool = False) -> LoadResult:
        """Loads rows of a pool layer, by an explicit plan (segments:
        int32[S][4], and total_k) or by sequences (seqlen_k: int32[num_seqs],
        block_table: int32[num_seqs][max_blocks_per_seq], compress_ratio).

        out: INLINE (the rows come back in the result) or a Buffer.slice()
        of total_k * load_data_row_bytes. scales: for index formats, INLINE
        or a slice of total_k * load_scale_row_bytes; None for cast formats.
        wait_event, record_event: as for store() (the event in
        .recorded_event).
        """
        req = pb.LoadRequest(session_id=self.session_id, pool=pool,
                             layer=layer, data=_out_ref(out, "out"),
                             wait_event_ipc_handle=wait_event,
                             record_event=record_event)
        if scales is not None:
            req.scales.CopyFrom(_out_ref(scales, "scales"))
        if segments is not None:
            if seqlen_k is not None or block_table is not None:
                raise invalid_argument(
                    "pass either segments or seqlen_k + block_table")
            if total_k is None:
                raise invalid_argument("segments need total_k")
            data, num, _ = pack_int32_2d(segments, "segments", cols=4)
            req.segments.CopyFrom(pb.Segments(num_segments=num,
                                              segments=data, total_k=total_k))
        elif seqlen_k is not None and block_table is not None:
            req.sequences.CopyFrom(self._sequences(
                seqlen_k, block_table, max_blocks_per_seq, compress_ratio))
        else:
            raise invalid_argument(
                "load needs segments + total_k, or seqlen_k + block_table")
        r = self._call("Load", req)
        return LoadResult(
            total_k=r.total_k,
            data=r.data if out is INLINE else None,
            scales=r.scales if scales is INLINE else None,
            cu_rows=unpack_int32(r.cu_rows) if segments is None else None,
            recorded_event=r.recorded_event_ipc_handle)

    def build_plan(self, pool: str, seqlen_k: Any, block_table: Any, *,
                   max_blocks_per_seq: Optional[int] = None,
                   compress_ratio: int = 1) -> Plan:
        """The plan the daemon would load for these sequences (SPEC §6);
        pass plan.segments and plan.total_k to load()."""
        r = self._call("BuildPlan", pb.BuildPlanRequest(
            pool=pool, sequences=self._sequences(
                seqlen_k, block_table, max_blocks_per_seq, compress_ratio)))
        return Plan(num_segments=r.plan.num_segments,
                    segments=unpack_int32(r.plan.segments),
                    total_k=r.plan.total_k, cu_rows=unpack_int32(r.cu_rows))

    def prefill_load(self, swa_pool: str, swa_layer: int, main_pool: str,
                     main_layer: int, *, seqlen_k: Any, seqlen_q: Any,
                     swa_state_id: Any, window: int, compress_ratio: int,
                     block_table: Any, chunk_kv: DataLike,
                     swa_valid_start: Any = None,
                     max_blocks_per_seq: Optional[int] = None,
                     dtype: Optional[str] = None,
                     out: Any = INLINE,
                     wait_event: bytes = b"",
                     record_event: bool = False) -> PrefillLoadResult:
        """One prefill chunk (SPEC §6): the buffer [SWA history | chunk |
        compressed rows] of BF16 rows, then the chunk stored into the SWA
        rings. Arrays are int32[num_seqs] (block_table
        int32[num_seqs][max_blocks_per_seq]); chunk_kv is
        [sum seqlen_q, elements] of dtype. wait_event (CUDA backend): as
        for store(), an event recorded after whatever writes chunk_kv and
        still reads the output slice. record_event: as for store() (the
        event in .recorded_event)."""
        seqlens, num_seqs, _ = pack_int32(seqlen_k, "seqlen_k")
        table, _, cols = pack_int32_2d(block_table, "block_table",
                                       rows=num_seqs, cols=max_blocks_per_seq)
        r = self._call("PrefillLoad", pb.PrefillLoadRequest(
            session_id=self.session_id, swa_pool=swa_pool,
            swa_layer=swa_layer, main_pool=main_pool, main_layer=main_layer,
            num_seqs=num_seqs, seqlen_k=seqlens,
            seqlen_q=_ints(seqlen_q, "seqlen_q"),
            swa_state_id=_ints(swa_state_id, "swa_state_id"),
            swa_valid_start=_optional_ints(swa_valid_start,
                                           "swa_valid_start"),
            window=window, compress_ratio=compress_ratio,
            max_blocks_per_seq=cols, block_table=table,
            dtype=_dtype(chunk_kv, dtype, "chunk_kv"),
            chunk_kv=_data_ref(chunk_kv, "chunk_kv"),
            output=_out_ref(out, "out"), wait_event_ipc_handle=wait_event,
            record_event=record_event))
        return PrefillLoadResult(
            total_k_swa=r.total_k_swa, chunk_offset=r.chunk_offset,
            main_kv_offset=r.main_kv_offset, total_rows=r.total_rows,
            cu_compressed=unpack_int32(r.cu_compressed),
            output=r.output if out is INLINE else None,
            swa_segments=r.swa_segments, main_segments=r.main_segments,
            recorded_event=r.recorded_event_ipc_handle)

    # ------------------------------------------------------------ indices

    def convert_topk(self, pool: str, topk: Any, valid_count: Any,
                     num_tokens: Any, block_table: Any, *,
                     k: Optional[int] = None,
                     max_blocks_per_seq: Optional[int] = None,
                     out: Any = INLINE, invalid_count_out: Any = None,
                     wait_event: bytes = b"",
                     record_event: bool = False) -> IndexResult:
        """Decode top-k conversion (SPEC §7): topk int32[batch][k] logical
        compressed-token indices -> slots int32[batch][k], -1 = none.
        valid_count and num_tokens are int32[batch].

        Buffer forms (SPEC §7): topk may be a Buffer.slice() of
        int32[batch][k] (then pass k), block_table a slice of
        int32[batch][max_blocks_per_seq] (then pass max_blocks_per_seq);
        entries read from a buffer that are out of range become -1 and
        are counted, not rejected. out: INLINE (.slots) or a slice for the
        slots (.slots is None; the topk slice itself converts in place).
        invalid_count_out: None or an 8-byte slice set to invalid_count
        (little-endian int64). wait_event, record_event: as for store()
        (CUDA backend; record_event needs out in a buffer)."""
        counts, batch, _ = pack_int32(valid_count, "valid_count")
        req = pb.ConvertTopkRequest(
            session_id=self.session_id, pool=pool, batch=batch,
            valid_count=counts, wait_event_ipc_handle=wait_event,
            record_event=record_event)
        if isinstance(topk, Slice):
            if k is None:
                raise invalid_argument(
                    "k: topk is a Buffer.slice() (topk_buffer); pass k, "
                    "its number of columns")
            req.topk_buffer.CopyFrom(_data_ref(topk, "topk").slice)
        else:
            req.topk, _, k = pack_int32_2d(topk, "topk", rows=batch, cols=k)
        req.k = k
        if isinstance(block_table, Slice):
            if max_blocks_per_seq is None:
                raise invalid_argument(
                    "max_blocks_per_seq: block_table is a Buffer.slice() "
                    "(block_table_buffer); pass max_blocks_per_seq, its "
                    "number of columns")
            req.block_table_buffer.CopyFrom(
                _data_ref(block_table, "block_table").slice)
            req.max_blocks_per_seq = max_blocks_per_seq
        else:
            req.block_table, _, req.max_blocks_per_seq = pack_int32_2d(
                block_table, "block_table", rows=batch,
                cols=max_blocks_per_seq)
        req.num_tokens = _ints(num_tokens, "num_tokens")
        slots = _out_ref(out, "out")
        if slots.HasField("slice"):
            req.slots_buffer.CopyFrom(slots.slice)
        if invalid_count_out is not None:
            req.invalid_count_buffer.CopyFrom(_count_ref(invalid_count_out))
        r = self._call("ConvertTopk", req)
        return IndexResult(
            slots=unpack_int32(r.slots) if out is INLINE else None,
            rows=batch, cols=k, invalid_count=r.invalid_count,
            recorded_event=r.recorded_event_ipc_handle)

    def swa_decode_index(self, pool: str, window: int, queries: Any, *,
                         out: Any = INLINE, wait_event: bytes = b"",
                         record_event: bool = False) -> IndexResult:
        """SWA decode index (SPEC §7): queries int32[n][3] rows {state_id,
        start, valid_len} -> slots int32[n][window], -1 after valid_len.
        out: INLINE (.slots) or a Buffer.slice() of int32[n][window]
        (.slots is None). wait_event, record_event: as for store() (CUDA
        backend; record_event needs out in a buffer)."""
        data, n, _ = pack_int32_2d(queries, "queries", cols=3)
        req = pb.SwaDecodeIndexRequest(
            session_id=self.session_id, pool=pool, window=window,
            num_queries=n, queries=data, wait_event_ipc_handle=wait_event,
            record_event=record_event)
        slots = _out_ref(out, "out")
        if slots.HasField("slice"):
            req.slots_buffer.CopyFrom(slots.slice)
        r = self._call("SwaDecodeIndex", req)
        return IndexResult(
            slots=unpack_int32(r.slots) if out is INLINE else None,
            rows=n, cols=window, recorded_event=r.recorded_event_ipc_handle)

    def prefill_index(self, seqlen_k: Any, seqlen_q: Any, *, window: int,
                      compress_ratio: int, compressed_index: Any,
                      topk_k: Optional[int] = None,
                      swa_valid_start: Any = None, out: Any = INLINE,
                      invalid_count_out: Any = None,
                      wait_event: bytes = b"",
                      record_event: bool = False) -> PrefillIndexResult:
        """Prefill index (SPEC §7): for every query row of the chunk,
        [SWA index | compressed index] into the PrefillLoad buffer.
        compressed_index is int32[sum seqlen_q][topk_k], -1 = masked.

        Buffer forms (SPEC §7): compressed_index may be a Buffer.slice()
        (then pass topk_k); its entries outside [-1, compressed rows)
        become -1 and are counted (.invalid_count), where inline ones are
        refused. out: INLINE (.index) or a slice of
        int32[sum seqlen_q][window + topk_k] (.index is None).
        invalid_count_out: None or an 8-byte slice set to invalid_count
        (little-endian int64). wait_event, record_event: as for store()
        (CUDA backend; record_event needs out in a buffer)."""
        seqlens, num_seqs, _ = pack_int32(seqlen_k, "seqlen_k")
        q_data, _, _ = pack_int32(seqlen_q, "seqlen_q")
        req = pb.PrefillIndexRequest(
            session_id=self.session_id, num_seqs=num_seqs,
            seqlen_k=seqlens, seqlen_q=q_data, window=window,
            compress_ratio=compress_ratio, wait_event_ipc_handle=wait_event,
            record_event=record_event)
        if isinstance(compressed_index, Slice):
            if topk_k is None:
                raise invalid_argument(
                    "topk_k: compressed_index is a Buffer.slice() "
                    "(compressed_index_buffer); pass topk_k, its number "
                    "of columns")
            req.compressed_index_buffer.CopyFrom(
                _data_ref(compressed_index, "compressed_index").slice)
        else:
            rows = sum(unpack_int32(q_data))
            req.compressed_index, _, topk_k = pack_int32_2d(
                compressed_index, "compressed_index", rows=rows,
                cols=topk_k)
        req.topk_k = topk_k
        req.swa_valid_start = _optional_ints(swa_valid_start,
                                             "swa_valid_start")
        index = _out_ref(out, "out")
        if index.HasField("slice"):
            req.index_buffer.CopyFrom(index.slice)
        if invalid_count_out is not None:
            req.invalid_count_buffer.CopyFrom(_count_ref(invalid_count_out))
        r = self._call("PrefillIndex", req)
        return PrefillIndexResult(
            index=unpack_int32(r.index) if out is INLINE else None,
            row_width=r.row_width, main_kv_offset=r.main_kv_offset,
            total_rows=r.total_rows, invalid_count=r.invalid_count,
            recorded_event=r.recorded_event_ipc_handle)

    # ------------------------------------------------------------ inspection

    def stats(self) -> "pb.StatsResponse":
        return self._call("Stats", pb.StatsRequest())

    def ping(self) -> None:
        self._call("Ping", pb.PingRequest())


def connect(address: str = "", **options: Any) -> Client:
    """Client(address, **options): "" = the daemon's default socket."""
    return Client(address, **options)
