"""Choosing ``weights="auto"``: the weight format whose kernels run a model's
matrices fastest on the machine in hand.

Which format is fastest is a fact about the CPU, not a rule: bfloat16
matrix products are fast where the CPU has AVX512-BF16 and slower than
float32 where it has not; the int4 and int8 kernels read 4 to 8 times fewer
bytes than float32 but spend more instructions per byte.  So the first load
times each candidate's kernels on the model's own matrix shapes (the MLP's,
which hold most of the weights; random values, already in each format),
for forwards of 1 and of 4 positions (a
decoding step, and a verification), and keeps the choice per machine, model
shape and thread count in the calibration store.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from forerun.engines.linear import INT4_GROUP, Int4Groups, Int8Rows, Linear, make_linear
from forerun.protocol.model_config import ModelConfig

# Forwards of 1 position (plain decoding) and of 4 (a verification).
TIMED_POSITIONS = (1, 4)


@dataclass(frozen=True)
class FormatChoice:
    """The chosen format and the milliseconds each candidate took, per
    forward of each of :data:`TIMED_POSITIONS`, through one MLP block."""

    format: str
    milliseconds: dict[str, list[float]]

    def to_dict(self) -> dict:
        return {"format": self.format, "milliseconds": self.milliseconds}

    @classmethod
    def from_dict(cls, d: object, candidates: tuple[str, ...]) -> FormatChoice | None:
        try:
            assert isinstance(d, dict) and d["format"] in candidates
            ms = d["milliseconds"]
            assert isinstance(ms, dict) and set(ms) == set(candidates)
            for row in ms.values():
                assert isinstance(row, list) and len(row) == len(TIMED_POSITIONS)
                assert all(isinstance(v, (int, float)) and 0 < v < 1e6 for v in row)
            return cls(d["format"], {k: [float(v) for v in row] for k, row in ms.items()})
        except (AssertionError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        rows = ", ".join(f"{fmt} {'/'.join(f'{v:.1f}' for v in ms)} ms"
                         for fmt, ms in self.milliseconds.items())
        return (f"weights {self.format} (measured per MLP block at "
                f"{'/'.join(str(t) for t in TIMED_POSITIONS)} positions: {rows})")


def random_weights(fmt: str, n: int, k: int, gen: torch.Generator):
    """A random ``[n, k]`` matrix already in ``fmt``'s values (quantized
    directly: the kernels' speed does not depend on the values, and
    quantizing float matrices would cost more than the timing itself)."""
    if fmt == "q4" and k % INT4_GROUP == 0:
        groups = k // INT4_GROUP
        return Int4Groups(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                          torch.rand(n, groups, generator=gen) * 0.01,
                          torch.randn(n, groups, generator=gen) * 0.01)
    if fmt in ("q4", "q8"):
        return Int8Rows(torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8),
                        torch.rand(n, generator=gen) * 0.01)
    dtype = torch.float32 if fmt == "float32" else torch.bfloat16
    return (torch.randn(n, k, generator=gen) * 0.02).to(dtype)


# Bytes of distinct weights the timing cycles through: several times the
# last-level cache of the CPUs seen (32 MB), so a timing reads its weights
# from memory, as a forward through a whole model does.
CYCLED_BYTES = 128 << 20
_BYTES_PER_WEIGHT = {"q4": 0.5, "q8": 1, "bfloat16": 2, "float32": 4}


def block_copies(hidden: int, intermediate: int, fmt: str, repeats: int) -> int:
    """How many distinct MLP blocks of these sizes in ``fmt`` a timing of
    ``repeats`` runs cycles through: :data:`CYCLED_BYTES` of them (at most
    16), and at least one per run and the warm-up."""
    block_bytes = 3 * hidden * intermediate * _BYTES_PER_WEIGHT[fmt]
    return max(repeats + 1, min(16, -(-CYCLED_BYTES // int(block_bytes))))


def time_formats(config: ModelConfig, candidates: tuple[str, ...], device: torch.device,
                 *, repeats: int = 3) -> dict[str, list[float]]:
    """Milliseconds per forward of one MLP block (gate/up and down) of
    ``config``'s shapes in each format, best of ``repeats``.  Each timed
    run reads a block of its own (distinct weights, :data:`CYCLED_BYTES`
    of them in all), so the CPU's caches can't hold them and the timing
    includes reading the weights, as a forward through a whole model does."""
    h, i = config.hidden_size, config.intermediate_size
    gen = torch.Generator().manual_seed(0)
    result: dict[str, list[float]] = {}
    for fmt in candidates:
        copies = block_copies(h, i, fmt, repeats)
        blocks = [(make_linear(random_weights(fmt, 2 * i, h, gen), None, fmt, device),
                   make_linear(random_weights(fmt, h, i, gen), None, fmt, device))
                  for _ in range(copies)]
        turn = itertools.count()
        result[fmt] = [time_mlp_blocks(blocks, torch.randn(t, h, generator=gen).to(device),
                                       repeats, turn)
                       for t in TIMED_POSITIONS]
        del blocks
    return result


def time_mlp_blocks(blocks: Sequence[tuple[Linear, Linear]], x: torch.Tensor, repeats: int,
                    turn: Iterator[int]) -> float:
    """Milliseconds of ``x`` through an MLP block (gate/up, the gated
    product, down), best of ``repeats`` runs after one that warms up.  Each
    run takes the next block of ``blocks`` by ``turn`` (a counter shared
    across calls), so it reads weights that no recent run left in the
    CPU's caches."""
    best = float("inf")
    for r in range(repeats + 1):
        gate_up, down = blocks[next(turn) % len(blocks)]
        i = down.in_features
        start = time.perf_counter()
        y = gate_up(x)
        down(y[:, :i] * y[:, i:])
        if x.device.type == "cuda":
            torch.cuda.synchronize()
        if r:
            best = min(best, time.perf_counter() - start)
    return best * 1000


def choose_format(milliseconds: dict[str, list[float]]) -> str:
    """The format with the least time over a decoding step and a
    verification together."""
    return min(milliseconds, key=lambda fmt: sum(milliseconds[fmt]))
