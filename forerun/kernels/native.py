"""forerun's native CPU kernels: the 4-bit, 6-bit and 8-bit matrix products of
``avx2_int_products.c`` and the per-position layer operations of
``avx2_layer_ops.c`` (RMSNorm, SiLU gating, RoPE with attention), compiled
with the machine's C compiler into one library on first use and called
through :mod:`ctypes`.  This module loads them and says whether they are
used; the package's other modules hold their parts:
:mod:`~forerun.kernels.layouts` (the weight layouts they read),
:mod:`~forerun.kernels.binding` (the ctypes wrapper),
:mod:`~forerun.kernels.build` (compiler, flags, build cache) and
:mod:`~forerun.kernels.self_check` (the checks a build passes before use).

Why forerun has its own: torch's weight-only kernels multiply bfloat16
activations, which costs an order of magnitude more instructions per weight
on a CPU without AVX512-BF16.  These kernels quantize the activations to
int8 in groups of 32 and sum products in integers, as llama.cpp does; see
the C file for the layout and why every row's result is independent of the
rows beside it.

The library is built once per source, compiler and flags, checked against
its manifest before it is loaded (a damaged one is rebuilt, see
:mod:`~forerun.kernels.build`), and checked against float64 results on
random values before any layer uses it.
Its products are used only where they are faster than torch's own on the
machine in hand: the caller that decides by timing passes a :class:`Timing`
to :func:`native_kernels` (``FORERUN_NATIVE_KERNELS=1`` skips the timing and
uses them).  Where they can't be had or lost (no AVX2, no C compiler, a
failed build or check, torch's kernels faster, ``FORERUN_NATIVE_KERNELS=0``),
:func:`native_kernels` returns None, :func:`unavailable_reason` says why,
and the layers run torch's kernels.  A cached library that is damaged where
the cache can't be written to rebuild it is not worked around: both
functions raise :class:`~forerun.errors.CacheError` naming the file.

Where the CPU has a dot-product instruction (AVX512-VNNI or AVX-VNNI's
``vpdpbusd``), the products are also built with it
(:data:`~forerun.kernels.build.DOT_BUILDS`).  That build is used only where
it passes the same check, gives results bit-identical to the AVX2 build's on
random products of every format, and the timing judges it faster than the
AVX2 one; otherwise the AVX2 build serves, and :func:`dot_product_reason`
says why.

The layer operations replace dozens of torch operators per layer, whose
dispatch costs more than their arithmetic at a few positions; they don't
depend on the matrices' format, so :func:`layer_ops` gives them wherever
the library built and passed its check, whichever kernels won the timing.

Calibration records are keyed by :func:`calibration_key` (registered with
:mod:`forerun.machine.calibration` when this module is imported).
"""

from __future__ import annotations

import os
import platform
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from forerun.kernels.binding import NativeKernels
from forerun.kernels.build import (
    Unavailable,
    dot_builds,
    find_compiler,
    load_library,
    source_digest,
    sources,
)
from forerun.kernels.self_check import (
    check_decoder_layer,
    check_layer_ops,
    check_products,
    check_same_attention,
    check_same_products,
    check_tiles_in_a_process,
)
from forerun.machine.calibration import register_key_part
from forerun.machine.cpu import cpu_flags

SWITCH = "FORERUN_NATIVE_KERNELS"

_lock = threading.Lock()
_state: dict[str, object] = {}


@dataclass(frozen=True)
class Timing:
    """How :func:`native_kernels` judges builds by their speed, supplied by
    the caller that times them.  Each function returns None where the first
    build it is given should be used, else why not (a sentence, the reason
    :func:`unavailable_reason` or :func:`dot_product_reason` then gives):
    ``against_torch(kernels)``: the chosen native build against torch's
    kernels; ``dot_against_avx2(name, dot, avx2)``: the CPU's vpdpbusd build
    called ``name`` against the AVX2 one."""

    against_torch: Callable[[NativeKernels], str | None]
    dot_against_avx2: Callable[[str, NativeKernels, NativeKernels], str | None]


def calibration_key() -> str:
    """What stored measurements must match: whether the native kernels are
    turned off, else their source's digest (without building them)."""
    if _switched_off():
        return "off"
    digest = source_digest(*sources())
    return f"forced-{digest}" if _forced_on() else digest


register_key_part("native_kernels", calibration_key)


def _switched_off() -> bool:
    return os.environ.get(SWITCH, "").strip().lower() in ("0", "false", "no", "off")


def _forced_on() -> bool:
    return os.environ.get(SWITCH, "").strip().lower() in ("1", "true", "yes", "on")


