"""Decoder wrappers for the tests of asynchronous drafting: a draft model
that is slow by random amounts, one that fails on a chosen feed, one that
waits at a gate, and one whose drafts tell which context they came from."""

from __future__ import annotations

import random
import threading
import time
import zlib

import torch

from forerun.protocol.decoder import ForwardOutput
from table_decoders import PERIOD, TableDecoder


class _Wrapper:
    """Delegates everything but ``feed`` to ``inner``."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


class DelayedDecoder(_Wrapper):
    """Sleeps a random ``0 .. max_delay`` seconds (from its own seeded
    generator) before every feed: thread timing that changes from run to run."""

    def __init__(self, inner, max_delay: float = 0.002, seed: int = 0) -> None:
        super().__init__(inner)
        self.max_delay = max_delay
        self.rng = random.Random(seed)

    def feed(self, tokens, **kwargs):
        time.sleep(self.rng.random() * self.max_delay)
        return self.inner.feed(tokens, **kwargs)


class FailingDecoder(_Wrapper):
    """Raises ``error`` from the ``fail_at``-th feed on (counting from 1) while
    ``armed``, without feeding anything."""

    def __init__(self, inner, fail_at: int, error: BaseException) -> None:
        super().__init__(inner)
        self.fail_at, self.error = fail_at, error
        self.armed = True
        self.feeds = 0

    def feed(self, tokens, **kwargs):
        self.feeds += 1
        if self.armed and self.feeds >= self.fail_at:
            raise self.error
        return self.inner.feed(tokens, **kwargs)


class GatedDecoder(_Wrapper):
    """While ``armed``, every feed sets ``entered`` and then waits for
    ``gate``; ``started`` counts the feeds begun."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.armed = False
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.started = 0

    def feed(self, tokens, **kwargs):
        self.started += 1
        if self.armed:
            self.entered.set()
            self.gate.wait()
        return self.inner.feed(tokens, **kwargs)


class ContextDraft(TableDecoder):
    """A greedy draft model whose token after a context depends on the whole
    context, through a hash of it: after most contexts the target's own
    greedy choice (so drafts are often accepted), after the others a token
    picked by the hash.  A draft token at position ``p`` thus tells which
    context it was drafted from: :meth:`choice` of the context it claims."""

    def __init__(self, target_table: torch.Tensor, agree: int = 6) -> None:
        super().__init__(target_table)
        self.target_choice = target_table.argmax(dim=-1)    # [3, V]
        self.agree = agree                                  # out of 10

    def choice(self, context) -> int:
        h = zlib.crc32(str(list(context)).encode())
        if h % 10 < self.agree:
            return int(self.target_choice[(len(context) - 1) % PERIOD, context[-1]])
        return (h // 10) % self.vocab_size

    def feed(self, tokens, *, last_only=False, return_hidden=False):
        start = len(self.tokens)
        super().feed(tokens, last_only=last_only, return_hidden=return_hidden)
        positions = [start + len(tokens) - 1] if last_only else range(start, start + len(tokens))
        rows = torch.zeros(len(positions), self.vocab_size)
        for i, p in enumerate(positions):
            rows[i, self.choice(self.tokens[:p + 1])] = 10.0
        return ForwardOutput(rows)


class FeedRecorder(TableDecoder):
    """A TableDecoder that records ``(position, tokens, last_only)`` of every
    feed, and the thread counts it is set to (``threads`` starts at 2)."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__(table)
        self.log: list[tuple[int, list[int], bool]] = []
        self.threads = 2
        self.thread_calls: list[tuple[int, str]] = []

    def feed(self, tokens, *, last_only=False, return_hidden=False):
        self.log.append((len(self.tokens), [int(t) for t in tokens], last_only))
        return super().feed(tokens, last_only=last_only, return_hidden=return_hidden)

    def set_threads(self, n: int) -> None:
        self.thread_calls.append((n, threading.current_thread().name))
        self.threads = n
