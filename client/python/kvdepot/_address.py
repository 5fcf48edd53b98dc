"""Where the daemon listens by default (the same rule as kvdepot's)."""

import os


def default_socket_path() -> str:
    """$XDG_RUNTIME_DIR/kvdepot/kvdepotd.sock, or
    /tmp/kvdepot-$UID/kvdepotd.sock (a directory private to the daemon)."""
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime_dir.startswith("/"):
        return runtime_dir + "/kvdepot/kvdepotd.sock"
    return f"/tmp/kvdepot-{os.getuid()}/kvdepotd.sock"


def resolve_target(address: str = "") -> str:
    """A gRPC target for "/path", "unix:/path" or "host:port"; "" means
    $KVDEPOT_ADDR when set, else the default socket (an explicit address
    beats the environment, which beats the default, as in kvcachectl)."""
    if not address:
        address = os.environ.get("KVDEPOT_ADDR", "")
    if not address:
        return "unix:" + default_socket_path()
    if address.startswith("/"):
        return "unix:" + address
    return address
