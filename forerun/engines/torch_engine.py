"""forerun's PyTorch engine: a :class:`~forerun.decoder.Decoder` over
:class:`~forerun.engines.transformer.Transformer` and a preallocated
:class:`~forerun.kv_cache.KVCache`."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from ..decoder import ForwardOutput
from ..errors import CacheStateError, ContextLengthError, InvalidTokenError
from ..kv_cache import KVCache
from .transformer import Transformer


class TorchDecoder:
    """Implements the Decoder protocol; see :mod:`forerun.decoder` for the
    contract of each method."""

    def __init__(self, model: Transformer, context_length: int,
                 eos_token_ids: Sequence[int] = ()) -> None:
        self.model = model
        self.cache: KVCache = model.new_cache(context_length)
        self._eos = tuple(int(e) for e in eos_token_ids)

    def fork(self) -> "TorchDecoder":
        """A second decoder over the same weights with its own, empty cache
        (a model drafting for itself, or a second conversation)."""
        return TorchDecoder(self.model, self.context_length, self._eos)

    # -- facts -------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def context_length(self) -> int:
        return self.cache.capacity

    @property
    def length(self) -> int:
        return self.cache.length

    @property
    def committed_length(self) -> int:
        return self.cache.committed

    @property
    def has_hidden_states(self) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        return self.model.device

    # -- forward -----------------------------------------------------------
    def _tokens(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(-1)
        if ids.numel() == 0:
            raise CacheStateError("feed() needs at least one token")
        vocab = self.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise InvalidTokenError(
                f"token ids must lie in 0..{vocab - 1}, got {ids.tolist()[:8]}...")
        if self.length + ids.numel() > self.context_length:
            raise ContextLengthError(
                f"{ids.numel()} tokens do not fit: the context holds "
                f"{self.length} of {self.context_length} positions. Use a shorter input "
                f"or load the model with a larger context_length.")
        return ids

    def feed(self, tokens: Sequence[int] | torch.Tensor, *, last_only: bool = False,
             return_hidden: bool = False) -> ForwardOutput:
        ids = self._tokens(tokens)
        start = self.length
        positions = torch.arange(start, start + ids.numel(), device=self.device)
        rows = slice(-1, None) if last_only else None
        logits, hidden = self.model.forward(ids, positions, self.cache, None, logits_rows=rows)
        return ForwardOutput(logits, hidden if return_hidden else None)

    def forward(self, tokens: Sequence[int] | torch.Tensor,
                positions: Sequence[int] | torch.Tensor, attention_mask: torch.Tensor,
                *, return_hidden: bool = False) -> ForwardOutput:
        ids = self._tokens(tokens)
        t = ids.numel()
        pos = torch.as_tensor(positions, dtype=torch.long, device=self.device).reshape(-1)
        if pos.numel() != t:
            raise CacheStateError(f"{t} tokens need {t} positions, got {pos.numel()}")
        mask = torch.as_tensor(attention_mask, device=self.device)
        if mask.dtype != torch.bool or tuple(mask.shape) != (t, self.length + t):
            raise CacheStateError(
                f"attention_mask must be bool of shape {(t, self.length + t)}, got "
                f"{mask.dtype} {tuple(mask.shape)}")
        if not bool(mask.any(dim=1).all()):
            raise CacheStateError("every row of attention_mask must allow at least one slot")
        logits, hidden = self.model.forward(ids, pos, self.cache, mask)
        return ForwardOutput(logits, hidden if return_hidden else None)

    # -- cache control -----------------------------------------------------
    def rollback(self, length: int) -> None:
        self.cache.rollback(length)

    def commit(self, length: int | None = None) -> None:
        self.cache.commit(length)

    def reset(self) -> None:
        self.cache.reset()

    def keep_slots(self, slots: Sequence[int] | torch.Tensor, start: int) -> None:
        """Move cache ``slots`` to contiguous slots from ``start`` and drop the
        rest (tree verification keeps its accepted path with this)."""
        self.cache.move(torch.as_tensor(slots, dtype=torch.long), start)

    def save_cache(self, path: str | Path) -> None:
        """Write the cache to a file that :meth:`load_cache` reads back."""
        self.cache.save(path)

    def load_cache(self, path: str | Path) -> None:
        """Restore a cache written by :meth:`save_cache` for this model."""
        payload, _ = KVCache.load_payload(path)
        self.cache.restore(payload)
