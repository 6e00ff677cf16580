"""The bottom layer of compiled code: memory at addresses, atomics, C calls, sleeping.

Nothing here knows about ops, frames or MPI.  The compiled engine (``engine/``), the
compiled transports (``transport/``) and the kernels (``kernels/``) build on it:

- :mod:`.intrinsics`: loads and stores of fixed-width values at byte addresses, atomic
  operations (the words threads and processes share), array views of raw memory, and
  calls of C functions through addresses known only at run time (MPI's);
- :mod:`.libc`: the C library's memory, clock and futex calls, linked by name, so the
  compiled functions that use them cache on disk.

Every function of those two is ``@njit(nogil=True, cache=True)`` or an ``@intrinsic``;
importing this package compiles nothing.  :mod:`.digest` (plain Python) digests the source
files whose change makes code cached on disk stale.
"""
