"""The prefill every decoding method starts with: the prompt into the
target's cache, and the logits of its last position.

Every method prefills through :func:`prefill`, so all of them compute a
prompt's cache with the same forwards (an engine may compute a prefill with
other kernels than a verification; see :meth:`forerun.protocol.decoder.Decoder.feed`),
and all of them reuse a cached prefix the same exact way
(:mod:`forerun.protocol.prefix_reuse`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from forerun.decoding.stats import GenerationStats
from forerun.errors import CacheStateError
from forerun.protocol.decoder import Decoder, ForwardOutput
from forerun.protocol.prefix_reuse import PrefixReuse, reusable_length


def prefill(target: Decoder, prompt_ids: Sequence[int], *, return_hidden: bool = False,
            hidden_layers: Sequence[int] = (),
            stats: GenerationStats | None = None) -> ForwardOutput:
    """Make ``target``'s cache hold exactly ``prompt_ids``, committed, and
    return the output of the last prompt position (``[1, V]`` logits, and the
    ``[1, H]`` hidden state when ``return_hidden``).  With ``hidden_layers``,
    its ``layers`` are the states of every position the prefill computed
    (the prompt's last ones: a prefix taken from the cache is not computed).

    On an engine with :class:`~forerun.protocol.prefix_reuse.PrefixReuse`, the cache
    keeps the leading whole prefill blocks it already holds for this prompt
    (:func:`~forerun.protocol.prefix_reuse.reusable_length`; only when the engine's
    ``reuse_prefixes`` is on) and the rest is fed in
    ``last_only`` feeds of the blocks ``[kB, (k+1)B)``, the last one possibly
    partial; each whole block joins the ledger.  A warm prefill thus runs the
    very forwards a cold one runs after the kept blocks.  Where the engine's
    positions are exact (``exact_positions``), the cache keeps any prefix of
    its ledger (every position fed in order, a previous answer's included),
    and the rest is fed in blocks of ``B`` from there: each position is
    computed as any feed computes it.  Other decoders get
    one ``last_only`` feed of the whole prompt after a reset.

    ``stats``: where to record how many prompt positions came from the
    cache (``reused_prompt_tokens``).
    """
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise CacheStateError("the prefill needs at least one prompt token")
    asked: dict[str, Any] = {"hidden_layers": tuple(hidden_layers)} if hidden_layers else {}
    if not isinstance(target, PrefixReuse):
        target.reset()
        out = target.feed(prompt, last_only=True, return_hidden=return_hidden, **asked)
        target.commit()
        return out
    block = target.prefill_block
    keep = (reusable_length(target.prefilled_tokens, prompt, target.reuse_unit)
            if target.reuse_prefixes else 0)
    target.keep_prefix(keep)
    if stats is not None:
        stats.reused_prompt_tokens = keep
    last: ForwardOutput | None = None
    states: list[torch.Tensor] = []
    for start in range(keep, len(prompt), block):
        chunk = prompt[start:start + block]
        last = target.feed(chunk, last_only=True, return_hidden=return_hidden, **asked)
        if last.layers is not None:
            states.append(last.layers)
        if len(chunk) == block:
            target.mark_prefilled(chunk)
    target.commit()
    assert last is not None   # keep < len(prompt) (reusable_length): one feed at least
    if len(states) > 1:
        last.layers = torch.cat(states)
    return last
