"""llama-cpp-python's own ``Llama``, two ways: as it comes
(:func:`stock_llama`, the peer rows of ``forerun bench --peer-llama-cpp``)
and set up like forerun's llama.cpp engine (:func:`reference_llama`, the
``llamacpp-matched`` row, and the reference that tests and
``benchmarks/llama_cpp_overhead.py`` compare the engine with).  Nothing in
forerun's decoding uses them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from forerun.engines.llama_cpp_engine import (
    CACHE_TYPES,
    DEFAULT_BATCH,
    DEFAULT_CACHE_TYPE_K,
    DEFAULT_CACHE_TYPE_V,
    cache_type_id,
    cpu_has_amx,
    default_extra_buffers,
    import_llama_cpp,
)


def machine_cores() -> int:
    """The CPU cores this process may run on: its affinity count where the
    system says, else ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


@contextmanager
def _weight_buffers(extra_buffers: bool) -> Iterator[None]:
    """While it lasts, a ``Llama`` loads with llama.cpp's extra weight
    buffers on or off: ``Llama`` has no argument for them, so its model
    parameters are patched."""
    import llama_cpp.llama_cpp as low

    original = low.llama_model_default_params

    def params() -> Any:
        p = original()
        p.use_extra_bufts = bool(extra_buffers)
        return p

    low.llama_model_default_params = params
    try:
        yield
    finally:
        low.llama_model_default_params = original


def stock_llama(path: str | Path, *, context_length: int, draft_model: Any = None,
                flash_attn: bool = False) -> Any:
    """llama-cpp-python's ``Llama`` over ``path`` with its own defaults: only
    the context (``n_ctx``), the threads (``n_threads`` and
    ``n_threads_batch``: this machine's cores, where ``Llama`` would take
    half of them for decoding) and ``verbose=False`` are given; its batch
    sizes, attention (flash attention off), f16 keys and values and weight
    buffers are its own.

    ``draft_model``: a llama-cpp-python draft model (prompt lookup); with
    one, ``logits_all=True`` is given too, without which llama-cpp-python
    (0.3.x) keeps room for only ``n_batch`` positions' logits and fails
    once prompt and answer pass them.  With a draft model ``Llama``
    computes every position's logits either way.

    ``flash_attn``: llama.cpp's flash attention on (its other setting a
    user may pick), all else as above.

    One exception to the defaults: on a CPU that advertises AMX the extra
    weight buffers are off, as in forerun's engine
    (:func:`~forerun.engines.llama_cpp_engine.default_extra_buffers`):
    llama.cpp's AMX kernels crash the process in virtual machines that
    advertise AMX (on a Xeon whose tiles forerun's own kernels use, too),
    which would end the whole run."""
    lc = import_llama_cpp()
    cores = machine_cores()
    options: dict[str, Any] = {}
    if draft_model is not None:
        options.update(draft_model=draft_model, logits_all=True)
    if flash_attn:
        options.update(flash_attn=True)
    with _weight_buffers(False) if cpu_has_amx() else nullcontext():
        return lc.Llama(model_path=str(path), n_ctx=context_length, n_threads=cores,
                        n_threads_batch=cores, verbose=False, **options)


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
    with."""
    lc = import_llama_cpp()
    if extra_buffers is None:
        extra_buffers = default_extra_buffers()
    if n_threads is None:
        n_threads = torch.get_num_threads()
    with _weight_buffers(extra_buffers):
        return lc.Llama(model_path=str(path), n_ctx=context_length, n_batch=n_batch,
                        n_ubatch=n_ubatch, n_threads=n_threads, n_threads_batch=n_threads,
                        flash_attn=flash_attn, type_k=cache_type_id("cache_type_k", cache_type_k),
                        type_v=cache_type_id("cache_type_v", cache_type_v),
                        vocab_only=vocab_only, verbose=False)


def llama_settings(llm: Any) -> str:
    """What a loaded ``Llama`` runs with, as the report names it: context,
    threads, batch sizes, attention, key and value types, weight buffers
    and GPU layers, read from its parameters."""
    import llama_cpp

    c, m = llm.context_params, llm.model_params
    names = {v: k for k, v in CACHE_TYPES.items()}
    flash = {llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED: "on",
             llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED: "off"}.get(c.flash_attn_type, "auto")
    return (f"n_ctx={c.n_ctx}, n_threads={c.n_threads}, n_threads_batch={c.n_threads_batch}, "
            f"n_batch={c.n_batch}, n_ubatch={c.n_ubatch}, flash attention {flash}, "
            f"{names.get(c.type_k, c.type_k)} keys, {names.get(c.type_v, c.type_v)} values, "
            f"extra weight buffers {'on' if m.use_extra_bufts else 'off'}, "
            f"n_gpu_layers={m.n_gpu_layers}")
