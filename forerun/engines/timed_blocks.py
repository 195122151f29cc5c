"""What timing a layer format or a kernel runs: an MLP block of random
weights already in a format's values, as many distinct copies as keep the
CPU's caches from holding them, timed at the positions a decoding step and
a verification feed.  The format choice (:mod:`.format_choice`), the kernel
choice (:mod:`.kernel_choice`) and the prompt-block kernel's choice
(:mod:`.prefill_kernel`) time with these."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch

from forerun.engines.linear import INT4_GROUP, Int4Groups, Int8Rows, Linear

# Forwards of 1 position (plain decoding) and of 4 (a verification).
TIMED_POSITIONS = (1, 4)


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
