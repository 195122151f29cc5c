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
from dataclasses import dataclass

import torch

from forerun.engines.layer_factory import make_linear
from forerun.engines.timed_blocks import (
    TIMED_POSITIONS,
    block_copies,
    random_weights,
    time_mlp_blocks,
)
from forerun.protocol.model_config import ModelConfig


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


def choose_format(milliseconds: dict[str, list[float]]) -> str:
    """The format with the least time over a decoding step and a
    verification together."""
    return min(milliseconds, key=lambda fmt: sum(milliseconds[fmt]))
