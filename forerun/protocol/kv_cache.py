"""A preallocated key/value cache for one sequence.

Storage for every layer is allocated once, for ``capacity`` positions.  The
cache only moves a length pointer: appending writes into the next free slots
(no concatenation), and rollback lowers the pointer (no copy, no
reallocation).  A *committed* floor protects accepted text from rollback.
"""

from __future__ import annotations

from pathlib import Path

import torch

from forerun.errors import CacheStateError, ContextLengthError, ModelNotFoundError
from forerun.protocol.cache_positions import CachePositions

PAYLOAD_FORMAT = "forerun-kv-cache/1"


class KVCache(CachePositions):
    """Keys and values for ``n_layers`` layers of one sequence.

    ``keys`` and ``values`` have shape ``[n_layers, n_kv_heads, capacity,
    head_dim]``; slot ``s`` of layer ``l`` is ``keys[l, :, s]``.  Slots below
    :attr:`length` are valid, the rest is scratch space.

    The storage is allocated uninitialized: every slot is written before a
    forward reads it, so the memory of a long context is touched only as it
    fills (zeroed, the 4,096 positions of the 1.5B's and its 0.5B draft's
    caches held 0.3 GB from the start).
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int,
                 *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        if min(n_layers, n_kv_heads, head_dim, capacity) <= 0:
            raise CacheStateError(
                f"KV cache dimensions must be positive, got n_layers={n_layers}, "
                f"n_kv_heads={n_kv_heads}, head_dim={head_dim}, capacity={capacity}")
        super().__init__(capacity)
        shape = (n_layers, n_kv_heads, capacity, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)

    # -- shape -----------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return self.keys.shape[0]

    @property
    def n_kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def head_dim(self) -> int:
        return self.keys.shape[3]

    # -- writing ---------------------------------------------------------
    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k`` and ``v`` (``[n_kv_heads, T, head_dim]``) of ``layer`` in
        slots ``start .. start+T-1``.  Does not move :attr:`length`; call
        :meth:`advance` once every layer is written."""
        t = k.shape[1]
        self.keys[layer, :, start:start + t] = k
        self.values[layer, :, start:start + t] = v

    def layer(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (no copy) of the keys and values of slots ``0 .. end-1``."""
        return self.keys[layer, :, :end], self.values[layer, :, :end]

    # -- rollback and commit: CachePositions ------------------------------
    def snapshot(self) -> int:
        """A marker to :meth:`rollback` to later: the current length."""
        return self._length

    def move(self, src_slots: torch.Tensor, dst_start: int) -> None:
        """Copy the slots ``src_slots`` (ascending, each >= ``dst_start``) to
        the contiguous slots starting at ``dst_start`` in every layer, and set
        the length to just after them.  Tree verification uses it to keep the
        accepted path: a copy of the path's length, nothing else.

        Raises :class:`CacheStateError`, changing nothing, unless
        ``committed <= dst_start``, ``dst_start + n <= length`` and the source
        slots are strictly ascending within ``dst_start .. length-1`` (a slot
        outside would copy scratch space, or wrap around if negative).  The
        check reads ``src_slots`` on the host: pass a CPU tensor to avoid a
        device sync."""
        n = int(src_slots.numel())
        if dst_start < self._committed or dst_start + n > self._length:
            raise CacheStateError(
                f"cannot move {n} slots to {dst_start}: the committed length is "
                f"{self._committed} and the current length {self._length}")
        if n:
            slots = src_slots.detach().reshape(-1).cpu()
            if (int(slots[0]) < dst_start or int(slots[-1]) >= self._length
                    or (n > 1 and not bool((slots[1:] > slots[:-1]).all()))):
                raise CacheStateError(
                    f"cannot move slots {slots.tolist()} to {dst_start}: source slots "
                    f"must be strictly ascending and lie in {dst_start}..{self._length - 1}")
        src_slots = src_slots.to(self.keys.device)
        dst = torch.arange(dst_start, dst_start + n, device=self.keys.device)
        if not torch.equal(src_slots, dst):
            self.keys[:, :, dst] = self.keys[:, :, src_slots]
            self.values[:, :, dst] = self.values[:, :, src_slots]
        del self._prefilled[dst_start + n:]
        self._length = dst_start + n

    # -- persistence -----------------------------------------------------
    def export(self) -> dict:
        """A payload holding the valid slots and the shape they belong to.
        :meth:`restore` takes it back; :meth:`save` writes it to a file."""
        return {
            "format": PAYLOAD_FORMAT,
            "n_layers": self.n_layers,
            "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "length": self._length,
            "committed": self._committed,
            "dtype": str(self.keys.dtype).removeprefix("torch."),
            "keys": self.keys[:, :, :self._length].detach().cpu().clone(),
            "values": self.values[:, :, :self._length].detach().cpu().clone(),
        }

    def restore(self, payload: dict) -> None:
        """Replace this cache's contents with an exported payload, after
        checking that it belongs to a model of the same shape."""
        if not isinstance(payload, dict) or payload.get("format") != PAYLOAD_FORMAT:
            raise CacheStateError(
                f"not a forerun KV cache payload (expected format {PAYLOAD_FORMAT!r})")
        for key in ("n_layers", "n_kv_heads", "head_dim"):
            mine = getattr(self, key)
            if payload.get(key) != mine:
                raise CacheStateError(
                    f"KV cache payload has {key}={payload.get(key)} but this model "
                    f"has {key}={mine}: it was saved from a different model")
        length = int(payload["length"])
        committed = int(payload.get("committed", 0))
        keys, values = payload["keys"], payload["values"]
        expected = (self.n_layers, self.n_kv_heads, length, self.head_dim)
        if tuple(keys.shape) != expected or tuple(values.shape) != expected:
            raise CacheStateError(
                f"KV cache payload tensors have shapes {tuple(keys.shape)} and "
                f"{tuple(values.shape)}, expected {expected}")
        if length > self.capacity:
            raise ContextLengthError(
                f"the saved cache holds {length} positions but this model's context "
                f"holds {self.capacity}: load the model with context_length >= {length}")
        if not 0 <= committed <= length:
            raise CacheStateError(f"payload committed length {committed} is outside 0..{length}")
        # A restored cache is no prefill's (see set_prefilled); the ledger
        # goes before the slots it describes are overwritten.
        self._prefilled.clear()
        self.keys[:, :, :length] = keys.to(self.keys)
        self.values[:, :, :length] = values.to(self.values)
        self._length = length
        self._committed = committed

    def save(self, path: str | Path, extra: dict[str, str] | None = None) -> None:
        """Write :meth:`export` to a safetensors file."""
        from safetensors.torch import save_file

        payload = self.export()
        meta = {k: str(v) for k, v in payload.items() if k not in ("keys", "values")}
        meta.update(extra or {})
        save_file({"keys": payload["keys"].contiguous(),
                   "values": payload["values"].contiguous()}, str(path), metadata=meta)

    @staticmethod
    def load_payload(path: str | Path) -> tuple[dict, dict[str, str]]:
        """Read a file written by :meth:`save`: the payload and all metadata."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise ModelNotFoundError(f"KV cache file {path} does not exist")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = dict(f.metadata() or {})
                keys, values = f.get_tensor("keys"), f.get_tensor("values")
        except Exception as exc:  # safetensors raises several types
            raise CacheStateError(f"{path} is not a readable KV cache file: {exc}") from exc
        payload: dict = {"format": meta.get("format"), "keys": keys, "values": values}
        try:
            for key in ("n_layers", "n_kv_heads", "head_dim", "length", "committed"):
                payload[key] = int(meta[key])
        except (KeyError, ValueError) as exc:
            raise CacheStateError(f"{path} lacks KV cache metadata {exc}") from exc
        return payload, meta
