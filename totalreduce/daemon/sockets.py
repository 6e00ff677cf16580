"""Where a node's service listens, and who may talk to it.

This module owns the service's side of the socket path and its permissions
(the names themselves are :mod:`totalreduce.transport.hello`'s): the directory
is created ``0700`` and must belong to the service's user; the socket is made
``0600`` before anyone can connect.  A service
refuses to start on a path that answers (another service serves it) and
removes a stale socket file otherwise.  Each accepted connection's peer is
identified with ``SO_PEERCRED``; only the service's own user is admitted.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import struct
from pathlib import Path

from ..errors import TotalReduceError

log = logging.getLogger("totalreduce.daemon.sockets")

_CRED = struct.Struct("3i")


class SocketInUseError(TotalReduceError):
    """Another service answers on the socket path."""


def private_dir(directory: Path) -> Path:
    """Create ``directory`` 0700 (with parents), or check an existing one is ours and private."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise TotalReduceError(f"{directory} is not a directory")
    if st.st_uid != os.getuid():
        raise TotalReduceError(
            f"{directory} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}); "
            "choose another --socket-dir"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        log.warning("%s had mode %o; restricting it to 0700", directory, stat.S_IMODE(st.st_mode))
        os.chmod(directory, 0o700)
    return directory


def answers(path: Path, timeout: float = 1.0) -> bool:
    """True if something accepts connections on the Unix socket ``path``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def check_free(path: Path) -> None:
    """Raise SocketInUseError if a service answers on ``path``; remove a stale socket file."""
    if not os.path.lexists(path):
        return
    st = os.lstat(path)
    if not stat.S_ISSOCK(st.st_mode):
        raise TotalReduceError(f"{path} exists and is not a socket; not touching it")
    if answers(path):
        raise SocketInUseError(f"{path} is already served by another totalreduce service")
    log.info("removing stale socket %s", path)
    os.unlink(path)


def listen(path: Path, backlog: int = 64) -> socket.socket:
    """A non-blocking listening socket at ``path``, mode 0600 from its creation."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        s.bind(str(path))
    except BaseException:
        s.close()
        raise
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    s.listen(backlog)
    s.setblocking(False)
    return s


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    pid, uid, gid = _CRED.unpack(raw)
    return pid, uid, gid
