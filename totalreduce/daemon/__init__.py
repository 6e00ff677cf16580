"""The per-node service: one engine per node, its client processes ranks of it.

``totalreduce serve`` (:mod:`.serve`) runs one service per node under
``mpiexec``.  The service is an ordinary engine whose transport is the relay
transport (shared memory to the node's client processes, MPI to the other
nodes) and whose loop takes part in the relay steps of hierarchical ops
(:mod:`.adopt`).  Training processes attach with
``totalreduce.init(service="daemon")``: they run the same engine as in
embedded mode over a shared-memory client transport.  Layout:

- :mod:`.serve` - the command: start-up, agreement between nodes, signals;
- :mod:`.node` - the socket: hello, slots, sessions, liveness and teardown;
- :mod:`.adopt` - the relay's part of a hierarchical op, compiled from a frame;
- :mod:`.sockets` - the listening socket, its permissions and peer credentials;
- :mod:`.bench` - daemon mode against embedded mode.

See docs/daemon.md.
"""
