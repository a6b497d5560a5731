"""Where an engine listens and who answers there: private socket folders, socket paths,
and the peer check behind `EngineProcess.ping`.

An engine serves on a Unix socket (`--uds`) in a private 0700 folder: no TCP port can be
taken between choosing and binding it, and nothing else in the pod reaches the dev
endpoints. `socket_peer_pid` and `process_group` say which process answers on a socket, so
an orphan or another server can never pass for the engine.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import tempfile
from pathlib import Path

from controller.config.settings import Settings
from controller.errors import EngineStartError

LOOPBACK = "127.0.0.1"

# sockaddr_un.sun_path is 108 bytes with its terminating NUL.
MAX_SOCKET_PATH = 107


def free_port(host: str = LOOPBACK) -> int:
    """A port the kernel considers free right now. Racy (it can be taken before it is bound):
    for servers that cannot bind port 0 themselves; engines use Unix sockets instead."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def private_dir(path: Path | None = None, prefix: str = "hotswap-sockets-") -> Path:
    """A folder only this user can enter (0700): a new temporary one, or `path` made so.

    Refuses a `path` owned by another user or that is a symlink: whoever could write there
    could put a socket in the engine's place.
    """
    if path is None:
        return Path(tempfile.mkdtemp(prefix=prefix))  # mkdtemp makes it 0700
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise EngineStartError(f"socket folder {path} is not a plain folder")
    if st.st_uid != os.getuid():
        raise EngineStartError(f"socket folder {path} belongs to uid {st.st_uid}, not to us")
    os.chmod(path, 0o700)
    return path


def socket_path(folder: Path, name: str) -> Path:
    """The engine socket of model `name` in `folder`; checked against the kernel's limit."""
    path = folder / f"{name}.sock"
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise EngineStartError(
            f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes; use a shorter "
            "supervisor.socket_dir"
        )
    return path


def socket_peer_pid(sock: socket.socket) -> int:
    """The pid of the process that listens on the other end of a connected Unix socket."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid: int = struct.unpack("3i", creds)[0]
    return pid


def process_group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def http_status_over(sock: socket.socket, path: str) -> int:
    """GET `path` over an already connected socket; the status code (0: no valid answer)."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".encode())
    head = b""
    while b"\r\n" not in head and len(head) < 4096:
        chunk = sock.recv(1024)
        if not chunk:
            break
        head += chunk
    parts = head.split(b"\r\n", 1)[0].split()
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        return 0
    return int(parts[1])


def with_engine_sockets(settings: Settings, folder: Path) -> Settings:
    """`settings` with every managed model that names no socket given one in `folder`."""
    models = [
        m.model_copy(update={"uds": str(socket_path(folder, m.name))})
        if m.managed and m.uds is None
        else m
        for m in settings.models
    ]
    return settings.model_copy(update={"models": models})
