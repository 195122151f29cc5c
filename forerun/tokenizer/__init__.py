"""Tokenizers: text <-> token ids, chat templates and streaming detokenization."""

from .gguf_tokenizer import SUPPORTED_PRE_TOKENIZERS, tokenizer_from_gguf_metadata
from .hf_tokenizer import tokenizer_from_hf_folder
from .stream import StreamDecoder
from .tokenizer import Tokenizer

__all__ = [
    "SUPPORTED_PRE_TOKENIZERS",
    "StreamDecoder",
    "Tokenizer",
    "tokenizer_from_gguf_metadata",
    "tokenizer_from_hf_folder",
]
