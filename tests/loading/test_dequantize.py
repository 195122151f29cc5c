"""forerun.loading.dequantize: GGUF tensor data to float32.

Every supported type is checked bit for bit against the reference decoder of
the ``gguf`` package, on data built by ``gguf.quants.quantize`` where gguf can
quantize the type and on random blocks (random quants, random finite fp16
scales) for all of them.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import gguf.quants
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import forerun.loading.dequantize as dequantize_module
from forerun.errors import ModelFormatError
from forerun.loading.dequantize import SUPPORTED_TYPES, dequantize

T = gguf.GGMLQuantizationType

FLOAT_TYPES = (T.F32, T.F16, T.BF16)
LEGACY_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
K_TYPES = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
BLOCK_TYPES = LEGACY_TYPES + K_TYPES

# Byte offsets of the fp16 fields (d, dmin, m) inside one block of each type.
FP16_FIELDS = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
}

# (rows, blocks per row); the last spans several decoding chunks for every type.
BLOCK_SHAPES = [(1, 1), (3, 2), (5, 7), (600, 6)]


def reference(data: np.ndarray, qtype: T, shape: tuple[int, ...]) -> np.ndarray:
    """gguf's own decoder, reshaped to ``shape``."""
    return gguf.quants.dequantize(data, qtype).reshape(shape)


def random_fp16(rng: np.random.Generator, size: int) -> np.ndarray:
    """Finite fp16 values of both signs spread over many magnitudes, subnormals included."""
    magnitudes = 10.0 ** rng.uniform(-7, 2, size)
    return (rng.choice([-1.0, 1.0], size) * magnitudes).astype(np.float16)


def random_blocks(
    rng: np.random.Generator, qtype: T, rows: int, blocks_per_row: int
) -> np.ndarray:
    """Raw data of ``rows`` rows as GGUFReader gives it: random bytes, except
    that the fp16 scale fields hold random finite values."""
    type_size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(rows, blocks_per_row * type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    for offset in FP16_FIELDS[qtype]:
        scales = random_fp16(rng, len(blocks))
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw


def assert_identical(actual: np.ndarray, expected: np.ndarray) -> None:
    """Same shape, float32, C-contiguous and equal bit for bit (nan included)."""
    assert actual.dtype == np.float32
    assert actual.flags.c_contiguous
    assert actual.shape == expected.shape
    expected_bits = expected.astype(np.float32).view(np.uint32)
    np.testing.assert_array_equal(actual.view(np.uint32), expected_bits)


def test_supported_types():
    assert SUPPORTED_TYPES == set(FLOAT_TYPES + BLOCK_TYPES)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_block_sizes_match_gguf(qtype):
    fmt = dequantize_module._BLOCK_FORMATS[qtype]
    assert (fmt.block_size, fmt.type_size) == gguf.GGML_QUANT_SIZES[qtype]


@pytest.mark.parametrize("rows, blocks_per_row", BLOCK_SHAPES)
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_random_blocks_match_reference(qtype, rows, blocks_per_row):
    rng = np.random.default_rng([int(qtype), rows, blocks_per_row])
    data = random_blocks(rng, qtype, rows, blocks_per_row)
    shape = (rows, blocks_per_row * gguf.GGML_QUANT_SIZES[qtype][0])
    assert_identical(dequantize(data, qtype, shape), reference(data, qtype, shape))


@pytest.mark.parametrize("rows, blocks_per_row", BLOCK_SHAPES)
@pytest.mark.parametrize("qtype", LEGACY_TYPES, ids=lambda t: t.name)
def test_gguf_quantized_legacy_match_reference(qtype, rows, blocks_per_row):
    rng = np.random.default_rng([int(qtype), rows, blocks_per_row])
    shape = (rows, blocks_per_row * 32)
    weights = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    data = gguf.quants.quantize(weights, qtype)
    out = dequantize(data, qtype, shape)
    assert_identical(out, reference(data, qtype, shape))
    # A faithful decoding is also close to the weights that were quantized.
    assert np.abs(out - weights).max() < 0.05


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 64), (600, 96)])
@pytest.mark.parametrize("qtype", FLOAT_TYPES, ids=lambda t: t.name)
def test_float_types_match_reference(qtype, shape):
    rng = np.random.default_rng(len(shape))
    weights = rng.standard_normal(shape).astype(np.float32)
    data = gguf.quants.quantize(weights, qtype)  # F32/F16 typed, BF16 raw uint8
    assert_identical(dequantize(data, qtype, shape), reference(data, qtype, shape))


