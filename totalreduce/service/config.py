"""The service's configuration: :class:`totalreduce.config.Config` (one for the whole
stack: the engine's loop takes the same object), under the name it has always had here."""

from __future__ import annotations

from ..config import ENV_PREFIX, Config

__all__ = ["ENV_PREFIX", "Config"]
