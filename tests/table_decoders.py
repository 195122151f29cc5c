"""Exact, fast Decoders over a fixed table of logits, for statistical tests of
decoding methods.

A :class:`TableDecoder` is a language model whose next-token logits depend
only on the position of the last token modulo 3 and on that token: the row
for a fed token ``t`` at position ``j`` is ``table[j % 3, t]``.  So the
distribution of the next ``n`` tokens after a prompt is known exactly
(:func:`joint_distribution`), and a decoding method that is lossless must
reproduce it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
import torch

from forerun.decoding.drafter import Draft
from forerun.decoding.sampling import SamplingParams, probabilities
from forerun.errors import CacheStateError, ContextLengthError, InvalidTokenError
from forerun.protocol.decoder import Capabilities, EngineSettings, ForwardOutput

PERIOD = 3


class TableDecoder:
    """The Decoder protocol over a ``[3, V, V]`` table of logits.

    A ``[3, V_in, V_out]`` table gives a model whose output layer is narrower
    or wider than the range of tokens it accepts (``vocab_size == V_out``):
    what a draft model with a padded vocabulary looks like.

    The context is a Python list: rollback truncates it, in O(1) amortised.
    The committed floor and the context limit are enforced with the same
    errors as forerun's engine.  Logits are fresh float32 tensors (never views
    of the table), one row per fed token.
    """

    def __init__(self, table: torch.Tensor, context_length: int = 1 << 20,
                 eos_token_ids: Sequence[int] = ()) -> None:
        table = torch.as_tensor(table, dtype=torch.float32)
        if table.dim() != 3 or table.shape[0] != PERIOD:
            raise ValueError(f"table must have shape [3, V_in, V_out], got {tuple(table.shape)}")
        self.table = table.clone()
        self._inputs = int(table.shape[1])     # token ids it accepts
        self._vocab = int(table.shape[2])      # width of its logits
        # Row (j % 3) * V_in + t of ``_flat`` is the logits after token t at position j.
        self._flat = self.table.reshape(PERIOD * self._inputs, self._vocab).contiguous()
        self._rows = list(self._flat.split(1))      # [1, V_out] views, one per row
        self._context_length = int(context_length)
        self._eos = tuple(int(e) for e in eos_token_ids)
        self.tokens: list[int] = []
        self._committed = 0
        # Counters, for tests that check how much a method feeds.
        self.feed_calls = 0
        self.fed_tokens = 0

    # -- facts -------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def context_length(self) -> int:
        return self._context_length

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def committed_length(self) -> int:
        return self._committed

    engine = "table"
    device = torch.device("cpu")
    # A tree forward is a lookup per row; no hidden states, no slot moves.
    capabilities = Capabilities(tree_masks=True)

    # Table lookups do not depend on grouping, nor on the context.
    verify_group = None
    probe_context = 40
    group_ceiling = None

    @property
    def settings(self) -> EngineSettings:
        return EngineSettings(engine="table", device="cpu", threads=1)

    # A table lookup runs on one thread, whatever it is told.
    threads = 1

    def set_threads(self, n: int) -> None:
        pass

    # -- forward -----------------------------------------------------------
    def _check(self, tokens: Sequence[int], return_hidden: bool) -> list[int]:
        if return_hidden:
            raise CacheStateError("TableDecoder has no hidden states")
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise CacheStateError("feed() needs at least one token")
        inputs = self._inputs
        for t in tokens:
            if not 0 <= t < inputs:
                raise InvalidTokenError(f"token ids must lie in 0..{inputs - 1}, got {t}")
        if len(self.tokens) + len(tokens) > self._context_length:
            raise ContextLengthError(
                f"{len(tokens)} tokens do not fit: the context holds {len(self.tokens)} "
                f"of {self._context_length} positions")
        return tokens

    def feed(self, tokens: Sequence[int], *, last_only: bool = False,
             return_hidden: bool = False) -> ForwardOutput:
        # The hot path of the statistical tests: checks kept cheap.
        if return_hidden:
            raise CacheStateError("TableDecoder has no hidden states")
        n = len(tokens)
        if n == 0:
            raise CacheStateError("feed() needs at least one token")
        if min(tokens) < 0 or max(tokens) >= self._inputs:
            raise InvalidTokenError(
                f"token ids must lie in 0..{self._inputs - 1}, got {list(tokens)}")
        start = len(self.tokens)
        if start + n > self._context_length:
            raise ContextLengthError(
                f"{n} tokens do not fit: the context holds {start} "
                f"of {self._context_length} positions")
        self.tokens.extend(int(t) for t in tokens)
        self.feed_calls += 1
        self.fed_tokens += n
        inputs = self._inputs
        if last_only or n == 1:
            return ForwardOutput(self._rows[((start + n - 1) % PERIOD) * inputs
                                            + int(tokens[-1])].clone())
        rows = [((start + i) % PERIOD) * inputs + int(t) for i, t in enumerate(tokens)]
        return ForwardOutput(self._flat[rows])

    def forward(self, tokens: Sequence[int], positions: Sequence[int] | torch.Tensor,
                attention_mask: torch.Tensor, *, return_hidden: bool = False
                ) -> ForwardOutput:
        """Tree-style forward: row ``i`` depends on ``positions[i]`` and
        ``tokens[i]`` only (the table looks at the last token), so the mask
        is checked for shape but does not change the logits."""
        tokens = self._check(tokens, return_hidden)
        pos = [int(p) for p in torch.as_tensor(positions).reshape(-1).tolist()]
        if len(pos) != len(tokens):
            raise CacheStateError(f"{len(tokens)} tokens need {len(tokens)} positions")
        mask = torch.as_tensor(attention_mask)
        t = len(tokens)
        if mask.dtype != torch.bool or tuple(mask.shape) != (t, len(self.tokens) + t):
            raise CacheStateError("attention_mask has the wrong dtype or shape")
        self.tokens.extend(tokens)
        self.feed_calls += 1
        self.fed_tokens += t
        rows = [(p % PERIOD) * self._inputs + tok for p, tok in zip(pos, tokens)]
        return ForwardOutput(self._flat[rows])

    # -- cache control -----------------------------------------------------
    def rollback(self, length: int) -> None:
        if not self._committed <= length <= len(self.tokens):
            raise CacheStateError(
                f"cannot roll back to length {length}: it must lie between the committed "
                f"length {self._committed} and the current length {len(self.tokens)}")
        del self.tokens[length:]

    def commit(self, length: int | None = None) -> None:
        length = len(self.tokens) if length is None else length
        if not self._committed <= length <= len(self.tokens):
            raise CacheStateError(
                f"cannot commit length {length}: it must lie between the committed "
                f"length {self._committed} and the current length {len(self.tokens)}")
        self._committed = length

    def reset(self) -> None:
        self.tokens = []
        self._committed = 0

    # -- reference ---------------------------------------------------------
    def next_logits(self, context: Sequence[int]) -> torch.Tensor:
        """The ``[V]`` logits after ``context`` (non-empty), without state."""
        return self.table[(len(context) - 1) % PERIOD, int(context[-1])].clone()



class SilentDrafter:
    """A chain drafter (:class:`~forerun.decoding.drafter.Drafter`) with
    nothing to propose, free and stateless, as prompt lookup is without a
    match; a test's drafter subclasses it and overrides what it needs."""

    name = "silent"

    def begin(self, prompt_ids):
        pass

    def propose(self, sequence, k, sampler):
        return Draft([])

    def observe(self, sequence, accepted):
        pass

    def settle(self, length):
        pass

    def step_seconds(self):
        return 0.0


