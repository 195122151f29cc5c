"""The arithmetic a drafter's training runs its forwards in: float32, or
bfloat16 under autocast (the matrix products in bfloat16, the parameters,
the optimiser and the loss's softmax in float32).  A CPU with AVX512-BF16
(Zen 4, Zen 5) or AMX runs bfloat16 products at about twice float32's rate;
one without them emulates them, and float32 is faster there."""

from __future__ import annotations

import torch

from forerun.errors import ConfigError

#: the trainers' arithmetic choices (``compute`` in their settings)
COMPUTE = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: what the tests hold a bfloat16 step to beside a float32 one on a tiny
#: model: the loss within 2%, the gradient's direction within cos 0.99
COMPUTE_TOLERANCE = {"loss": 0.02, "gradient_cosine": 0.99}


def check_compute(compute: str) -> None:
    """Refuse an arithmetic that is not one of :data:`COMPUTE`."""
    if compute not in COMPUTE:
        raise ConfigError(f"compute must be one of {', '.join(COMPUTE)}, got {compute!r}")


def autocast(device_type: str, compute: str):
    """The forwards' arithmetic context for ``compute``."""
    return torch.autocast(device_type, dtype=COMPUTE[compute], enabled=compute != "float32")