def test_bf16_accepts_uint16_data_and_keeps_special_values():
    bits = np.array([0x0000, 0x8000, 0x3F80, 0xBF80, 0x7F80, 0xFF80, 0x7FC1, 0x0001], np.uint16)
    out = dequantize(bits, T.BF16, (2, 4))
    assert_identical(out, reference(bits.view(np.uint8), T.BF16, (2, 4)))
    assert out[0, 2] == 1.0 and out[0, 3] == -1.0 and np.isinf(out[1, 0]) and np.isnan(out[1, 2])


def test_f16_special_values():
    values = np.array([0.0, -0.0, 65504.0, -np.inf, np.nan, 6e-8, 1.0, -2.5], np.float16)
    assert_identical(dequantize(values, T.F16, (8,)), reference(values, T.F16, (8,)))


@settings(max_examples=60, deadline=None)
@given(
    qtype=st.sampled_from(BLOCK_TYPES),
    leading=st.lists(st.integers(1, 4), min_size=0, max_size=2),
    blocks_per_row=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_shape_matches_reference(qtype, leading, blocks_per_row, seed):
    rows = int(np.prod(leading))
    data = random_blocks(np.random.default_rng(seed), qtype, rows, blocks_per_row)
    shape = (*leading, blocks_per_row * gguf.GGML_QUANT_SIZES[qtype][0])
    assert_identical(dequantize(data, qtype, shape), reference(data, qtype, shape))


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_chunk_boundaries(qtype, monkeypatch):
    """Decoding a few blocks per chunk gives the same result as one chunk."""
    monkeypatch.setattr(dequantize_module, "_CHUNK_BYTES", 3 * gguf.GGML_QUANT_SIZES[qtype][1])
    data = random_blocks(np.random.default_rng(int(qtype)), qtype, 4, 5)
    shape = (4, 5 * gguf.GGML_QUANT_SIZES[qtype][0])
    assert_identical(dequantize(data, qtype, shape), reference(data, qtype, shape))


def test_integer_type_id_and_flat_data_are_accepted():
    data = random_blocks(np.random.default_rng(0), T.Q4_K, 2, 3)
    expected = reference(data, T.Q4_K, (2, 768))
    assert_identical(dequantize(data.reshape(-1), int(T.Q4_K), [2, 768]), expected)


def test_output_is_a_writable_copy():
    weights = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = dequantize(weights, T.F32, (3, 4))
    assert not np.shares_memory(out, weights)
    assert out.flags.writeable
    out[0, 0] = 99.0
    assert weights[0, 0] == 0.0


def test_empty_tensor():
    out = dequantize(np.zeros(0, np.uint8), T.Q6_K, (0, 256))
    assert out.shape == (0, 256) and out.dtype == np.float32


def test_inf_scale_gives_nan_like_reference_without_warnings():
    data = random_blocks(np.random.default_rng(1), T.Q4_K, 1, 1)
    data[0, 0:2] = np.array([np.inf], np.float16).view(np.uint8)
    with np.errstate(all="raise"):
        out = dequantize(data, T.Q4_K, (1, 256))
    with np.errstate(all="ignore"):
        assert_identical(out, reference(data, T.Q4_K, (1, 256)))


# --- errors ---------------------------------------------------------------

UNSUPPORTED_TYPES = [t for t in T if t not in SUPPORTED_TYPES]


@pytest.mark.parametrize("qtype", UNSUPPORTED_TYPES, ids=lambda t: t.name)
def test_unsupported_type_is_a_model_format_error(qtype):
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    data = np.zeros(2 * type_size, dtype=np.uint8)
    with pytest.raises(ModelFormatError, match=rf"forerun cannot dequantize .*\b{qtype.name}\b"):
        dequantize(data, qtype, (2 * block_size,))


def test_iq2_xxs_message():
    with pytest.raises(ModelFormatError) as info:
        dequantize(np.zeros(66, np.uint8), T.IQ2_XXS, (256,))
    message = str(info.value)
    assert "IQ2_XXS" in message and "cannot dequantize" in message and "Q4_K" in message


def test_unknown_type_id_is_a_model_format_error():
    with pytest.raises(ModelFormatError, match="unknown GGML tensor type id 999"):
        dequantize(np.zeros(4, np.uint8), 999, (1,))


@pytest.mark.parametrize("qtype", BLOCK_TYPES + (T.F32, T.F16, T.BF16), ids=lambda t: t.name)
@pytest.mark.parametrize("delta", [-1, +1, -34])
def test_wrong_data_size_is_a_model_format_error(qtype, delta):
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    shape = (3, 2 * max(block_size, 32))
    expected = 3 * shape[1] // block_size * type_size
    data = np.zeros(expected + delta, np.uint8)
    message = (
        f"{qtype.name} tensor of shape [3, {shape[1]}] needs {expected} bytes of data "
        f"but has {expected + delta}"
    )
    with pytest.raises(ModelFormatError, match=re.escape(message)):
        dequantize(data, qtype, shape)


def test_truncated_typed_f32_data():
    with pytest.raises(ModelFormatError, match="needs 48 bytes of data but has 44"):
        dequantize(np.zeros(11, np.float32), T.F32, (3, 4))


def test_row_not_a_whole_number_of_blocks():
    message = "rows of 100 values, not a multiple of the block size 256"
    with pytest.raises(ModelFormatError, match=message):
        dequantize(np.zeros(144, np.uint8), T.Q4_K, (1, 100))


def test_negative_dimension():
    with pytest.raises(ModelFormatError, match="negative dimension"):
        dequantize(np.zeros(0, np.uint8), T.Q8_0, (-1, 32))


# --- real models --------------------------------------------------------------


def _real_gguf_paths() -> list[Path]:
    """The real GGUF model files available on this machine."""
    from real_presets import MODELS_DIR, have_model

    return [MODELS_DIR / name for name in ("qwen2.5-coder-0.5b.gguf", "smollm2-135m.gguf")
            if have_model(name)]


def _is_checked(name: str) -> bool:
    """The tensors of a real model worth checking: the embedding and two layers."""
    return name == "token_embd.weight" or name.startswith(("blk.0.", "blk.1."))


@pytest.mark.real_model
def test_real_model_tensors_match_reference():
    paths = _real_gguf_paths()
    if not paths:
        pytest.skip("no real GGUF model file found")
    seen_types = set()
    for path in paths:
        reader = gguf.GGUFReader(path)
        checked = [tensor for tensor in reader.tensors if _is_checked(tensor.name)]
        assert any(tensor.name == "token_embd.weight" for tensor in checked), path
        for tensor in checked:
            shape = tuple(reversed([int(dim) for dim in tensor.shape]))
            out = dequantize(tensor.data, tensor.tensor_type, shape)
            assert out.shape == shape and out.dtype == np.float32, (path.name, tensor.name)
            # Compare a slab of rows at a time to bound the reference's memory use.
            rows = out.reshape(-1, shape[-1])
            data_rows = tensor.data.reshape(rows.shape[0], -1)
            for start in range(0, rows.shape[0], 8192):
                slab = slice(start, start + 8192)
                expected = gguf.quants.dequantize(data_rows[slab], tensor.tensor_type)
                np.testing.assert_array_equal(
                    rows[slab].view(np.uint32),
                    expected.reshape(-1, shape[-1]).view(np.uint32),
                    err_msg=f"{path.name}: {tensor.name} ({tensor.tensor_type.name})",
                )
            seen_types.add(T(tensor.tensor_type))
    assert seen_types <= SUPPORTED_TYPES
