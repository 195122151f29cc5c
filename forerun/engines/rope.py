"""Rotary position embeddings (RoPE), with the ``linear`` and ``llama3``
frequency scalings.  The layout is the Hugging Face one: the two rotated
halves of each head are its first and second half (``rotate_half``)."""

from __future__ import annotations

import math

import torch

from forerun.protocol.model_config import ModelConfig, rope_scaling_type


def inverse_frequencies(config: ModelConfig, *, local: bool = False) -> torch.Tensor:
    """Per-pair rotation frequencies, float32 ``[head_dim // 2]``: of the
    global layers, or with ``local`` of the local layers (their own base
    ``rope_local_theta``, never scaled: Gemma 3's)."""
    dim = config.head_dim
    theta = config.rope_local_theta if local and config.rope_local_theta else config.rope_theta
    inv_freq = 1.0 / (theta ** (
        torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = {} if local else config.rope_scaling or {}
    kind = rope_scaling_type(scaling)
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        inv_freq = _llama3_scaling(inv_freq, scaling)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_context / low
    high_wavelen = old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """Computes cos/sin for arbitrary position ids and applies the rotation."""

    def __init__(self, config: ModelConfig, device: torch.device, *, local: bool = False
                 ) -> None:
        self.inv_freq = inverse_frequencies(config, local=local).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape ``[T, head_dim]`` for integer ``positions``."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[heads, T, head_dim]``) by the angles in cos/sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
