"""forerun: faster local LLM generation with lossless speculative decoding."""

from .api import GenerationStream, Model, load
from .errors import ForerunError
from .generation.result import GenerationResult, GenerationStats

__all__ = ["load", "Model", "GenerationStream", "GenerationResult", "GenerationStats",
           "ForerunError"]
__version__ = "0.1.0"
