"""The per-node service: the node's only engine; its training processes are thin clients.

``totalreduce serve`` (:mod:`.serve`) runs one service per node under
``mpiexec``.  Training processes attach with ``totalreduce.init(service="daemon")``
and run no engine: they hand every op to their node's service as a descriptor in
the node's shared-memory arena (:mod:`totalreduce.transport.arena`) and read a
completion word.  The service's arena thread reduces the node's part of each op
(in compiled code for the common ones) and runs the part among the nodes on an
ordinary engine whose ranks are the nodes' services.  Layout:

- :mod:`.serve` - the command: start-up, agreement between nodes, signals;
- :mod:`.node` - the socket: hello, slots, sessions, liveness and teardown;
- :mod:`.thin` - the arena thread: the clients' ops, on the node and among the nodes
  (with :mod:`.thin_ops`, :mod:`.thin_nodes` and :mod:`.thin_answers`), and which session
  of each node a job is made of (:mod:`.thin_session`);
- :mod:`.arena_pass` - its compiled pass over the clients' submission rings;
- :mod:`.sockets` - the listening socket, its permissions and peer credentials;
- :mod:`.bench` - daemon mode against embedded mode.

See docs/daemon.md.
"""
