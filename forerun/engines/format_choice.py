"""Choosing ``weights="auto"``: the weight format whose kernels run a model's
matrices fastest on the machine in hand.

Which format is fastest is a fact about the CPU, not a rule: bfloat16
matrix products are fast where the CPU has AVX512-BF16 and slower than
float32 where it has not; the int4 and int8 kernels read 4 to 8 times fewer
bytes than float32 but spend more instructions per byte.  So the first load
times each candidate's kernels on the model's own matrix shapes (the MLP's,
which hold most of the weights), for forwards of 1 and of 4 positions (a
decoding step, and a verification), and keeps the choice per machine, model
shape and thread count in the calibration store.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from .linear import make_linear

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
    def from_dict(cls, d: object, candidates: tuple[str, ...]) -> "FormatChoice | None":
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
                 *, copies: int = 3, repeats: int = 5) -> dict[str, list[float]]:
    """Milliseconds per forward of one MLP block (gate/up and down) of
    ``config``'s shapes in each format, best of ``repeats``.  ``copies``
    blocks with distinct weights are cycled, so the CPU's last-level cache
    can't hold them and the timing includes reading the weights."""
    h, i = config.hidden_size, config.intermediate_size
    gen = torch.Generator().manual_seed(0)
    result: dict[str, list[float]] = {}
    for fmt in candidates:
        blocks = []
        for _ in range(copies):
            gate_up = torch.randn(2 * i, h, generator=gen) * 0.02
            down = torch.randn(h, i, generator=gen) * 0.02
            blocks.append((make_linear(gate_up, None, fmt, device),
                           make_linear(down, None, fmt, device)))
            del gate_up, down
        row = []
        for t in TIMED_POSITIONS:
            x = torch.randn(t, h, generator=gen).to(device)
            best = float("inf")
            for r in range(repeats + 1):
                gate_up, down = blocks[r % copies]
                start = time.perf_counter()
                y = gate_up(x)
                y = down(y[:, :i] * y[:, i:])
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if r:   # the first run warms up
                    best = min(best, time.perf_counter() - start)
            row.append(best * 1000)
        result[fmt] = row
        del blocks
    return result


def choose_format(milliseconds: dict[str, list[float]]) -> str:
    """The format with the least time over a decoding step and a
    verification together."""
    return min(milliseconds, key=lambda fmt: sum(milliseconds[fmt]))