class CountingDecoder:
    """Wraps any Decoder and records every ``feed``/``forward`` call (the
    tokens fed) and every ``rollback``, delegating everything else."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.feeds: list[list[int]] = []
        self.rollbacks: list[int] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.inner.eos_token_ids

    @property
    def context_length(self) -> int:
        return self.inner.context_length

    @property
    def length(self) -> int:
        return self.inner.length

    @property
    def committed_length(self) -> int:
        return self.inner.committed_length

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    @property
    def fed_tokens(self) -> int:
        return sum(len(f) for f in self.feeds)

    def feed(self, tokens, **kwargs):
        """``kwargs``: the Decoder's (``last_only``, ``return_hidden``,
        ``hidden_layers``), passed on as given."""
        self.feeds.append([int(t) for t in tokens])
        return self.inner.feed(tokens, **kwargs)

    def forward(self, tokens, positions, attention_mask, **kwargs):
        self.feeds.append([int(t) for t in tokens])
        return self.inner.forward(tokens, positions, attention_mask, **kwargs)

    def rollback(self, length: int) -> None:
        self.rollbacks.append(length)
        self.inner.rollback(length)

    def commit(self, length=None) -> None:
        self.inner.commit(length)

    def reset(self) -> None:
        self.inner.reset()


def step_probabilities(table_logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[3, V, V]`` float64: the processed distribution of the next token for
    every (position of the last token mod 3, last token)."""
    table = torch.as_tensor(table_logits, dtype=torch.float32)
    return probabilities(table, params).double()


