"""Choosing the matrix kernels by timing them on the machine in hand:
forerun's native ones (:mod:`forerun.kernels.native`) or torch's, and of the
native builds the CPU's vpdpbusd one or the AVX2 one.

Each choice times a q4 MLP block of :data:`TIMED_SHAPE` both ways, once per
machine and thread count, and keeps the times in the calibration store
(kinds ``native-kernels`` and ``dot-products``): native against torch's at
the format choice's positions
(:data:`~forerun.engines.timed_blocks.TIMED_POSITIONS`), the vpdpbusd build
against the AVX2 one at :data:`DOT_TIMED_POSITIONS`.  The kernels layer
asks through the :class:`~forerun.kernels.native.Timing` that
:func:`product_kernels` passes it; ``FORERUN_NATIVE_KERNELS=1`` skips the
timing and uses the native kernels.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterator, Sequence

import torch

from forerun.engines.linear import Int4Linear
from forerun.engines.native_linear import NativeInt4Linear
from forerun.engines.timed_blocks import (
    TIMED_POSITIONS,
    block_copies,
    random_weights,
    time_mlp_blocks,
)
from forerun.kernels.binding import NativeKernels
from forerun.kernels.native import SWITCH, Timing, native_kernels
from forerun.machine.calibration import CalibrationStore

# The shapes the kernels are timed on against torch's: an MLP block of
# Qwen2.5-1.5B (hidden 1536, intermediate 8960), at the positions the
# format choice times (TIMED_POSITIONS).
TIMED_SHAPE = (1536, 8960)

# The vpdpbusd build against the AVX2 one: a decoding step, a verification
# and a prompt block.  At 1 and 4 positions both read weights at memory speed
# and tie within a few percent, so timed there alone the choice was a coin
# toss: on a Xeon with AMX it kept the AVX2 build (2.12 ms at 1 and 4
# positions together, the AMX build 2.20), whose blocks of 128 positions
# took 2.2 times the AMX build's time (28.6 against 12.9 ms).
DOT_TIMED_POSITIONS = (1, 4, 128)


def product_kernels() -> NativeKernels | None:
    """forerun's native kernels for the matrix products where they run here
    and beat torch's (:func:`~forerun.kernels.native.native_kernels`, judged
    by :func:`native_against_torch` and :func:`dot_against_avx2`); None
    where they don't (:func:`~forerun.kernels.native.unavailable_reason`
    says why)."""
    return native_kernels(TIMING)


def native_against_torch(kernels: NativeKernels) -> str | None:
    """None where ``kernels`` beat torch's on this machine: a q4 MLP block
    timed both ways at 1 and 4 positions, once per machine and thread count
    (kept in the calibration store); else why not, naming both times."""
    ms = _timed_once("native-kernels", lambda: time_against_torch(kernels),
                     ("native", "torch"), "whether forerun's native kernels beat torch's")
    if sum(ms["torch"]) < sum(ms["native"]):
        return (f"torch's kernels were faster on this machine (a q4 MLP block at "
                f"{'/'.join(map(str, TIMED_POSITIONS))} positions: {_shown(ms)}); "
                f"{SWITCH}=1 uses the native ones anyway")
    return None


def dot_against_avx2(name: str, dot: NativeKernels, avx2: NativeKernels) -> str | None:
    """None where the vpdpbusd build ``dot`` (called ``name``) is faster
    than the AVX2 build ``avx2`` on this machine; else why not.  Both are
    timed on a q4 MLP block at each of :data:`DOT_TIMED_POSITIONS` (once per
    machine and thread count, kept), and each position count weighs alike:
    ``dot`` is faster where the geometric mean of its time over the AVX2
    build's is below 1 (see :func:`time_ratio`)."""
    ms = _timed_once("dot-products",
                     lambda: time_q4_mlp({name: dot, "avx2": avx2},
                                         positions=DOT_TIMED_POSITIONS),
                     (name, "avx2"), f"whether the {name} products beat the AVX2 ones",
                     positions=DOT_TIMED_POSITIONS)
    ratio = time_ratio(ms[name], ms["avx2"])
    if ratio >= 1.0:
        return (f"the {name} build was no faster on this machine (a q4 MLP block at "
                f"{'/'.join(map(str, DOT_TIMED_POSITIONS))} positions: {_shown(ms)}; "
                f"{ratio:.2f} of the AVX2 build's time)")
    return None


