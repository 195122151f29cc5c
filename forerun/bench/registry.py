"""The registry that names benchmark methods for ``--methods``.

A method plugs in with one entry, for example::

    register_method("medusa", lambda: ForerunMethod("medusa", draft="medusa"),
                    "Medusa heads")

:func:`register_pattern` names a family (``draft-k4``: the draft model at a
fixed draft length 4).  forerun's own methods (:mod:`.methods`) and the
peers (:mod:`.peers`) register themselves; :mod:`forerun.bench` imports
both, so the registry is complete wherever the package is used.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from forerun.bench.errors import BenchError
from forerun.bench.method import BenchMethod

Factory = Callable[[], BenchMethod]


@dataclass
class _Entry:
    usage: str
    description: str
    make: Callable[[re.Match | None], BenchMethod]
    pattern: re.Pattern | None   # None: the exact name


REGISTRY: dict[str, _Entry] = {}

# ``--peer-...`` flags: the methods each adds.
PEER_GROUPS: dict[str, tuple[str, ...]] = {}
# The methods a ``--peer-...`` flag adds only when forerun's own rows run on
# the engine of the same name (a peer set up like that engine).
ENGINE_PEERS: dict[str, tuple[str, ...]] = {}


def register_method(name: str, factory: Factory, description: str = "") -> None:
    """Name a method for ``--methods``: ``factory()`` builds a fresh
    :class:`BenchMethod` (a later registration of the name replaces it)."""
    REGISTRY[name] = _Entry(name, description, lambda _m: factory(), None)


def register_pattern(pattern: str, factory: Callable[[re.Match], BenchMethod], usage: str,
                     description: str = "") -> None:
    """Name a family of methods by a regular expression (matched in full):
    ``factory(match)`` builds the method; ``usage`` shows the family in
    help texts (``draft-kN``)."""
    def make(match: re.Match | None) -> BenchMethod:
        assert match is not None   # make_method makes a pattern's methods from a match
        return factory(match)

    REGISTRY[usage] = _Entry(usage, description, make, re.compile(pattern))


def known(name: str) -> bool:
    """Whether a registered method or family is called ``name``."""
    return any(name == usage if e.pattern is None else bool(e.pattern.fullmatch(name))
               for usage, e in REGISTRY.items())


def make_method(name: str) -> BenchMethod:
    """A fresh method of the given name."""
    entry = REGISTRY.get(name)
    method = None
    if entry is not None and entry.pattern is None:
        method = entry.make(None)
    else:
        for entry in REGISTRY.values():
            match = entry.pattern.fullmatch(name) if entry.pattern is not None else None
            if match:
                method = entry.make(match)
                break
    if method is not None:
        method.name = name
        return method
    raise BenchError(f"unknown method {name!r}; the methods are "
                     f"{', '.join(e.usage for e in REGISTRY.values())}")


def available_methods() -> list[tuple[str, str]]:
    """``(usage, description)`` of every registered method."""
    return [(e.usage, e.description) for e in REGISTRY.values()]
