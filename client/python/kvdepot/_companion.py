"""The companion socket (SPEC §11): the session is opened here (Hello) and
memory arrives as memfds (SCM_RIGHTS), never as names.

Before anything is sent, the socket's directory must not be writable by
others and the daemon must run as the expected uid (SO_PEERCRED):
KVDEPOT_DAEMON_UID, else this process's own uid or root.
"""

import os
import select
import socket
import stat
import struct
import threading
from typing import List, Optional, Tuple

import grpc

from kvdepot.v1 import kvdepot_pb2 as pb

from ._errors import KVCacheError, SessionLost

_MAX_REPLY = 1 << 20


def companion_path(socket_path: str) -> str:
    """"<dir>/x.sock" -> "<dir>/x.ctl"; any other path -> path + ".ctl"."""
    if socket_path.endswith(".sock"):
        return socket_path[:-5] + ".ctl"
    return socket_path + ".ctl"


def check_socket_directory(socket_path: str) -> None:
    """Refuses a socket whose directory others can write."""
    d = os.path.dirname(socket_path) or "."
    try:
        mode = os.stat(d).st_mode
    except OSError as e:
        raise KVCacheError(grpc.StatusCode.UNAVAILABLE,
                           f"socket directory {d!r}: {e.strerror}") from None
    if mode & stat.S_IWOTH:
        raise KVCacheError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"refusing the socket {socket_path!r}: its directory {d!r} (mode "
            f"{stat.S_IMODE(mode):04o}) can be written by others, who could "
            "have put their own socket there; use the daemon's private "
            "directory (SPEC §11)")


def expected_daemon_uid(flag: Optional[int]) -> Optional[int]:
    if flag is not None and flag >= 0:
        return flag
    env = os.environ.get("KVDEPOT_DAEMON_UID", "")
    if env.isdigit():
        return int(env)
    return None


class Companion:
    """One companion connection: its session lives as long as it does."""

    def __init__(self, path: str, client_name: str,
                 daemon_uid: Optional[int] = None):
        check_socket_directory(path)
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._sock.connect(path)
        except OSError as e:
            self._sock.close()
            raise KVCacheError(
                grpc.StatusCode.UNAVAILABLE,
                f"cannot connect to the companion socket {path!r}: "
                f"{e.strerror}") from None
        _, uid, _ = struct.unpack("3i", self._sock.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        want = expected_daemon_uid(daemon_uid)
        ok = uid == want if want is not None else uid in (os.getuid(), 0)
        if not ok:
            self._sock.close()
            raise KVCacheError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"the process serving {path!r} runs as uid {uid}, not the "
                f"expected daemon uid "
                f"{want if want is not None else f'{os.getuid()} or 0'} "
                "(KVDEPOT_DAEMON_UID); no memory is handed to it")
        reply, _ = self.call(pb.CompanionRequest(
            hello=pb.Hello(client_name=client_name)))
        self.hello = reply.hello

    def call(self, request: "pb.CompanionRequest",
             fd: int = -1) -> Tuple["pb.CompanionReply", Optional[int]]:
        """One request, its reply and the descriptor it carried (owned by
        the caller) or None. A non-OK reply raises KVCacheError; a closed
        or reset connection (the session is gone) raises SessionLost."""
        data = request.SerializeToString()
        with self._lock:
            try:
                if fd >= 0:
                    socket.send_fds(self._sock, [data], [fd])
                else:
                    self._sock.send(data)
                msg, fds, flags, _ = socket.recv_fds(
                    self._sock, _MAX_REPLY, 1, socket.MSG_CMSG_CLOEXEC)
            except OSError as e:
                raise SessionLost(f"the companion connection failed: "
                                  f"{e.strerror or e}") from None
        if not msg and not fds:
            raise SessionLost("the daemon closed the companion connection")
        if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC) or not msg:
            for f in fds:
                os.close(f)
            raise KVCacheError(grpc.StatusCode.INTERNAL,
                               "companion socket: a truncated reply")
        reply = pb.CompanionReply()
        reply.ParseFromString(msg)
        if reply.code != 0:
            for f in fds:
                os.close(f)
            raise KVCacheError(grpc.StatusCode(
                _CODES.get(reply.code, grpc.StatusCode.UNKNOWN)),
                reply.message)
        return reply, (fds[0] if fds else None)

    def peer_closed(self) -> bool:
        """True when the daemon's end closed or reset (EOF, ECONNRESET) or
        this end was closed. The daemon sends nothing unasked, so between
        calls any readiness means the connection is over."""
        with self._lock:
            if self._sock.fileno() < 0:
                return True
            poller = select.poll()
            poller.register(self._sock, select.POLLIN | select.POLLHUP |
                            select.POLLERR)
            return bool(poller.poll(0))

    def close(self) -> None:
        self._sock.close()


_CODES = {c.value[0]: c for c in grpc.StatusCode}
