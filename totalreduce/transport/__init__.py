"""Transports behind one protocol: ``mpi`` (mpi4py) and ``local`` (threads, for tests)."""

from __future__ import annotations

from .base import ANY_SOURCE, Transport

__all__ = ["ANY_SOURCE", "Transport"]
