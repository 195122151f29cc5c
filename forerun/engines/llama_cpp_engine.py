"""A :class:`~forerun.protocol.decoder.Decoder` over llama.cpp (llama-cpp-python's
low-level API): the GGUF runs with its quantized weights, as llama.cpp runs
it, and every decoding method of forerun works on it unchanged.

One llama.cpp context holds one sequence (id 0).  Feeding appends positions
to it with ``llama_decode``; rollback removes the sequence's tail from
llama.cpp's KV memory (``llama_memory_seq_rm``), which only frees cells: no
copy, no re-forward.

Losslessness needs batch invariance: speculative decoding verifies a draft
in one forward of ``k + 1`` positions where plain decoding runs ``k + 1``
forwards of one, and greedy output is token-identical only if both give the
same logits.  Measured with llama-cpp-python 0.3.36 on a CPU, llama.cpp
keeps that invariance only within these bounds, which this engine holds to:

* **At most 7 positions per micro-batch.**  llama.cpp's CPU kernels are
  bit-identical for forwards of 1 to 7 positions with flash attention on,
  but switch to other kernels for 8 and more, which moves logits by up to
  ~0.5 (and without flash attention already for 2).  So a feed that returns
  every position's logits (a verification) runs in ``llama_decode`` calls of
  at most 7 positions.  A ``last_only`` feed (a prefill) runs in calls of
  ``n_batch`` positions with large micro-batches, about 4x faster on a long
  prompt; its numerics differ slightly, which the Decoder protocol allows
  (every method prefills a prompt the same way: one ``last_only`` feed).
* **Values cached as Q8_0, keys as F16** (``cache_type_v="q8_0"``,
  llama.cpp's ``--cache-type-v q8_0``).  With F16 keys and values, once
  more than 256 positions are cached, llama.cpp's flash attention computes a
  one-position forward with another kernel on several threads (keys split
  across threads, partial results merged), whose logits differ from a
  multi-position forward's by up to ~0.5.  That kernel runs only where keys
  and values have the same F16 (or F32) type, so Q8_0 values keep every
  forward on one kernel at any length and thread count (tested).  Measured
  against F16 values over 748 generated positions of the 1.5B
  (``benchmarks/experiments/kv_cache_precision.py``): the same top token at 99.0% of
  positions, mean KL 0.0013 nats (Q8_0 keys instead: 98.2%, 0.0022).
  ``cache_type_v="f16"`` gives llama.cpp's default precision back; it is
  exact at any length only with ``n_threads=1``.

What llama.cpp can't express through this engine yet: arbitrary attention
masks (tree verification needs several sequence ids per token, later work);
:meth:`LlamaCppDecoder.forward` accepts only the plain causal mask with
consecutive positions.  Hidden states are not exposed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import torch

from forerun.engines.base import EngineDecoder
from forerun.errors import (
    CacheStateError,
    ConfigError,
    EngineError,
    EngineUnavailableError,
    InvalidTokenError,
    ModelFormatError,
    ModelNotFoundError,
    UnsupportedOperationError,
)
from forerun.machine.cpu import cpu_flags
from forerun.protocol.cache_positions import CachePositions
from forerun.protocol.decoder import Capabilities, EngineSettings, ForwardOutput
from forerun.protocol.prefix_reuse import PrefixPayload

INSTALL_HINT = "pip install 'forerun[llama]'"
DEFAULT_BATCH = 512
# The largest micro-batch whose logits are bit-identical to one-position
# forwards (llama.cpp's CPU kernels, flash attention on; see above).
INVARIANT_UBATCH = 7
# KV cache types: ggml type ids (ggml.h).  Keys and values of different
# types keep one attention kernel for every forward at any length (see above).
CACHE_TYPES = {"f16": 1, "q8_0": 8}
DEFAULT_CACHE_TYPE_K = "f16"
DEFAULT_CACHE_TYPE_V = "q8_0"
# What forerun.load(..., engine="llama.cpp", engine_options={...}) passes on.
ENGINE_OPTIONS = ("n_threads", "n_threads_batch", "n_batch", "n_ubatch", "flash_attn",
                  "cache_type_k", "cache_type_v", "extra_buffers", "verbose")


class _Options(TypedDict):
    """A decoder's engine options (what :meth:`LlamaCppDecoder.fork` passes on)."""

    n_threads: int
    n_threads_batch: int
    n_batch: int
    n_ubatch: int
    flash_attn: bool
    cache_type_k: str
    cache_type_v: str
    verbose: bool


