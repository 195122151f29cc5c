"""The Python API: :func:`load` a model, then generate with its :class:`Model`."""

from forerun.api.model import GenerationStream, Model, load

__all__ = ["GenerationStream", "Model", "load"]
