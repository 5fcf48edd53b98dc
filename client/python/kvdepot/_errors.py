"""The client's exception types: KVCacheError and its two states."""

import grpc


class KVCacheError(Exception):
    """A failed request: the gRPC status code and the daemon's message.

    Checks the client makes before sending (an int32 array that does not fit,
    a shape that does not divide) raise it too, with INVALID_ARGUMENT and a
    message naming the field and index, like the daemon's.
    """

    def __init__(self, code: grpc.StatusCode, message: str,
                 field: str = ""):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        # The field the daemon named as wrong ("slot_mapping[17]"), where
        # it says (a StepStream reply's error_field); "" otherwise.
        self.field = field


class ClientClosed(KVCacheError):
    """A call on a client after close(): FAILED_PRECONDITION, nothing sent."""

    def __init__(self, message: str):
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION, message)


class SessionLost(KVCacheError):
    """The session ended under the client (the daemon restarted or closed
    the companion connection; over TCP, the daemon no longer knows the
    session). Its pools' mappings and its buffers are gone: every call
    raises this, FAILED_PRECONDITION, until Client.reconnect()."""

    def __init__(self, message: str):
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION, message)


def invalid_argument(message: str) -> KVCacheError:
    return KVCacheError(grpc.StatusCode.INVALID_ARGUMENT, message)


def from_rpc_error(error: grpc.RpcError) -> KVCacheError:
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return KVCacheError(code, details or "")
