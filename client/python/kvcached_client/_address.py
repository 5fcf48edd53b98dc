"""Where the daemon listens by default (the same rule as kvcached's)."""

import os


def default_socket_path() -> str:
    """$XDG_RUNTIME_DIR/kvcached.sock, or /tmp/kvcached-$UID.sock."""
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime_dir.startswith("/"):
        return runtime_dir + "/kvcached.sock"
    return f"/tmp/kvcached-{os.getuid()}.sock"


def resolve_target(address: str = "") -> str:
    """A gRPC target for "" (the default socket), "/path", "unix:/path" or
    "host:port"."""
    if not address:
        return "unix:" + default_socket_path()
    if address.startswith("/"):
        return "unix:" + address
    return address
