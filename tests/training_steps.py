"""What the tests of a drafter's training hold a bfloat16 step to: a
step's loss and gradient beside float32's, within
:data:`~forerun.drafters.training_arithmetic.COMPUTE_TOLERANCE`."""

from __future__ import annotations

import torch

from forerun.drafters.training_arithmetic import COMPUTE_TOLERANCE


def gradient(model: torch.nn.Module) -> torch.Tensor:
    """The parameters' gradient, flat (those that have one)."""
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def within_tolerance(a: tuple[float, torch.Tensor], b: tuple[float, torch.Tensor]) -> bool:
    """Whether step ``a`` (loss, gradient) is step ``b``'s within the
    tolerance: the loss relatively, the gradient by its direction."""
    (la, ga), (lb, gb) = a, b
    cos = float(torch.nn.functional.cosine_similarity(ga, gb, dim=0))
    return (abs(la - lb) <= COMPUTE_TOLERANCE["loss"] * abs(lb)
            and cos >= COMPUTE_TOLERANCE["gradient_cosine"])