def cache_type_id(option: str, name: str) -> int:
    """The ggml type id of a cache type name given to ``option``, or
    :class:`ConfigError` naming the choices."""
    try:
        return CACHE_TYPES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"{option} must be one of {', '.join(CACHE_TYPES)}, "
                          f"got {name!r}") from None

_backend_lock = threading.Lock()
_backend_ready = False


def import_llama_cpp() -> Any:
    """The ``llama_cpp`` module, or :class:`EngineUnavailableError` naming
    the install command."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise EngineUnavailableError(
            f"the llama.cpp engine needs llama-cpp-python, which is not installed; "
            f"install it with: {INSTALL_HINT}") from exc
    return llama_cpp


def _init_backend(lc: Any, verbose: bool) -> None:
    global _backend_ready
    try:   # llama-cpp-python routes llama.cpp's log through this logger
        from llama_cpp._logger import set_verbose
        set_verbose(verbose)
    except ImportError:
        pass
    with _backend_lock:
        if not _backend_ready:
            lc.llama_backend_init()
            _backend_ready = True


def cpu_has_amx() -> bool:
    """Whether the CPU advertises Intel AMX tiles (Linux ``/proc/cpuinfo``)."""
    return "amx_tile" in cpu_flags()


def default_extra_buffers() -> bool:
    """llama.cpp's extra weight buffers (repacked layouts, AMX) by default,
    except on a CPU that advertises AMX: llama.cpp's AMX matrix multiply
    crashes the process (SIGSEGV or SIGILL) on batched forwards in virtual
    machines that advertise AMX, even on a Xeon whose tiles programs may use
    (forerun's own AMX products run there; llama-cpp-python 0.3.36).
    ``extra_buffers=True`` turns them back on where they work."""
    return not cpu_has_amx()


def model_params(lc: Any, extra_buffers: bool) -> Any:
    """llama.cpp model parameters: CPU only, memory-mapped, with or without
    the extra buffer types."""
    params = lc.llama_model_default_params()
    params.n_gpu_layers = 0
    params.use_extra_bufts = bool(extra_buffers)
    return params


class _LlamaModel:
    """A loaded llama.cpp model, shared by the contexts of a decoder and its
    forks.  Freed when the last of them closes (or when it is collected)."""

    def __init__(self, lc: Any, path: Path, extra_buffers: bool) -> None:
        self.lc = lc
        self.path = path
        self.extra_buffers = extra_buffers
        self.users = 0
        self.ptr = lc.llama_model_load_from_file(
            str(path).encode("utf-8"), model_params(lc, extra_buffers))
        if not self.ptr:
            raise ModelFormatError(f"llama.cpp could not load {path}")
        self.vocab = lc.llama_model_get_vocab(self.ptr)
        self.n_vocab = int(lc.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(lc.llama_model_n_ctx_train(self.ptr))

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0:
            self.free()

    def free(self) -> None:
        ptr, self.ptr = getattr(self, "ptr", None), None
        if ptr:
            self.lc.llama_model_free(ptr)

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:   # interpreter shutdown: the bindings may be gone
            pass


class LlamaCppDecoder(EngineDecoder):
    """Implements the Decoder protocol over a llama.cpp context; see
    :mod:`forerun.protocol.decoder` for the contract of each method.

    ``path``: a GGUF file.  ``context_length``: positions the cache holds
    (default: the model's own limit, at most 4096).  ``n_threads``: threads
    for a forward (default ``torch.get_num_threads()``), ``n_threads_batch``
    for a forward of several positions (default ``n_threads``).
    ``n_batch``: the most positions one ``llama_decode`` of a prefill takes;
    longer prefills are split.  ``n_ubatch``: the most positions llama.cpp
    computes at once in a prefill (default ``n_batch``); feeds that return
    every position's logits always go in micro-batches of at most 7, which
    keeps their logits independent of how positions are grouped into feeds
    (see the module docstring).  ``flash_attn``: llama.cpp's flash attention
    (on by default: needed for that invariance).  ``cache_type_k`` and
    ``cache_type_v``: ``"f16"`` or ``"q8_0"`` (default F16 keys and Q8_0
    values, exact at any length and thread count; both F16 is exact only
    with one thread).
    ``extra_buffers``: see :func:`default_extra_buffers`.
    """

    engine = "llama.cpp"
    # Past the KV lengths (256, 512, 1024) where llama.cpp's attention
    # kernels change their tiling.
    probe_context = 1200
    group_ceiling = None
    device = "cpu"
    # No hidden states, and one sequence id per token: no tree masks yet.
    capabilities = Capabilities(fork=True)

    def __init__(self, path: str | Path, *, context_length: int | None = None,
                 eos_token_ids: Sequence[int] = (), n_threads: int | None = None,
                 n_threads_batch: int | None = None, n_batch: int = DEFAULT_BATCH,
                 n_ubatch: int = DEFAULT_BATCH, flash_attn: bool = True,
                 cache_type_k: str = DEFAULT_CACHE_TYPE_K,
                 cache_type_v: str = DEFAULT_CACHE_TYPE_V, extra_buffers: bool | None = None,
                 verbose: bool = False, _model: _LlamaModel | None = None) -> None:
        self._ctx = None
        self._batch: Any = None   # a llama_batch of the bindings, None once closed
        self._model: _LlamaModel | None = None
        if n_threads is None:
            n_threads = torch.get_num_threads()
        if n_threads_batch is None:
            n_threads_batch = n_threads
        for name, value in (("context_length", context_length), ("n_batch", n_batch),
                            ("n_ubatch", n_ubatch), ("n_threads", n_threads),
                            ("n_threads_batch", n_threads_batch)):
            if value is None and name == "context_length":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        type_k = cache_type_id("cache_type_k", cache_type_k)
        type_v = cache_type_id("cache_type_v", cache_type_v)
        lc = import_llama_cpp()
        self._lc = lc
        _init_backend(lc, verbose)
        path = Path(path)
        if _model is None:
            if not path.is_file():
                raise ModelNotFoundError(f"GGUF file {path} does not exist")
            if extra_buffers is None:
                extra_buffers = default_extra_buffers()
            _model = _LlamaModel(lc, path, bool(extra_buffers))
        self._model = _model
        _model.users += 1
        if context_length is None:
            context_length = min(_model.n_ctx_train, 4096)
        self.options = _Options(n_threads=n_threads, n_threads_batch=n_threads_batch,
                                n_batch=n_batch, n_ubatch=n_ubatch, flash_attn=bool(flash_attn),
                                cache_type_k=cache_type_k, cache_type_v=cache_type_v,
                                verbose=verbose)
        self.path = path
        # The most positions one llama_decode computes when every position's
        # logits are returned; measured per machine by
        # forerun.protocol.grouping_probe (7 held on the CPUs seen so far
        # without the extra buffers).
        self.verify_group: int | None = INVARIANT_UBATCH
        self._positions = CachePositions(context_length)
        self._eos = tuple(int(e) for e in eos_token_ids)
        self._n_batch = min(n_batch, context_length)
        self._n_ubatch = min(n_ubatch, self._n_batch)
        # A prompt is prefilled in blocks of ``n_batch`` positions, aligned to
        # its multiples: the batches llama.cpp itself splits a prompt into.
        self.prefill_block = self._n_batch
        self._vocab = _model.n_vocab

        params = lc.llama_context_default_params()
        params.n_ctx = context_length
        params.n_batch = self._n_batch
        params.n_ubatch = self._n_ubatch
        params.n_seq_max = 1
        params.n_threads = n_threads
        params.n_threads_batch = n_threads_batch
        params.flash_attn_type = (lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                                  else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.type_k = type_k
        params.type_v = type_v
        params.no_perf = True
        self._ctx = lc.llama_init_from_model(_model.ptr, params)
        if not self._ctx:
            raise EngineError(
                f"llama.cpp could not create a context of {context_length} positions "
                f"for {path} (out of memory?)")
        self._mem = lc.llama_get_memory(self._ctx)
        self._batch = lc.llama_batch_init(self._n_batch, 0, 1)
        b = self._batch
        n = self._n_batch
        # numpy views of the batch arrays: filling a batch costs no Python loop.
        self._tok = np.ctypeslib.as_array(b.token, shape=(n,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(n,))
        self._out = np.ctypeslib.as_array(b.logits, shape=(n,))
        for i in range(n):   # every position belongs to sequence 0
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0

    # -- lifetime ----------------------------------------------------------
    def fork(self) -> LlamaCppDecoder:
        """A second decoder over the same loaded model with its own context
        and an empty cache (a model drafting for itself)."""
        self._check_open()
        fork = LlamaCppDecoder(self.path, context_length=self.context_length,
                               eos_token_ids=self._eos, _model=self._model, **self.options)
        fork.verify_group = self.verify_group
        return fork

    def close(self) -> None:
        """Free the context (and the model, once its last context is closed).
        The decoder can't be used afterwards."""
        lc = self._lc if hasattr(self, "_lc") else None
        batch, self._batch = getattr(self, "_batch", None), None
        ctx, self._ctx = getattr(self, "_ctx", None), None
        model, self._model = getattr(self, "_model", None), None
        if lc is not None:
            if batch is not None:
                lc.llama_batch_free(batch)
            if ctx:
                lc.llama_free(ctx)
        if model is not None:
            model.release()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:   # interpreter shutdown: the bindings may be gone
            pass

    def __enter__(self) -> LlamaCppDecoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._ctx is None:
            raise CacheStateError("this llama.cpp decoder has been closed")

    # -- facts -------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def settings(self) -> EngineSettings:
        """Everything that decides which kernels run (and so the numerics
        and the costs): the engine options, the weight buffers, llama.cpp's
        version.  ``weights`` is None: llama.cpp runs the GGUF's own
        quantization."""
        self._check_open()
        options = {k: v for k, v in self.options.items() if k != "verbose"}
        assert self._model is not None   # open: closing drops the model with the context
        return EngineSettings(
            engine=self.engine, device=str(self.device), threads=self.options["n_threads"],
            extra=(("extra_buffers", self._model.extra_buffers),
                   ("llama_cpp", getattr(self._lc, "__version__", "?")),
                   *sorted(options.items())))

    @property
    def threads(self) -> int:
        """The context's thread count for a forward (``n_threads``)."""
        return self.options["n_threads"]

    def set_threads(self, n: int) -> None:
        """Set the context's ``n_threads`` and ``n_threads_batch`` to ``n``
        (``llama_set_n_threads``), whichever thread feeds it.  llama.cpp
        gives each calling thread its own OpenMP team, so two decoders fed
        from two threads run side by side on their own counts."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"a thread count must be a positive integer, got {n!r}")
        self._check_open()
        self._lc.llama_set_n_threads(self._ctx, n, n)
        self.options["n_threads"] = self.options["n_threads_batch"] = n

    # -- forward -----------------------------------------------------------
    def _tokens(self, tokens: Sequence[int] | torch.Tensor) -> np.ndarray:
        self._check_open()
        if isinstance(tokens, torch.Tensor):
            ids = tokens.detach().to("cpu", torch.long).reshape(-1).numpy()
        else:
            try:
                ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
            except (TypeError, ValueError, OverflowError) as exc:
                raise InvalidTokenError(f"token ids must be integers: {exc}") from exc
        if ids.size == 0:
            raise CacheStateError("feed() needs at least one token")
        if int(ids.min()) < 0 or int(ids.max()) >= self._vocab:
            raise InvalidTokenError(
                f"token ids must lie in 0..{self._vocab - 1}, got {ids.tolist()[:8]}...")
        self._positions.check_room(int(ids.size))
        return ids

    def _no_hidden(self, return_hidden: bool, hidden_layers: Sequence[int] = ()) -> None:
        # llama-cpp-python's API gives the final embeddings at most; the states
        # entering chosen layers would take a graph callback (cb_eval) per forward.
        if return_hidden or hidden_layers:
            raise UnsupportedOperationError(
                "the llama.cpp engine does not expose hidden states "
                "(capabilities.hidden_states and layer_states are False); use the torch "
                "engine for methods that need them")

    def _decode(self, ids: np.ndarray, last_only: bool) -> torch.Tensor:
        lc, ctx, vocab = self._lc, self._ctx, self._vocab
        start = self._positions.length
        total = int(ids.size)
        rows: list[np.ndarray] = []
        # Positions whose logits are returned go in calls of at most
        # verify_group, whose kernels do not depend on the grouping; a
        # prefill in large ones.
        step = (self._n_batch if last_only or self.verify_group is None
                else min(self._n_batch, self.verify_group))
        for off in range(0, total, step):
            n = min(step, total - off)
            last_chunk = off + n == total
            self._tok[:n] = ids[off:off + n]
            self._pos[:n] = np.arange(start + off, start + off + n)
            if last_only:
                self._out[:n] = 0
                self._out[n - 1] = 1 if last_chunk else 0
            else:
                self._out[:n] = 1
            self._batch.n_tokens = n
            rc = lc.llama_decode(ctx, self._batch)
            if rc != 0:
                # Leave the cache as it was before this feed.
                lc.llama_memory_seq_rm(self._mem, 0, start, -1)
                raise EngineError(f"llama_decode failed with status {rc} "
                                  f"(feeding {total} tokens at position {start})")
            if not last_only:
                ptr = lc.llama_get_logits(ctx)
                rows.append(np.ctypeslib.as_array(ptr, shape=(n, vocab)).copy())
            elif last_chunk:
                ptr = lc.llama_get_logits_ith(ctx, n - 1)
                rows.append(np.ctypeslib.as_array(ptr, shape=(1, vocab)).copy())
        self._positions.advance(total)
        logits = rows[0] if len(rows) == 1 else np.concatenate(rows)
        return torch.from_numpy(logits)

    def feed(self, tokens: Sequence[int] | torch.Tensor, *, last_only: bool = False,
             return_hidden: bool = False, hidden_layers: Sequence[int] = ()
             ) -> ForwardOutput:
        self._no_hidden(return_hidden, hidden_layers)
        ids = self._tokens(tokens)
        return ForwardOutput(self._decode(ids, last_only))

    def forward(self, tokens: Sequence[int] | torch.Tensor,
                positions: Sequence[int] | torch.Tensor, attention_mask: torch.Tensor,
                *, return_hidden: bool = False, hidden_layers: Sequence[int] = ()
                ) -> ForwardOutput:
        """Only the causal case: ``positions`` must be ``length .. length+T-1``
        and ``attention_mask`` the causal mask (every fed token sees the whole
        cache and the fed tokens up to itself).  Anything else (a tree mask)
        raises :class:`~forerun.errors.UnsupportedOperationError`."""
        self._no_hidden(return_hidden, hidden_layers)
        ids = self._tokens(tokens)
        t = int(ids.size)
        pos = torch.as_tensor(positions, dtype=torch.long).reshape(-1).cpu()
        if pos.numel() != t:
            raise CacheStateError(f"{t} tokens need {t} positions, got {pos.numel()}")
        mask = torch.as_tensor(attention_mask).cpu()
        start = self._positions.length
        if mask.dtype != torch.bool or tuple(mask.shape) != (t, start + t):
            raise CacheStateError(
                f"attention_mask must be bool of shape {(t, start + t)}, got "
                f"{mask.dtype} {tuple(mask.shape)}")
        if not bool(mask.any(dim=1).all()):
            raise CacheStateError("every row of attention_mask must allow at least one slot")
        causal = torch.ones(t, start + t, dtype=torch.bool).tril(diagonal=start)
        if not torch.equal(pos, torch.arange(start, start + t)) or not torch.equal(mask, causal):
            raise UnsupportedOperationError(
                "the llama.cpp engine supports forward() only with consecutive positions "
                "and the plain causal attention mask; tree attention masks are not "
                "supported yet (use the torch engine for tree verification)")
        return ForwardOutput(self._decode(ids, last_only=False))

    # -- cache control -----------------------------------------------------
    def rollback(self, length: int) -> None:
        self._check_open()
        self._positions.check_rollback(length)
        if length < self._positions.length:
            if not self._lc.llama_memory_seq_rm(self._mem, 0, int(length), -1):
                raise EngineError(f"llama.cpp could not remove positions {length}.. "
                                  f"from its KV memory")
        self._positions.rollback(length)

    def reset(self) -> None:
        self._check_open()
        self._lc.llama_memory_clear(self._mem, False)
        self._positions.reset()

    # -- exact prefix reuse: forerun.protocol.prefix_reuse.PrefixReuse ----------------
    # (prefill_block is set in __init__.)
    def keep_prefix(self, length: int) -> None:
        self._check_open()
        old = self._positions.length
        self._positions.keep_prefix(length)
        if length < old and not self._lc.llama_memory_seq_rm(self._mem, 0, int(length), -1):
            self.reset()
            raise EngineError(f"llama.cpp could not remove positions {length}.. "
                              f"from its KV memory")

    def _prefix_owner(self) -> tuple:
        # Whatever decides the numerics of the saved keys and values.
        return (self._model, self.context_length, tuple(sorted(self.options.items())))

    def export_prefix(self):
        """The ledger's positions as llama.cpp's sequence state
        (``llama_state_seq_get_data``: the cells' positions and their keys
        and values as stored, F16 or Q8_0 bytes)."""
        import ctypes

        tokens = self.prefilled_tokens
        self.keep_prefix(len(tokens))
        lc, ctx = self._lc, self._ctx
        size = int(lc.llama_state_seq_get_size(ctx, 0))
        buf = (ctypes.c_uint8 * max(size, 1))()
        written = int(lc.llama_state_seq_get_data(ctx, buf, size, 0))
        if tokens and written == 0:
            raise EngineError("llama.cpp could not save the sequence state")
        return PrefixPayload(tokens, buf, written, self._prefix_owner())

    def restore_prefix(self, payload) -> None:
        """Clear the KV memory and load a saved sequence state into it
        (``llama_state_seq_set_data``), in the same cells a prefill uses."""
        self._check_open()
        if payload.owner != self._prefix_owner():
            raise CacheStateError("this saved prefix belongs to another model or engine "
                                  "setting; it can't be restored here")
        self.reset()
        if payload.tokens:
            read = int(self._lc.llama_state_seq_set_data(self._ctx, payload.data,
                                                         payload.nbytes, 0))
            if read == 0:
                self.reset()
                raise EngineError("llama.cpp could not restore a saved sequence state")
        self._positions.set_prefilled(payload.tokens)
        self._ledger_owner = payload.owner

    def __repr__(self) -> str:
        return (f"LlamaCppDecoder({str(self.path)!r}, context {self.context_length}, "
                f"{self.options['n_threads']} threads)")
