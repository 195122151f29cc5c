"""How a prompt block multiplies int8 matrices, chosen by measurement.

A prompt is prefilled in blocks of up to 128 positions: a matrix-matrix
product, for which the int8 kernel (``torch._weight_int8pack_mm``, built for
the few rows of a decoding step or a verification) is not made.  The other
candidate dequantizes the int8 rows to float32, a slice at a time, and uses
the BLAS's float32 product: more arithmetic bytes, but a kernel made for
many rows, and float32 activations instead of bfloat16 ones, so no fidelity
is lost.  Which is faster is a fact about the CPU (on an AMD EPYC Zen 3 with
AVX2 only, a 512-token prefill of the 1.5B in q8 ran at 43 tok/s against
31), so the first load times both on the model's MLP shapes and keeps the
choice per machine, as ``weights="auto"`` keeps its format.  It applies to
models in q8.  A q4 model keeps the int8 kernel for its few int8 matrices
(a GGUF's 6-bit ones): there the other kernel prefilled more slowly (28
against 30 tok/s on the same CPU), and what is timed is a block all in int8.

Only forwards of at least :data:`GEMM_ROWS` positions take the other
kernel (a whole prompt, or a whole prefill block).  That is more than
the largest verification group the grouping probe tries, so every
verification, and every position it is compared with, runs the int8
kernel exactly as before: greedy speculative decoding stays
token-identical to plain decoding.  Plain and speculative decoding
prefill a prompt the same way, and prefix reuse replays the same blocks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from forerun.engines.linear import Int8Linear
from forerun.engines.timed_blocks import block_copies, random_weights, time_mlp_blocks
from forerun.machine.calibration import CalibrationStore
from forerun.protocol.grouping_probe import MAX_GROUP
from forerun.protocol.model_config import ModelConfig

PREFILL_KERNELS = ("int8", "float32-gemm")
# Rows per timed product: a whole prefill block (TorchDecoder.prefill_block).
TIMED_ROWS = 128
# Forwards of at least this many positions take the chosen kernel.  The
# float32 product pays a fixed price per forward (every weight dequantized:
# about 2 s for the 1.5B on an AVX2 EPYC) and the int8 kernel a price per
# row (about 33 ms there), so the float32 product lost below about 90 rows
# (2.0 against 1.4 s at 41) and won at 128 (3.4 against 4.2 s).  Where it
# wins at the timed size it wins at every larger one, so the threshold is
# the timed size.
GEMM_ROWS = TIMED_ROWS
assert GEMM_ROWS > MAX_GROUP, "a verification group must never reach the prefill kernel"


@dataclass(frozen=True)
class PrefillChoice:
    """The chosen kernel and the milliseconds each took through one MLP
    block of :data:`TIMED_ROWS` positions."""

    kernel: str
    milliseconds: dict[str, float]

    def to_dict(self) -> dict:
        return {"kernel": self.kernel, "milliseconds": self.milliseconds}

    @classmethod
    def from_dict(cls, d: object) -> PrefillChoice | None:
        try:
            assert isinstance(d, dict) and d["kernel"] in PREFILL_KERNELS
            ms = d["milliseconds"]
            assert isinstance(ms, dict) and set(ms) == set(PREFILL_KERNELS)
            assert all(isinstance(v, (int, float)) and 0 < v < 1e6 for v in ms.values())
            return cls(d["kernel"], {k: float(v) for k, v in ms.items()})
        except (AssertionError, KeyError, TypeError):
            return None


def time_prefill_kernels(config: ModelConfig, device: torch.device, *,
                         repeats: int = 3) -> dict[str, float]:
    """Milliseconds per forward of :data:`TIMED_ROWS` positions through one
    MLP block (gate/up and down) of ``config``'s shapes in int8, by each
    kernel, best of ``repeats``; distinct weights per run, so they are read
    from memory as in a whole model."""
    h, i = config.hidden_size, config.intermediate_size
    gen = torch.Generator().manual_seed(0)
    copies = block_copies(h, i, "q8", repeats)
    blocks = [(Int8Linear(random_weights("q8", 2 * i, h, gen), None, device),
               Int8Linear(random_weights("q8", h, i, gen), None, device))
              for _ in range(copies)]
    x = torch.randn(TIMED_ROWS, h, generator=gen).to(device)
    result, turn = {}, itertools.count()
    for kernel in PREFILL_KERNELS:
        for block in blocks:
            for layer in block:
                layer.gemm_rows = GEMM_ROWS if kernel == "float32-gemm" else None
        result[kernel] = time_mlp_blocks(blocks, x, repeats, turn)
    return result


def choose_prefill_kernel(name: str, config: ModelConfig, device: torch.device
                          ) -> PrefillChoice:
    """The prefill kernel for int8 matrices of ``config``'s shapes on
    ``device``: stored per machine, else measured.  Off the CPU the int8
    layers run dequantized to bfloat16 anyway, so the choice is "int8"."""
    if device.type != "cpu":
        return PrefillChoice("int8", {k: 1.0 for k in PREFILL_KERNELS})
    key = {"hidden": config.hidden_size, "intermediate": config.intermediate_size,
           "rows": TIMED_ROWS, "device": str(device), "threads": torch.get_num_threads(),
           "torch": torch.__version__}
    store = CalibrationStore("prefill", key, label=f"{name}-{device.type}")

    def measure() -> PrefillChoice:
        ms = time_prefill_kernels(config, device)
        return PrefillChoice(min(ms, key=ms.__getitem__), ms)

    return store.load_or_measure(PrefillChoice.from_dict, measure,
                                 f"the fastest prefill kernel for {name}", PrefillChoice.to_dict)
