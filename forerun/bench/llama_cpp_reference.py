"""llama-cpp-python's own ``Llama``, set up like forerun's llama.cpp engine:
the peer row of ``forerun bench --peer-llama-cpp``, and the reference that
tests and ``benchmarks/llama_cpp_overhead.py`` compare the engine with.
Nothing in forerun's decoding uses it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from forerun.engines.llama_cpp_engine import (
    DEFAULT_BATCH,
    DEFAULT_CACHE_TYPE_K,
    DEFAULT_CACHE_TYPE_V,
    cache_type_id,
    default_extra_buffers,
    import_llama_cpp,
)


def reference_llama(path: str | Path, *, context_length: int, n_threads: int | None = None,
                    n_batch: int = DEFAULT_BATCH, n_ubatch: int = DEFAULT_BATCH,
                    flash_attn: bool = True, cache_type_k: str = DEFAULT_CACHE_TYPE_K,
                    cache_type_v: str = DEFAULT_CACHE_TYPE_V, extra_buffers: bool | None = None,
                    vocab_only: bool = False) -> Any:
    """A llama-cpp-python ``llama_cpp.Llama`` over ``path`` set up like a
    :class:`LlamaCppDecoder` with the same options (context, threads, batch
    and micro-batch sizes, flash attention, cache types, weight buffers),
    so that both
    compute the same logits: what tests and benchmarks compare the engine
    with.  ``Llama`` has no argument for the weight buffers, so its model
    parameters are patched while it loads."""
    lc = import_llama_cpp()
    import llama_cpp.llama_cpp as low

    if extra_buffers is None:
        extra_buffers = default_extra_buffers()
    if n_threads is None:
        n_threads = torch.get_num_threads()
    original = low.llama_model_default_params

    def params() -> Any:
        p = original()
        p.use_extra_bufts = bool(extra_buffers)
        return p

    low.llama_model_default_params = params
    try:
        return lc.Llama(model_path=str(path), n_ctx=context_length, n_batch=n_batch,
                        n_ubatch=n_ubatch, n_threads=n_threads, n_threads_batch=n_threads,
                        flash_attn=flash_attn, type_k=cache_type_id("cache_type_k", cache_type_k),
                        type_v=cache_type_id("cache_type_v", cache_type_v),
                        vocab_only=vocab_only, verbose=False)
    finally:
        low.llama_model_default_params = original
