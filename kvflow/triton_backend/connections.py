"""Close the client connections of a stopping tritonserver.

tritonserver 2.51 cannot stop while a client holds a gRPC stream open: the stream's state keeps
the request it carried, the request keeps the model, so the model never unloads and the server
waits out ``--exit-timeout-secs`` and exits 1; and once the model is gone, the gRPC endpoint's
shutdown waits for the stream with no deadline. Requests still running (over HTTP or gRPC) hold
the model until they finish, however long that is. ``kvflow serve`` therefore closes every client
connection once it has sent SIGTERM: running requests are cancelled (the backend aborts them
before the next step and closes their streams), streams end, and the model unloads at once.

A connection belongs to the server's process, so it is closed through a copy of its socket
(``pidfd_getfd``, Linux 5.6+, allowed to a parent over its child): ``shutdown()`` acts on the
socket itself, which tritonserver sees as the client hanging up.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import socket
from collections.abc import Iterable
from pathlib import Path

_SYS_PIDFD_GETFD = 438  # the same number on every Linux architecture
_TCP_LISTEN = "0A"


def accepted_sockets(pid: int, ports: Iterable[int]) -> dict[int, int]:
    """Process ``pid``'s connected TCP sockets whose local port is one of ``ports``: fd number
    -> socket inode."""
    wanted = set(ports)
    inodes: set[int] = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                local_port = int(fields[1].rsplit(":", 1)[1], 16)
                if local_port in wanted and fields[3] != _TCP_LISTEN:
                    inodes.add(int(fields[9]))
    fds: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(entry.path)
                if target.startswith("socket:[") and int(target[8:-1]) in inodes:
                    fds[int(entry.name)] = int(target[8:-1])
    return fds


def disconnect_clients(pid: int, ports: Iterable[int]) -> int:
    """Shut down every client connection process ``pid`` accepted on ``ports``; returns how
    many. Raises OSError when this process may not reach into ``pid`` (no ``pidfd_getfd``: an
    old kernel, or a sandbox that forbids it)."""
    fds = accepted_sockets(pid, ports)
    if not fds:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    closed = 0
    try:
        for target_fd, inode in fds.items():
            fd = libc.syscall(_SYS_PIDFD_GETFD, pidfd, target_fd, 0)
            if fd < 0:
                err = ctypes.get_errno()
                if err == errno.EBADF:  # the server closed it meanwhile
                    continue
                raise OSError(err, f"pidfd_getfd: {os.strerror(err)}")
            with socket.socket(fileno=fd) as sock, contextlib.suppress(OSError):
                if os.fstat(fd).st_ino == inode:  # not a number the server has reused since
                    sock.shutdown(socket.SHUT_RDWR)
                    closed += 1
    finally:
        os.close(pidfd)
    return closed