def time_ratio(times: Sequence[float], against: Sequence[float]) -> float:
    """The geometric mean of ``times[i] / against[i]``: how much of
    ``against``'s time ``times`` takes, each position count weighing alike
    (a sum of times would let the largest decide alone)."""
    return statistics.geometric_mean(t / a for t, a in zip(times, against, strict=True))


TIMING = Timing(native_against_torch, dot_against_avx2)


def _timed_once(kind: str, measure, names: tuple[str, ...], what: str,
                positions: Sequence[int] = TIMED_POSITIONS) -> dict[str, list[float]]:
    """``measure()``'s milliseconds per name of ``names`` (a list of one
    per count of ``positions``), measured once per machine and thread count
    and kept in the calibration store under ``kind`` (a damaged record is
    measured again)."""
    key = {"shape": list(TIMED_SHAPE), "positions": list(positions),
           "threads": torch.get_num_threads(), "torch": torch.__version__,
           "timing": "interleaved"}
    store = CalibrationStore(kind, key, label="q4-mlp")

    def valid(value):
        try:
            ok = all(len(value[k]) == len(positions) and
                     all(isinstance(v, (int, float)) and 0 < v < 1e6 for v in value[k])
                     for k in names)
            return value if ok else None
        except (KeyError, TypeError):
            return None

    return store.load_or_measure(valid, measure, what)


def _shown(ms: dict[str, list[float]]) -> str:
    """Timings per position count, as ``name 1.0/2.0 ms, ...``."""
    return ", ".join(f"{k} {'/'.join(f'{v:.1f}' for v in ms[k])} ms" for k in ms)


class _RawProduct:
    """A native q4 product with the call shape of a layer (for the timing,
    which runs while the kernels are being chosen)."""

    def __init__(self, kernels: NativeKernels, layer) -> None:
        self.kernels, self.layer = kernels, layer
        self.in_features = layer.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.q4_linear(x, self.layer.q, self.layer.scale, self.layer.minimum,
                                      self.layer.out_features)


def time_against_torch(kernels: NativeKernels, repeats: int = 3) -> dict[str, list[float]]:
    """Milliseconds of a q4 MLP block of :data:`TIMED_SHAPE` by the native
    kernels and by torch's (:func:`time_q4_mlp`)."""
    return time_q4_mlp({"native": kernels, "torch": None}, repeats)


def time_q4_mlp(candidates: dict[str, NativeKernels | None], repeats: int = 3,
                positions: Sequence[int] = TIMED_POSITIONS) -> dict[str, list[float]]:
    """Milliseconds of a q4 MLP block of :data:`TIMED_SHAPE` by each
    candidate (a native library, or None for torch's kernels), at each count
    of ``positions`` (by default the format choice's): best of ``repeats``,
    distinct weights per run, the candidates' runs interleaved, so that a
    slow spell of the machine touches each alike (timed one after the other,
    a spell during one candidate's turn once kept a faster build from being
    used)."""
    h, i = TIMED_SHAPE
    gen = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    copies = block_copies(h, i, "q4", repeats)
    values = [(random_weights("q4", 2 * i, h, gen), random_weights("q4", h, i, gen))
              for _ in range(copies)]
    built: dict[str, list] = {}
    turns: dict[str, Iterator[int]] = {}
    for name, kernels in candidates.items():
        if kernels is not None:
            built[name] = [tuple(_RawProduct(kernels, NativeInt4Linear.build(
                v, None, kernels.row_group)) for v in pair) for pair in values]
        else:
            built[name] = [tuple(Int4Linear(v, None, cpu) for v in pair) for pair in values]
        turns[name] = itertools.count()
        # A pass over every block first: a process's first products ran
        # 10x slower on an AMD EPYC (16 ms for a 1 ms block), both kinds.
        time_mlp_blocks(built[name], torch.randn(1, h, generator=gen), len(values),
                        turns[name])
    result: dict[str, list[float]] = {name: [] for name in candidates}
    for t in positions:
        x = torch.randn(t, h, generator=gen)
        best = {name: float("inf") for name in candidates}
        for _ in range(repeats):
            for name, blocks in built.items():
                best[name] = min(best[name], time_mlp_blocks(blocks, x, 1, turns[name]))
        for name in candidates:
            result[name].append(best[name])
    return result
