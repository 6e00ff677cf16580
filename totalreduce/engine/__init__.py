"""The control plane: :class:`~.loop.CommLoop` around the compiled lane, :mod:`totalreduce.lane`."""
