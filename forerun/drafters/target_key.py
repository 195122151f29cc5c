"""The key of a target model in the caches of what heads train on (Medusa's
and EAGLE's features): its name, its engine settings and a few of its
weights, so that another model, format or engine never reads a cache entry
made for this one."""

from __future__ import annotations

import hashlib
import json

import torch


def model_key(decoder, name: str) -> str:
    """Identifies a base model for the cache: its name, its engine settings
    (weight format, dtype), its output layer's shape and a few of its
    weights."""
    layer = decoder.output_layer
    digest = hashlib.sha256(name.encode())
    shape = {"hidden": layer.hidden_size, "vocab": layer.vocab_size,
             "settings": {k: v for k, v in decoder.settings.key.items()
                          if k in ("engine", "weights", "dtype")}}
    digest.update(json.dumps(shape, sort_keys=True, default=str).encode())
    corner = layer.weight_rows(torch.arange(4))[:, :4]
    digest.update(str([float(x) for x in corner.reshape(-1)]).encode())
    safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in name)[:60]
    return f"{safe}-{digest.hexdigest()[:16]}"
