"""The arithmetic a drafter's training runs its forwards in: float32, or
bfloat16 under autocast (the matrix products in bfloat16, the parameters,
the optimiser and the loss's softmax in float32).  Which is faster depends
on the CPU and the shapes, so neither is chosen for the user: on a Zen 4
(AVX512-BF16) a Medusa step took 0.39 of float32's time and an EAGLE step
0.70, on a Xeon with AVX512-BF16 and no AMX an EAGLE step 1.4 to 1.7 times
float32's (docs/drafters.md, docs/training-eagle.md)."""

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