def joint_distribution(table_logits: torch.Tensor, params: SamplingParams,
                       prompt: Sequence[int], n: int = 3) -> torch.Tensor:
    """The exact distribution of the next ``n`` tokens after ``prompt`` when
    each token is drawn from ``probabilities(logits, params)`` of a
    :class:`TableDecoder` over ``table_logits``.

    Returns float64 of shape ``[V] * n``: entry ``[x1, .., xn]`` is the
    probability of that continuation.  Every one of the ``V ** n`` sequences
    is enumerated.
    """
    if not prompt:
        raise ValueError("the prompt must not be empty")
    probs = step_probabilities(table_logits, params)
    vocab = probs.shape[-1]
    start = len(prompt)              # position of the first new token
    joint = torch.zeros([vocab] * n, dtype=torch.float64)
    for seq in itertools.product(range(vocab), repeat=n):
        p = 1.0
        last, pos = int(prompt[-1]), start - 1
        for x in seq:
            p *= float(probs[pos % PERIOD, last, x])
            if p == 0.0:
                break
            last, pos = x, pos + 1
        joint[seq] = p
    return joint


def chi_square_pvalue(counts, probs, min_expected: float = 5.0) -> tuple[float, str]:
    """Pearson's chi-square test of observed ``counts`` against the exact
    distribution ``probs`` (both flattened to one cell per outcome).

    Cells whose expected count is below ``min_expected`` are pooled into one
    cell (merged with the smallest other cell if the pool is still too
    small).  An outcome the distribution gives exactly zero probability that
    was observed makes the p-value 0.  Returns ``(p_value, description)``.
    """
    import numpy as np
    from scipy import stats

    counts = np.asarray(counts, dtype=np.float64).reshape(-1)
    probs = np.asarray(torch.as_tensor(probs, dtype=torch.float64).reshape(-1))
    total = counts.sum()
    if total <= 0:
        raise ValueError("no observations")
    probs = probs / probs.sum()
    impossible = (probs == 0) & (counts > 0)
    if impossible.any():
        cells = np.nonzero(impossible)[0].tolist()
        return 0.0, f"{int(counts[impossible].sum())} draws of impossible outcomes {cells[:8]}"
    expected = probs * total
    keep = expected >= min_expected
    obs = list(counts[keep])
    exp = list(expected[keep])
    small = (~keep) & (probs > 0)
    if small.any():
        pooled_obs, pooled_exp = counts[small].sum(), expected[small].sum()
        if pooled_exp >= min_expected or not exp:
            obs.append(pooled_obs)
            exp.append(pooled_exp)
        else:
            j = int(np.argmin(exp))
            obs[j] += pooled_obs
            exp[j] += pooled_exp
    if len(obs) < 2:
        return 1.0, "a single cell: nothing to test"
    obs_a, exp_a = np.array(obs), np.array(exp)
    result = stats.chisquare(obs_a, exp_a * (obs_a.sum() / exp_a.sum()))
    return float(result.pvalue), (f"chi2={result.statistic:.1f} with {len(obs) - 1} dof "
                                  f"over {int(total)} draws")


@pytest.fixture(autouse=True)
def single_thread():
    """Import into a test module to run its tests with one intra-op thread:
    they run many operations on tiny tensors, where threads only add
    synchronisation (very slow on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class ClockedWrapper(CountingDecoder):
    """Wraps any Decoder (a TableDecoder, a tiny real model) so that its
    feeds and forwards advance ``clock.now`` by ``cost(tokens)`` seconds
    (default: 10 ms plus 1 ms per token): code whose choices depend on
    measured times (monkeypatch its modules' ``time``) then chooses the same
    way on any machine, however busy."""

    def __init__(self, inner, clock, cost=None) -> None:
        super().__init__(inner)
        self.clock = clock
        self.cost = cost or (lambda tokens: 0.010 + 0.001 * len(tokens))

    def feed(self, tokens, **kwargs):
        self.clock.now += self.cost(list(tokens))
        return super().feed(tokens, **kwargs)

    def forward(self, tokens, positions, attention_mask, **kwargs):
        self.clock.now += self.cost(list(tokens))
        return super().forward(tokens, positions, attention_mask, **kwargs)
