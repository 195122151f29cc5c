"""Tokenizers: text <-> token ids, chat templates and streaming detokenization."""

from forerun.tokenizer.gguf_tokenizer import SUPPORTED_PRE_TOKENIZERS, tokenizer_from_gguf_metadata
from forerun.tokenizer.hf_tokenizer import tokenizer_from_hf_folder
from forerun.tokenizer.stream import StreamDecoder
from forerun.tokenizer.tokenizer import Tokenizer

__all__ = [
    "SUPPORTED_PRE_TOKENIZERS",
    "StreamDecoder",
    "Tokenizer",
    "tokenizer_from_gguf_metadata",
    "tokenizer_from_hf_folder",
]
