"""Edits of a JSON document for the fuzz tests of the files forerun reads:
every place in it (:func:`places`), any value of any type to put there or a
removal (:func:`edit_values`), and the document so edited (:func:`edited`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

REMOVE = "<remove>"
KEEP = "<keep>"


def places(value: Any, at: tuple = ()) -> Iterator[tuple]:
    """The paths (keys and indices) of every value inside ``value``."""
    if at:
        yield at
    if isinstance(value, dict):
        for k, v in value.items():
            yield from places(v, at + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from places(v, at + (i,))


def edit_values(*, keep: bool = False):
    """A Hypothesis strategy: a value of any JSON type, or :data:`REMOVE`
    (and :data:`KEEP`, leaving the place as it is, with ``keep``)."""
    from hypothesis import strategies as st

    return st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40),
                     st.floats(allow_nan=True), st.text(max_size=8),
                     st.lists(st.integers(-5, 5), max_size=3),
                     st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
                     st.just(REMOVE), *([st.just(KEEP)] if keep else []))


def edited(document: Any, where: tuple, value: Any) -> Any:
    """A copy of ``document`` with ``value`` at ``where`` (removed for
    :data:`REMOVE`, left for :data:`KEEP`)."""
    data = json.loads(json.dumps(document))
    parent = data
    for key in where[:-1]:
        parent = parent[key]
    if value == REMOVE:
        parent.pop(where[-1])
    elif value != KEEP:
        parent[where[-1]] = value
    return data
