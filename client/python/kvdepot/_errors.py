"""The one exception type of the client."""

import grpc


class KVCacheError(Exception):
    """A failed request: the gRPC status code and the daemon's message.

    Checks the client makes before sending (an int32 array that does not fit,
    a shape that does not divide) raise it too, with INVALID_ARGUMENT and a
    message naming the field and index, like the daemon's.
    """

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def invalid_argument(message: str) -> KVCacheError:
    return KVCacheError(grpc.StatusCode.INVALID_ARGUMENT, message)


def from_rpc_error(error: grpc.RpcError) -> KVCacheError:
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return KVCacheError(code, details or "")
