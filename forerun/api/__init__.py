"""The Python API: :func:`load` a model, then generate with its :class:`Model`."""

from forerun.api.loader import load
from forerun.api.model import GenerationStream, Model

__all__ = ["GenerationStream", "Model", "load"]
