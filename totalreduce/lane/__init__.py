"""The compiled data plane: the lane (Numba code over MPI and the in-process transport) and
its Python wrapper, the op it runs (:mod:`.payload`), and compiling it once per installation.

Every op's data moves here. It imports the layers below it (protocol, transport, kernels,
native, algorithms, dtypes), never the control plane (:mod:`totalreduce.engine`) or the
client side above that. Importing the package imports nothing: :mod:`.lane` loads the MPI
binding, so only a service that makes a lane imports it.
"""
