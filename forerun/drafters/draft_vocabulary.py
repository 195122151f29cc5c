"""A draft model's vocabulary cut to the target's most frequent tokens
(FR-Spec, Zhao et al. 2025).

A draft model's LM head over the whole vocabulary is a large part of its
step: the 0.5B Qwen's 151,936 int8 rows are 136 MB read per token, beside
about 200 MB for its 24 layers in 4-bit.  Most of those rows are tokens a
draft almost never needs to say.  A draft that computes logits only for the
``N`` most frequent tokens reads ``N`` rows; a token outside them is never
drafted, which costs acceptance only where the target says such a token.

It stays lossless: the draft proposes tokens of the target's vocabulary and
the target verifies them.  Sampled drafts have probability 0 outside the
cut vocabulary, which the acceptance rule accounts for like any other draft
distribution.

The frequency order is counted on text (:mod:`forerun.corpus.token_frequency`)
and kept in a file: a tensor ``order`` (token ids, most frequent first,
int32) and metadata naming what was counted.  The ids a draft vocabulary
holds are kept sorted, so ``ids[i]`` is the target id of draft index ``i``;
``d2t`` writes the same map as EAGLE-3's offsets (``target = i + d2t[i]``).
An engine with ``capabilities.output_vocabulary`` computes a draft's logits
from those rows of its head only (``restrict_output``).

Not on by default: counted on the Python sources and documents any
installation holds, the 32k most frequent tokens cover 84% of what the
1.5B Qwen target says on the bench's prompts (96% on code, 68% on
translation), which costs the 0.5B draft more agreement (0.82 to 0.70)
than its 26% cheaper step gains back (``benchmarks/draft_acceptance.py``,
``benchmarks/draft_step_cost.py``).  It needs counts of text like the
model's own answers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from forerun.errors import ConfigError, ModelFormatError
from forerun.machine.output_files import written_whole


@dataclass(frozen=True, eq=False)
class DraftVocabulary:
    """The target ids a draft may propose: ``ids``, sorted and distinct,
    each below ``target_size``."""

    ids: torch.Tensor
    target_size: int

    def __post_init__(self) -> None:
        ids = self.ids
        if ids.dtype != torch.long or ids.dim() != 1 or ids.numel() == 0:
            raise ConfigError("a draft vocabulary's ids must be a non-empty 1-D int64 tensor")
        if bool((ids[1:] <= ids[:-1]).any()):
            raise ConfigError("a draft vocabulary's ids must be sorted and distinct")
        if int(ids[0]) < 0 or int(ids[-1]) >= self.target_size:
            raise ConfigError(f"a draft vocabulary holds ids outside the target's vocabulary "
                              f"0..{self.target_size - 1}")

    @property
    def size(self) -> int:
        return self.ids.numel()

    @property
    def d2t(self) -> torch.Tensor:
        """EAGLE-3's map: ``target id = i + d2t[i]`` for draft index ``i``."""
        return self.ids - torch.arange(self.size)

    def t2d(self) -> torch.Tensor:
        """A bool ``[target_size]`` mask of the target ids the draft holds."""
        mask = torch.zeros(self.target_size, dtype=torch.bool)
        mask[self.ids] = True
        return mask


def vocabulary_from_order(order: Sequence[int], size: int, target_size: int,
                          always: Iterable[int] = ()) -> DraftVocabulary:
    """The ``size`` first ids of the frequency ``order`` that the target
    has, plus the ids ``always`` (its end-of-sequence and chat markers),
    which count within ``size``."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigError(f"a draft vocabulary's size must be a positive integer, got {size!r}")
    must = [int(i) for i in dict.fromkeys(always) if 0 <= int(i) < target_size]
    chosen = dict.fromkeys(must)
    for i in order:
        if len(chosen) >= max(size, len(must)):
            break
        if 0 <= int(i) < target_size:
            chosen[int(i)] = None
    return DraftVocabulary(torch.tensor(sorted(chosen), dtype=torch.long), target_size)


def read_order(path: Path) -> tuple[list[int], dict[str, str]]:
    """A frequency order file: the ids, most frequent first, and its
    metadata; a damaged file is a :class:`ModelFormatError` naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            meta = dict(f.metadata() or {})
        order = load_file(str(path))["order"]
    except (SafetensorError, OSError, KeyError, ValueError) as exc:
        raise ModelFormatError(f"{path} is not a draft vocabulary order file ({exc}); "
                               f"reinstall forerun or count it again") from None
    if order.dim() != 1 or order.dtype != torch.int32:
        raise ModelFormatError(f"{path}: 'order' must be a 1-D int32 tensor")
    return order.tolist(), meta


def write_order(path: Path, order: Sequence[int], metadata: dict[str, str]) -> None:
    """Write a frequency order file (see the module's text) whole."""
    from safetensors.torch import save_file

    tensor = torch.tensor(list(order), dtype=torch.int32)
    with written_whole(path) as tmp:
        save_file({"order": tensor}, str(tmp), metadata=metadata)