def native_kernels(timing: Timing | None = None) -> NativeKernels | None:
    """The kernels for the matrix products, decided on the first call and
    kept: the library built and checked, its vpdpbusd build where that is
    sound and, by ``timing``, faster; None where they can't run here or
    ``timing`` judges torch's faster (:func:`unavailable_reason` says why).
    ``FORERUN_NATIVE_KERNELS=1`` uses them untimed.  Raises RuntimeError
    where the decision needs a timing and ``timing`` is None (nothing is
    kept then)."""
    with _lock:
        if "kernels" not in _state:
            try:
                avx2 = _library()
                if timing is None and not _forced_on():
                    raise RuntimeError(
                        "whether forerun's native kernels are used is decided by timing "
                        "them, and no timing was given (see "
                        "forerun.engines.kernel_choice.product_kernels)")
                kernels = _dot_product_library(avx2, timing)
                if not _forced_on():
                    reason = timing.against_torch(kernels)  # type: ignore[union-attr]
                    if reason is not None:
                        raise Unavailable(reason)
                _state["kernels"], _state["reason"] = kernels, None
            except Unavailable as exc:
                _state["kernels"], _state["reason"] = None, str(exc)
        return _state["kernels"]  # type: ignore[return-value]


def layer_ops() -> NativeKernels | None:
    """The library for its layer operations (:meth:`NativeKernels.rms_norm`,
    :meth:`~NativeKernels.silu_mul`, :meth:`~NativeKernels.attention`):
    wherever it built and passed its check, whether or not its matrix
    products beat torch's; None where it can't run here."""
    with _lock:
        try:
            return _library()
        except Unavailable:
            return None


def _library() -> NativeKernels:
    """The built and checked library (under ``_lock``); raises Unavailable."""
    if "library" not in _state:
        try:
            _state["library"], _state["library_reason"] = _load(), None
        except Unavailable as exc:
            _state["library"], _state["library_reason"] = None, str(exc)
    if _state["library"] is None:
        raise Unavailable(_state["library_reason"])
    return _state["library"]  # type: ignore[return-value]


def unavailable_reason() -> str | None:
    """Why :func:`native_kernels` gives None (None when it doesn't): what
    its first call decided, or, before one, what deciding without a timing
    gives (RuntimeError where that needs one)."""
    native_kernels()
    return _state["reason"]  # type: ignore[return-value]


def dot_product_reason() -> str | None:
    """Why the products don't use a vpdpbusd build, or not the CPU's best
    (None when they use the best, or when the native kernels aren't used at
    all); decided as :func:`unavailable_reason` is."""
    native_kernels()
    return _state.get("dot_reason")  # type: ignore[return-value]


def _dot_product_library(avx2: NativeKernels, timing: Timing | None) -> NativeKernels:
    """The library the products use (under ``_lock``): the CPU's best
    vpdpbusd build (:func:`~forerun.kernels.build.dot_builds`: AMX tiles
    before AVX512-VNNI) that builds, passes the checks and matches ``avx2``
    bit for bit, where ``timing`` judges it faster (untimed where forced
    on); else ``avx2``.  Records why in "dot_reason"."""
    candidates = dot_builds(cpu_flags())
    if not candidates:
        _state["dot_reason"] = "this CPU has no vpdpbusd (AVX512-VNNI or AVX-VNNI)"
        return avx2
    refused = []
    for name, extra in candidates:        # best first: a build that fails gives way
        try:
            dot = build_library(extra)
            if dot.tile_rows is not None:       # the AMX build: its tiles tried elsewhere first
                check_tiles_in_a_process(dot)
            check_same_products(dot, avx2)
            check_same_attention(dot, avx2)
            check_decoder_layer(dot, avx2)
        except Unavailable as exc:
            refused.append(f"the {name} build is not used: {exc}")
            continue
        break
    else:
        _state["dot_reason"] = "; ".join(refused)
        return avx2
    if not _forced_on():
        reason = timing.dot_against_avx2(name, dot, avx2)  # type: ignore[union-attr]
        if reason is not None:
            _state["dot_reason"] = "; ".join([*refused, reason])
            return avx2
    _state["dot_reason"] = "; ".join(refused) or None
    return dot


def reset() -> None:
    """Forget the loaded state, so the next call decides again (tests)."""
    with _lock:
        _state.clear()


def _load() -> NativeKernels:
    """The AVX2 library, built, loaded and checked; raises Unavailable."""
    if _switched_off():
        raise Unavailable(f"turned off by {SWITCH}={os.environ[SWITCH]}")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise Unavailable(f"they are written for x86-64 CPUs, this is {platform.machine()}")
    missing = _missing_cpu_flags()
    if missing:
        raise Unavailable(f"this CPU lacks {', '.join(missing)}")
    kernels = build_library()
    check_layer_ops(kernels)
    check_decoder_layer(kernels, kernels)
    return kernels


def build_library(extra_flags: tuple[str, ...] = ()) -> NativeKernels:
    """The library built with :data:`~forerun.kernels.build.FLAGS` and
    ``extra_flags`` (cached by source, compiler and flags, checked against
    its manifest before it is loaded, rebuilt where damaged), loaded and
    checked against float64 sums; raises Unavailable, or
    :class:`~forerun.errors.CacheError` where the cached library is damaged
    and the cache can't be written to rebuild it."""
    lib, path = load_library(find_compiler(), extra_flags)
    kernels = NativeKernels(lib, path)
    check_products(kernels)
    return kernels


def _missing_cpu_flags() -> list[str]:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return ["AVX2"]
    flags = cpu_flags()
    if not flags:
        return []                             # torch's AVX2 implies FMA and F16C
    return [f.upper() for f in ("avx2", "fma", "f16c") if f not in flags]
