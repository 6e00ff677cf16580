"""The topology registry: names users pass, mapped to topology classes.

This module owns :func:`register` (the class decorator every built-in topology uses)
and :func:`get_topology`, which builds a topology from a name, a world size and the
topology's own options.  A registered class must take ``world_size`` as its first
argument and its options as keyword arguments.  The registry is filled once, when the
package is imported; it is the only module-level table of the package.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TypeVar

from .mixing import MixingTopology

T = TypeVar("T", bound=type[MixingTopology])

_REGISTRY: dict[str, type[MixingTopology]] = {}


def _normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def register(name: str) -> Callable[[T], T]:
    """Class decorator: make a topology class available to :func:`get_topology` as ``name``.

    Names are case-insensitive and ``_`` is read as ``-``.

    Example::

        @register("pairs")
        class Pairs(Topology):
            def _edges(self) -> list[list[Edge]]: ...
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a topology name must be a non-empty string, got {name!r}")
    key = _normalise(name)

    def decorate(cls: T) -> T:
        if not (isinstance(cls, type) and issubclass(cls, MixingTopology)):
            raise TypeError(f"topology {key!r}: {cls!r} is not a subclass of MixingTopology")
        existing = _REGISTRY.get(key)
        if existing is not None and existing is not cls:
            raise ValueError(
                f"topology name {key!r} is already registered to {existing.__qualname__}; "
                f"cannot register {cls.__qualname__} under it"
            )
        cls.name = key
        _REGISTRY[key] = cls
        return cls

    return decorate


def known_topologies() -> tuple[str, ...]:
    """The registered names, sorted."""
    return tuple(sorted(_REGISTRY))


def topology_class(name: str) -> type[MixingTopology]:
    """The class registered as ``name``; ValueError listing the known names if none."""
    cls = _REGISTRY.get(_normalise(name)) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown topology {name!r}; known: {', '.join(known_topologies())}")
    return cls


def topology_options(name: str) -> tuple[str, ...]:
    """The option names the topology registered as ``name`` accepts."""
    params = list(inspect.signature(topology_class(name)).parameters.values())[1:]
    return tuple(p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD)


def get_topology(
    name_or_topology: str | MixingTopology, world_size: int, **options: object
) -> MixingTopology:
    """Build the topology ``name_or_topology`` over ``world_size`` ranks.

    A topology instance is returned as is, after checking that its world size matches
    (options are refused then: they only apply when building by name).  Unknown names
    and options a topology does not take raise ValueError naming the known ones.

    Example::

        get_topology("alternating-exp-ring", 16, local_size=4)
        get_topology("exponential", 9, base=3)
    """
    if isinstance(name_or_topology, MixingTopology):
        topo = name_or_topology
        if topo.world_size != world_size:
            raise ValueError(
                f"{topo.describe()} was given for world size {world_size}; build one for "
                f"{world_size} ranks instead"
            )
        if options:
            raise ValueError(
                f"options {sorted(options)} cannot apply to the already built {topo.describe()}"
            )
        return topo
    cls = topology_class(name_or_topology)  # type: ignore[arg-type]
    params = list(inspect.signature(cls).parameters.values())[1:]
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        accepted = [p.name for p in params]
        unknown = sorted(k for k in options if k not in accepted)
        if unknown:
            takes = ", ".join(accepted) if accepted else "no options"
            raise ValueError(f"topology {cls.name!r} does not take {unknown}; it takes: {takes}")
    return cls(world_size, **options)
