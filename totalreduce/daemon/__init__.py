"""The per-node service: totalreduce as a background process beside the training processes.

``totalreduce serve`` (:mod:`.serve`) runs one service per node under ``mpiexec``;
training processes attach with ``totalreduce.init(service="daemon")``, which
returns a :class:`~.client.DaemonClient` with the embedded API.  Layout:

- :mod:`.protocol` - the socket's framed control messages and their validation;
- :mod:`.shm` - shared memory regions, the clients' completion slots, staging;
- :mod:`.sockets` - socket paths, permissions and peer credentials;
- :mod:`.client` - the client a training process holds;
- :mod:`.rendezvous` - one op as the local clients submit it, and the local phases;
- :mod:`.server` - the service's event loop, jobs, faults and shutdown;
- :mod:`.peers` - notices between the services of different nodes;
- :mod:`.timing` - precise short sleeps for the threads that poll;
- :mod:`.bench` - daemon mode against embedded mode.

Importing this package imports neither MPI nor Numba; the client needs neither.
See docs/daemon.md.
"""

from __future__ import annotations

from .client import DaemonClient, DaemonHandle, connect

__all__ = ["DaemonClient", "DaemonHandle", "connect"]
