"""forerun's native CPU kernels: their layouts, their products against
float64 sums of the same quantized values, row and thread invariance, and
what happens when they can't be built, are damaged, or are built by two
processes at once."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from engines.test_linear import _network
from forerun.engines import kernel_choice
from forerun.engines.layer_factory import make_linear
from forerun.engines.linear import quantize_int4, quantize_int8
from forerun.engines.native_linear import NativeInt4Linear, NativeInt6Linear, NativeInt8Linear
from forerun.engines.torch_engine import TorchDecoder
from forerun.kernels import binding, build, layouts, native, self_check
from forerun.machine.cpu import cpu_flags
from tiny_models import VOCAB

CPU = torch.device("cpu")


def _dequantized_rows(rows: binding.QuantizedRows, k: int) -> torch.Tensor:
    """The activations the kernels multiply, in float64, natural order."""
    values = layouts.from_chunks(rows.values).double()
    return (values * rows.scale.double().repeat_interleave(layouts.GROUP, 1))[:, :k]


def _random_q4(n: int, k: int, gen: torch.Generator):
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scale = torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3
    zero = torch.randn(n, k // 32, generator=gen) * 0.01
    from forerun.engines.linear import Int4Groups
    return Int4Groups(q, scale, zero)


def _random_q6(n: int, k: int, gen: torch.Generator):
    from forerun.engines.linear import Int6Blocks
    q = torch.randint(0, 64, (n, k), dtype=torch.uint8, generator=gen)
    scale = torch.randint(-128, 128, (n, k // 16), dtype=torch.int8, generator=gen)
    q[0, :40], scale[0, :3] = 63, -128                 # the extremes: no int16 overflow
    return Int6Blocks(q, scale, torch.rand(n, k // 256, generator=gen) * 2e-4 + 1e-5)


def _layer(fmt: str, w: torch.Tensor):
    """A native layer of ``fmt`` for float weights ``w`` (q6: 6-bit values
    near them, as a Q6_K tensor would hold)."""
    if fmt == "q6":
        values = _random_q6(*w.shape, torch.Generator().manual_seed(int(w.shape[0])))
        return make_linear(values, None, "q4", CPU)
    return make_linear(quantize_int4(w) if fmt == "q4" else quantize_int8(w), None, fmt, CPU)


# -- layouts --------------------------------------------------------------------------

def test_layouts_round_trip():
    gen = torch.Generator().manual_seed(0)
    v = torch.randint(-128, 128, (5, 512), dtype=torch.int8, generator=gen)
    chunks = layouts.to_chunks(v)
    assert not torch.equal(chunks, v) and torch.equal(layouts.from_chunks(chunks), v)
    # Chunk i of a block holds values 4i..4i+3 of each of its 8 groups.
    assert torch.equal(chunks[0, 32:36], v[0, 4:8]) and torch.equal(chunks[0, 36:40], v[0, 36:40])
    q = torch.randint(0, 16, (5, 512), dtype=torch.uint8, generator=gen)
    packed = layouts.pack_nibbles(q)
    assert packed.shape == (5, 256) and torch.equal(layouts.unpack_nibbles(packed), q)
    # Byte 0 holds value 0 of group 0 (chunk 0, low) and its value 4 (chunk 1, high).
    assert int(packed[0, 0]) == int(q[0, 0]) | int(q[0, 4]) << 4
    q6 = torch.randint(0, 64, (5, 512), dtype=torch.uint8, generator=gen)
    high = layouts.pack_high_bits(q6)
    assert high.shape == (5, 128)
    assert torch.equal(layouts.unpack_nibbles(layouts.pack_nibbles(q6 & 15))
                       | layouts.unpack_high_bits(high), q6)
    # Byte 0 of a block's first 32 bytes: value 0, 4, 8 and 12 of group 0
    # (chunks 0..3), their bits 4-5 at bits 0-1, 2-3, 4-5, 6-7.
    assert int(high[0, 0]) == sum((int(q6[0, 4 * i]) >> 4) << 2 * i for i in range(4))
    scale = torch.arange(64, dtype=torch.int8).reshape(2, 32)
    ordered = layouts.half_group_order(scale)
    assert ordered[0, :9].tolist() == [0, 2, 4, 6, 8, 10, 12, 14, 1]
    assert torch.equal(layouts.natural_half_order(ordered), scale)


def test_a_last_half_block_round_trips():
    """Inputs of a multiple of 128: whole blocks, then half a block whose
    chunk i holds values 4i..4i+3 of each of its 4 groups (16 bytes)."""
    v = torch.arange(3 * 384).reshape(3, 384)
    chunks = layouts.to_chunks(v)
    assert torch.equal(chunks[:, :256], layouts.to_chunks(v[:, :256]))
    assert torch.equal(chunks[0, 256:260], v[0, 256:260])           # chunk 0, group 0
    assert torch.equal(chunks[0, 260:264], v[0, 288:292])           # chunk 0, group 1
    assert torch.equal(chunks[0, 272:276], v[0, 260:264])           # chunk 1, group 0
    assert torch.equal(layouts.from_chunks(chunks), v)
    with pytest.raises(ValueError, match="multiple of 128"):
        layouts.to_chunks(v[:, :320])
    assert [layouts.input_unit(kind, rows) for kind, rows in (
        ("q8", 1), ("q8", 4), ("q4", 1), ("q6", 1))] == [128, 256, 256, 256]


@pytest.mark.parametrize("k", [100, 640, 896])
def test_an_8bit_layer_reads_a_half_block_as_its_whole_block_padding(kernels, k):
    """An 8-bit layer in one-row groups holds its inputs padded to 128, not
    256 (Gemma 3's hidden size of 640 is 640 bytes a row, not 768), and
    multiplies to what the same values padded to a whole block give, bit
    for bit, for 1 to 9 positions (passes of each height)."""
    if kernels.row_group != 1:
        pytest.skip("this build's row groups read whole blocks")
    gen = torch.Generator().manual_seed(k)
    values = quantize_int8(torch.randn(37, k, generator=gen))
    layer = NativeInt8Linear.build(values, None, kernels.row_group)
    kp = layouts.padded(k, 128)
    assert layer.q.shape == (37, kp) and kernels.k_unit == 128
    natural = layouts.from_chunks(layer.q)
    assert torch.equal(natural[:, :k], values.q) and not natural[:, k:].any()
    whole = layouts.to_chunks(torch.nn.functional.pad(natural, (0, layouts.padded(k) - kp)))
    for t in (1, 2, 3, 5, 6, 7, 9):
        x = torch.randn(t, k, generator=gen)
        assert torch.equal(layer(x), kernels.q8_linear(x, whole, layer.scale, 37)), t


def test_a_matrix_in_padding_its_kernels_dont_read_is_refused(kernels):
    """A 4-bit matrix padded to 128 inputs, or an 8-bit one in row groups of
    4, is refused by the layout check, and by the product itself."""
    with pytest.raises(ValueError, match="multiple of 256"):
        layouts.check_matrix("q4", 4, 384, {}, 1)
    with pytest.raises(ValueError, match="multiple of 256"):
        layouts.check_matrix("q8", 4, 384, {}, 4)
    q = torch.zeros(4, 192, dtype=torch.uint8)
    scale = torch.zeros(4, 12, dtype=torch.float16)
    with pytest.raises(ValueError, match="padded to 384"):
        kernels.q4_linear(torch.randn(1, 300), q, scale, scale, 4)


def test_row_groups_round_trip_and_read_rows():
    """Row groups: block b of rows 4m..4m+3 in turn, then block b + 1; rows
    are padded with zeros to a multiple of 4, and single rows read back.
    Groups of one row are the per-row layout."""
    v = torch.arange(6 * 3 * 2).reshape(6, 6)            # 6 rows, 3 blocks of 2 entries
    grouped = layouts.row_grouped(v, 3, 4)
    assert grouped.shape == (8, 6)
    # The first group's first block: rows 0..3's entries 0-1, then block 1.
    assert grouped[0].tolist() == [0, 1, 6, 7, 12, 13]
    assert grouped[1].tolist() == [18, 19, 2, 3, 8, 9]
    assert (layouts.from_row_groups(grouped, 3, 4)[6:] == 0).all()
    assert torch.equal(layouts.from_row_groups(grouped, 3, 4)[:6], v)
    index = torch.tensor([5, 0, 3, 3])
    assert torch.equal(layouts.rows_of_groups(grouped, index, 3, 4), v[index])
    assert layouts.padded_rows(6, 4) == 8 and layouts.padded_rows(8, 4) == 8
    assert torch.equal(layouts.row_grouped(v, 3, 1), v) and layouts.padded_rows(6, 1) == 6
    assert torch.equal(layouts.rows_of_groups(v, index, 3, 1), v[index])


@pytest.mark.parametrize("fmt", ["q4", "q6", "q8"])
def test_a_stored_layer_whose_arrays_do_not_fit_is_refused(kernels, fmt):
    """The kernels read [padded rows, ...] bytes of each array: a stored layer
    whose arrays are smaller (a truncated cache entry) or of another dtype
    is refused when restored, instead of being read past its end."""
    from forerun.errors import ConfigError

    gen = torch.Generator().manual_seed(0)
    rows = kernels.row_group
    layer = {"q4": lambda: NativeInt4Linear.build(_random_q4(6, 320, gen), None, rows),
             "q6": lambda: NativeInt6Linear.build(_random_q6(6, 512, gen), None, rows),
             "q8": lambda: NativeInt8Linear.build(quantize_int8(torch.randn(6, 300)), None,
                                                  rows)}[fmt]()
    meta, tensors = layer.state()
    restored = type(layer).restore(meta, dict(tensors))
    x = torch.randn(2, layer.in_features)
    assert torch.equal(restored(x), layer(x)) and layer(x).shape == (2, 6)
    for name, t in tensors.items():
        for bad in (t[:4], t[:, :-1] if t.dim() == 2 else t[:-1],
                    t.float() if t.dtype != torch.float32 else t.half()):
            with pytest.raises(ConfigError, match=f"{fmt} layer's arrays don't fit.*{name}"):
                type(layer).restore(meta, {**tensors, name: bad})
    with pytest.raises(ConfigError, match="don't fit its shape 9 x"):
        type(layer).restore({**meta, "shape": [9, layer.in_features]}, dict(tensors))


def test_a_layer_in_other_row_groups_than_the_kernels_is_refused(kernels):
    """Weights stored in another build's row groups (a packed network
    carried to a CPU that loads the other build) would multiply as
    garbage: the layer refuses to run, naming both."""
    from forerun.errors import ConfigError

    other = 1 if kernels.row_group == 4 else 4
    layer = NativeInt4Linear.build(_random_q4(6, 256, torch.Generator().manual_seed(0)),
                                   None, other)
    with pytest.raises(ConfigError, match=f"row groups of {other}, .* groups of "
                                          f"{kernels.row_group}"):
        layer(torch.randn(2, 256))
    meta, tensors = layer.state()
    with pytest.raises(ConfigError, match="row groups of 3"):
        NativeInt4Linear.restore({**meta, "rows": 3}, tensors)


def test_activations_are_quantized_per_group_of_32(kernels):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 300, generator=gen) * torch.rand(3, 300, generator=gen) * 5
    x[1] = 0                                          # an all-zero row: no 0/0
    rows = kernels.quantize(x)
    assert rows.values.shape == (3, 512) and rows.scale.shape == (3, 16)
    got = _dequantized_rows(rows, 512)
    step = rows.scale.double().repeat_interleave(32, 1)
    assert ((got[:, :300] - x.double()).abs() <= step[:, :300] / 2 + 1e-7).all()
    assert (got[:, 300:] == 0).all() and (rows.scale[:, 10:] == 0).all()   # the padding
    assert (got[1] == 0).all() and torch.isfinite(rows.scale).all()
    sums = layouts.from_chunks(rows.values).double().reshape(3, 16, 32).sum(-1)
    torch.testing.assert_close(rows.scaled_sums.double(), rows.scale.double() * sums)
    # Each group's largest value maps onto +-127.
    group_max = layouts.from_chunks(rows.values).reshape(3, 16, 32)[0, :9].abs().amax(-1)
    assert (group_max == 127).all()


@pytest.mark.parametrize("k", [300, 1536])
def test_a_nan_activation_makes_its_rows_products_nan(kernels, k):
    """Not a number: its group's scale is NaN, so every product of its row
    is NaN, which the engine's logits check refuses (it used to be
    quantized as 0, a finite wrong answer); the other rows are untouched."""
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(3, k, generator=gen)
    for col in (40, k - 3):             # a whole group, and (k = 300) the last, partial one
        bad = x.clone()
        bad[1, col] = float("nan")
        rows = kernels.quantize(bad)
        assert torch.isnan(rows.scale[1, col // 32]) and torch.isfinite(rows.scale[[0, 2]]).all()
        for fmt in ("q4", "q6", "q8") if k % 256 == 0 else ("q8",):   # whole blocks
            layer = _layer(fmt, torch.randn(8, k, generator=gen) * 0.1)
            y = layer(bad)
            assert torch.isnan(y[1]).all(), fmt
            assert torch.equal(y[[0, 2]], layer(x)[[0, 2]]), fmt


# -- products -------------------------------------------------------------------------

def _assert_products_are_sums(kernels, layer, weights: torch.Tensor, k: int, gen) -> None:
    """``layer``'s products of 1 to 9 rows are the float64 sums of the
    quantized activations times ``weights``, up to float32 rounding."""
    for t in (1, 2, 3, 4, 5, 9):
        x = torch.randn(t, k, generator=gen)
        want = _dequantized_rows(kernels.quantize(x), k) @ weights.double().t()
        got = layer(x).double()
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()) + 1e-6, t


@pytest.mark.parametrize("n,k", [(1, 32), (17, 96), (40, 256), (33, 896), (16, 1568)])
def test_the_4bit_product_is_the_sum_of_its_values(kernels, n, k):
    gen = torch.Generator().manual_seed(n + k)
    values = _random_q4(n, k, gen)
    layer = NativeInt4Linear.build(values, None, kernels.row_group)
    _assert_products_are_sums(kernels, layer, layer.weight_rows(), k, gen)


@pytest.mark.parametrize("n,k", [(1, 32), (17, 100), (40, 256), (33, 896), (16, 1568)])
def test_the_8bit_product_is_the_sum_of_its_values(kernels, n, k):
    gen = torch.Generator().manual_seed(n + k)
    values = quantize_int8(torch.randn(n, k, generator=gen))
    values.q[0, :5] = -128                             # the one value that has no negation
    layer = NativeInt8Linear.build(values, None, kernels.row_group)
    assert torch.equal(layer.weight_rows(), values.dequantize())
    _assert_products_are_sums(kernels, layer, values.dequantize(), k, gen)


@pytest.mark.parametrize("n,k", [(1, 256), (17, 512), (40, 256), (33, 1536), (16, 8960)])
def test_the_6bit_product_is_the_sum_of_its_values(kernels, n, k):
    gen = torch.Generator().manual_seed(n + k)
    values = _random_q6(n, k, gen)
    layer = NativeInt6Linear.build(values, None, kernels.row_group)
    assert torch.equal(layer.weight_rows(), values.dequantize())
    _assert_products_are_sums(kernels, layer, values.dequantize(), k, gen)


def test_weights_keep_their_values(kernels):
    """q4's float16 scale and minimum are the layer's only rounding."""
    gen = torch.Generator().manual_seed(2)
    values = _random_q4(24, 896, gen)
    layer = NativeInt4Linear.build(values, torch.randn(24, generator=gen), kernels.row_group)
    scale = values.scale.half().double().repeat_interleave(32, 1)
    minimum = (values.zero - 8 * values.scale).half().double().repeat_interleave(32, 1)
    torch.testing.assert_close(layer.weight_rows().double(), values.q.double() * scale + minimum)
    index = torch.tensor([3, 0, 23])
    assert torch.equal(layer.weight_rows(index), layer.weight_rows()[index])
    x = torch.randn(2, 896, generator=gen)
    no_bias = NativeInt4Linear.build(values, None, kernels.row_group)
    assert torch.equal(layer(x), no_bias(x) + layer.bias)


@pytest.mark.parametrize("fmt", ["q4", "q6", "q8"])
def test_a_row_is_the_same_alone_or_among_others(kernels, fmt):
    """Bit for bit, for every batch size up to 17 and every place in it."""
    gen = torch.Generator().manual_seed(4)
    layer = _layer(fmt, torch.randn(64, 1536, generator=gen) * 0.05)
    assert getattr(layer, "kernel", None) == "native" and layer.format == fmt
    x = torch.randn(17, 1536, generator=gen)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(17)])
    for t in range(2, 18):
        assert torch.equal(layer(x[:t]), alone[:t]), t
    assert torch.equal(layer(x[5:12]), alone[5:12])


@pytest.mark.parametrize("fmt", ["q4", "q6"])
def test_the_thread_count_does_not_change_a_result(kernels, fmt):
    gen = torch.Generator().manual_seed(5)
    layer = _layer(fmt, torch.randn(300, 1536, generator=gen))
    x = torch.randn(6, 1536, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
        torch.set_num_threads(2)
        assert torch.equal(layer(x), one)
    finally:
        torch.set_num_threads(before)


def test_threads_can_share_a_layer(kernels):
    gen = torch.Generator().manual_seed(6)
    layer = make_linear(torch.randn(256, 512, generator=gen), None, "q4", CPU)
    inputs = [torch.randn(3, 512, generator=gen) for _ in range(4)]
    want = [layer(x) for x in inputs]
    bad = []

    def run(i: int) -> None:
        for _ in range(30):
            if not torch.equal(layer(inputs[i]), want[i]):
                bad.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not bad


@pytest.mark.parametrize("fmt", ["q8", "q4"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_verification_is_one_position_feeds_without_grouping(kernels, fmt, arch):
    """A whole model on the native kernels: 9 positions fed at once (and as
    a tree through forward()) give the logits of 9 one-position feeds, with
    no cut into groups, so greedy speculation is plain decoding."""
    network = _network(fmt, arch)
    assert network.matrix_kernels == "native"
    decoder = TorchDecoder(network, 256)
    tokens = [int(t) for t in torch.randint(3, VOCAB, (170,),
                                            generator=torch.Generator().manual_seed(1))]
    decoder.verify_group = 16
    decoder.feed(tokens[:150], last_only=True)
    more = tokens[160:169]
    one_by_one = torch.cat([decoder.feed([t]).logits for t in more])
    decoder.rollback(150)
    assert torch.equal(decoder.feed(more).logits, one_by_one)
    decoder.rollback(150)
    mask = torch.ones(9, 159, dtype=torch.bool).tril(diagonal=150)
    assert torch.equal(decoder.forward(more, torch.arange(150, 159), mask).logits, one_by_one)


# -- building, and when it fails -----------------------------------------------------

def test_the_kernels_load_where_they_can(monkeypatch):
    """On an x86-64 CPU with AVX2 and a C compiler they must load: a build
    or self-check that fails there is a bug, not a fallback to hide."""
    import platform
    import shutil

    if (platform.machine().lower() not in ("x86_64", "amd64")
            or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512")
            or not (shutil.which("cc") or shutil.which("gcc"))):
        pytest.skip("no AVX2 or no C compiler here")
    monkeypatch.setenv(native.SWITCH, "1")
    native.reset()
    try:
        assert native.native_kernels() is not None, native.unavailable_reason()
    finally:
        native.reset()


def test_turned_off_by_the_switch(monkeypatch):
    monkeypatch.setenv(native.SWITCH, "0")
    native.reset()
    try:
        assert native.native_kernels() is None
        assert native.SWITCH in native.unavailable_reason()
        assert native.calibration_key() == "off"
        monkeypatch.setenv(native.SWITCH, "1")
        assert native.calibration_key().startswith("forced-")
        monkeypatch.delenv(native.SWITCH)
        assert len(native.calibration_key()) == 12
        layer = make_linear(torch.randn(32, 64), None, "q4", CPU)
        assert getattr(layer, "kernel", "torch") == "torch" and layer.format == "q4"
    finally:
        native.reset()


def test_without_the_switch_choosing_needs_a_timing(kernels, monkeypatch):
    """Unforced, whether the products run natively is decided by timing,
    which the kernels leave to their caller: asked without one they raise
    and keep nothing; the first decision is kept for later calls."""
    monkeypatch.delenv(native.SWITCH)
    native.reset()
    with pytest.raises(RuntimeError, match="no timing was given"):
        native.native_kernels()
    slower = native.Timing(lambda k: "slower here", lambda name, dot, avx2: "slower here")
    assert native.native_kernels(slower) is None
    assert native.unavailable_reason() == "slower here" and native.native_kernels() is None
    native.reset()
    faster = native.Timing(lambda k: None, lambda name, dot, avx2: None)
    assert native.native_kernels(faster) is not None
    assert native.native_kernels() is native.native_kernels(slower)


def test_the_kernels_import_nothing_above_them():
    """forerun.kernels is a bottom layer: importing all of it loads only
    itself, forerun.machine and forerun.errors."""
    script = ("import sys; import forerun.kernels.native, forerun.kernels.self_check; "
              "print(sorted(m for m in sys.modules if m.startswith('forerun.') and not "
              "m.startswith(('forerun.kernels', 'forerun.machine', 'forerun.errors'))))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.stdout.strip() == "[]", done.stderr


def test_no_compiler_means_torch_kernels(fresh_cache, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    kernels = native.native_kernels()
    assert kernels is None and "/nonexistent/cc" in native.unavailable_reason()
    assert getattr(make_linear(torch.randn(32, 64), None, "q8", CPU), "kernel", "torch") == "torch"


def test_a_build_error_is_reported(fresh_cache, monkeypatch, tmp_path):
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(build, "SOURCE", broken)
    assert native.native_kernels() is None
    assert "failed to build broken.c" in native.unavailable_reason()
    # No half-written library left, nor its temporary: only the build's lock.
    assert [p.name for p in fresh_cache.iterdir() if not p.name.endswith(".so.lock")] == []


def _load_in_a_process(cache) -> str:
    """``native_kernels()`` in a fresh Python (a process that already
    loaded the library would get its old copy back from the loader)."""
    script = ("from forerun.kernels import native; k = native.native_kernels(); "
              "print(k is not None, native.unavailable_reason())")
    env = {**os.environ, "FORERUN_CACHE": str(cache), native.SWITCH: "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    return done.stdout.strip()


def _libraries_a_load_builds() -> int:
    """The AVX2 library, and its vpdpbusd build where this CPU has the instruction."""
    return 1 + bool(build.dot_builds(cpu_flags()))   # the first dot build that passes


def test_a_damaged_library_is_built_again(fresh_cache):
    assert _load_in_a_process(fresh_cache.parent) == "True None"
    built = list(fresh_cache.glob("*.so"))
    assert len(built) == _libraries_a_load_builds()
    for library in built:
        library.unlink()
        library.write_bytes(b"\x7fELF damaged")
    assert _load_in_a_process(fresh_cache.parent) == "True None"
    assert all(library.stat().st_size > 1000 for library in built)


def test_a_library_that_computes_wrongly_is_refused(altered_source):
    """The self-check catches a build that computes other numbers (here the
    source with the low nibbles read as the high ones)."""
    altered_source("SOURCE", "_mm256_maddubs_epi16(w0,", "_mm256_maddubs_epi16(w1,")
    assert native.native_kernels() is None
    assert "computes 4-bit products wrongly" in native.unavailable_reason()


def test_a_library_whose_half_blocks_are_wrong_is_refused(altered_source):
    """The self-check compares an 8-bit matrix ending in half a block with
    the same matrix padded to a whole one: a build that sums the half
    block's second chunks into the first ones is refused."""
    altered_source("SOURCE", "_mm256_extracti128_si256(s32[t], 1));",
                   "_mm256_castsi256_si128(s32[t]));")
    assert native.native_kernels() is None
    assert "half block differ" in native.unavailable_reason()


def test_two_processes_building_at_once_both_get_a_whole_library(real_compiler, fresh_cache):
    script = ("from forerun.kernels import native; k = native.native_kernels(); "
              "print(k is not None, native.unavailable_reason())")
    env = {**os.environ, "FORERUN_CACHE": str(fresh_cache.parent)}
    runs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                             text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=300)[0].strip() for run in runs]
    assert outputs == ["True None", "True None"]
    assert len(list(fresh_cache.glob("*.so"))) == _libraries_a_load_builds()
    assert len(list(fresh_cache.glob("*.so.manifest.json"))) == _libraries_a_load_builds()
    assert not [p for p in fresh_cache.iterdir() if ".tmp" in p.name]


def test_threads_loading_at_once_share_one_library(real_compiler, fresh_cache):
    got = []
    threads = [threading.Thread(target=lambda: got.append(native.native_kernels()))
               for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(got) == 4 and got[0] is not None and all(k is got[0] for k in got)


def test_a_read_only_cache_builds_in_a_temporary_folder(fresh_cache, monkeypatch, tmp_path):
    """...and removes it once the library is loaded (issue 42: every run
    left a forerun-kernels-* folder in $TMPDIR)."""
    import stat
    import tempfile

    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    if os.geteuid() == 0:
        # root writes into read-only folders; fail the cache's writes instead.
        def refuse(*args, **kwargs):
            raise PermissionError("read-only")
        real = build.tempfile.mkstemp
        monkeypatch.setattr(build.tempfile, "mkstemp",
                            lambda *a, **k: refuse() if str(fresh_cache) in str(k.get("dir"))
                            else real(*a, **k))
    else:
        fresh_cache.mkdir(parents=True)
        fresh_cache.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        kernels = native.native_kernels()
    finally:
        if os.geteuid() != 0:
            fresh_cache.chmod(stat.S_IRWXU)
    assert kernels is not None and fresh_cache not in kernels.path.parents
    assert list(scratch.iterdir()) == [] and not kernels.path.exists()


@pytest.mark.parametrize("fmt", ["q4", "q8", "q4-all"])
def test_a_tied_head_shares_its_rows_with_the_embedding(kernels, fmt):
    """A tied LM head runs on the native kernels (int8 in every quantized
    format: 4 bits cost SmolLM2's top-token agreement 12 points), the
    embedding reads its rows from the head's layout (one copy), and the
    network stored and restored computes the same logits, still sharing
    them."""
    from forerun.engines.transformer import Transformer
    from forerun.protocol.model_config import ModelConfig
    from tiny_models import hf_model

    model = hf_model("qwen2", hidden_size=96, intermediate_size=256, num_attention_heads=4,
                     num_key_value_heads=2, tie_word_embeddings=True)
    config = ModelConfig.from_hf(model.config.to_dict())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    network = Transformer(config, state, weights_format=fmt)
    head, embed = network.lm_head, network.embed
    assert head.kernel == "native" and embed.head is head and embed.q is None
    assert head.format == "q8"
    tokens = torch.tensor([0, 5, VOCAB - 1])
    assert torch.equal(embed(tokens), head.weight_rows(tokens))
    want = quantize_int8(state["model.embed_tokens.weight"]).dequantize()
    assert torch.equal(embed(tokens), want[tokens])
    assert embed(tokens[None]).shape == (1, 3, 96)
    prompt = list(range(3, 30))
    logits = TorchDecoder(network, 64).feed(prompt).logits
    meta, tensors = network.state()
    assert meta["embed_from_head"] and not any(k.startswith("embed.") for k in tensors)
    copy = Transformer.from_state(config, meta, tensors)
    assert copy.embed.head is copy.lm_head
    assert torch.equal(TorchDecoder(copy, 64).feed(prompt).logits, logits)


@pytest.mark.parametrize("winner", ["native", "torch"])
def test_they_run_only_where_they_beat_torchs(fresh_cache, monkeypatch, winner):
    """Without the switch, the kernels are timed against torch's once per
    machine (kept), and used only where they are faster."""
    monkeypatch.delenv(native.SWITCH)
    calls = []

    def timing(kernels, repeats=3):
        calls.append(1)
        fast, slow = [10.0, 20.0], [30.0, 40.0]
        return {"native": fast, "torch": slow} if winner == "native" else \
            {"native": slow, "torch": fast}

    monkeypatch.setattr(kernel_choice, "time_against_torch", timing)
    got = kernel_choice.product_kernels()
    assert (got is not None) == (winner == "native") and calls == [1]
    if winner == "torch":
        assert "torch's kernels were faster" in native.unavailable_reason()
        assert "30.0/40.0" in native.unavailable_reason()
        assert make_linear(torch.randn(32, 64), None, "q4", CPU).kernel == "torch"
    native.reset()
    assert (kernel_choice.product_kernels() is not None) == (winner == "native") and calls == [1]
    for record in (fresh_cache.parent / "calibration" / "native-kernels").glob("*.json"):
        record.write_text('{"native": [1.0]}')          # damaged: measured again
    native.reset()
    kernel_choice.product_kernels()
    assert calls == [1, 1]


def test_the_timing_against_torch_runs(kernels):
    ms = kernel_choice.time_against_torch(kernels, repeats=1)
    assert set(ms) == {"native", "torch"}
    assert all(len(v) == 2 and all(0 < t < 1e4 for t in v) for v in ms.values())


# -- the vpdpbusd build ---------------------------------------------------------------

def test_the_dot_product_build_follows_the_cpu_flags():
    zen4 = {"avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512bw", "avx512_vnni",
            "avx512_bf16"}
    builds = {name: extra for name, _, extra in build.DOT_BUILDS}
    assert build.dot_builds(zen4) == [("avx512-vnni", builds["avx512-vnni"])]
    xeon = zen4 | {"amx_tile", "amx_int8", "amx_bf16"}
    assert build.dot_builds(xeon) == [("amx-int8", builds["amx-int8"]),
                                      ("avx512-vnni", builds["avx512-vnni"])]
    assert build.dot_builds(zen4 | {"amx_tile"}) == [("avx512-vnni", builds["avx512-vnni"])]
    assert build.dot_builds({"avx2", "avx_vnni"}) == [("avx-vnni", builds["avx-vnni"])]
    assert build.dot_builds({"avx2", "avx512_vnni"}) == []       # VNNI needs 512-bit VL here
    assert build.dot_builds(zen4 - {"avx512bw"}) == []           # and byte operations
    assert build.dot_builds({"avx2", "fma", "f16c"}) == []


@pytest.mark.parametrize("which", ["stand-in", "this CPU's"])
def test_the_vpdpbusd_code_gives_the_avx2_products_bit_for_bit(kernels, which):
    """The products' vpdpbusd code equals the AVX2 build bit for bit, in
    every format, through layers and at any number of rows, each build given
    the weights in its own row groups (4 rows interleaved, with a group part
    padding, against the AVX2 build's one): built with its AVX2 stand-in for
    the instruction (what a CPU without VNNI can run), and as this CPU's
    VNNI build where it has one."""
    avx2 = native.layer_ops()
    if which == "stand-in":
        stand_in = native.build_library(build.STAND_IN_FLAGS)
        assert stand_in.instruction == "avx2 stand-in for vpdpbusd"
    else:
        chosen = build.dot_builds(cpu_flags())
        if not chosen:
            pytest.skip("this CPU has no vpdpbusd")
        stand_in = native.build_library(chosen[0][1])
        assert stand_in.instruction.split()[0] in ("amx-int8", "avx512-vnni", "avx-vnni")
    assert avx2.instruction == "avx2"
    assert stand_in.path != avx2.path
    self_check.check_same_products(stand_in, avx2)
    assert (stand_in.row_group, avx2.row_group) in ((4, 1), (1, 1))
    gen = torch.Generator().manual_seed(3)
    k = 768
    values = (_random_q4(19, k, gen), _random_q6(19, k, gen),
              quantize_int8(torch.randn(19, k, generator=gen)))
    layers = {lib.row_group: [cls.build(v, None, lib.row_group) for cls, v in zip(
        (NativeInt4Linear, NativeInt6Linear, NativeInt8Linear), values)]
        for lib in (stand_in, avx2)}
    for t in (1, 4, 6, 7, 13):
        x = torch.randn(t, k, generator=gen)

        def products(lib, x=x):
            q4, q6, q8 = layers[lib.row_group]
            return (lib.q4_linear(x, q4.q, q4.scale, q4.minimum, 19),
                    lib.q6_linear(x, q6.low, q6.high, q6.scale, q6.d, 19),
                    lib.q8_linear(x, q8.q, q8.scale, 19))
        for ours, theirs, fmt in zip(products(stand_in), products(avx2), ("q4", "q6", "q8")):
            assert torch.equal(ours, theirs), (fmt, t)


def test_the_vnni_builds_compile(fresh_cache):
    """Each VNNI build compiles (this CPU may not run it: a VNNI one is
    checked against the AVX2 build where it loads), with the compiler
    forerun finds: the suite's caching one (tests/caching_compiler.py),
    which compiles each source and flags once for this compiler."""
    try:
        compiler = build.find_compiler()
    except build.Unavailable:
        pytest.skip("no C compiler here")
    for name, _, extra in build.DOT_BUILDS:
        path = build.compile_library(compiler, extra)
        assert path.is_file() and path.stat().st_size > 1000, name


def _as_if_the_cpu_had_vpdpbusd(monkeypatch) -> None:
    """The stand-in build offered as this CPU's dot-product build."""
    monkeypatch.setattr(native, "dot_builds", lambda flags: [("stand-in", build.STAND_IN_FLAGS)])


# -- the AMX build ------------------------------------------------------------------

def _amx_flags() -> tuple[str, ...]:
    """The compiler flags of this CPU's AMX build (the test is skipped where
    the CPU has no AMX tiles)."""
    flags = dict(build.dot_builds(cpu_flags()))
    if "amx-int8" not in flags:
        pytest.skip("this CPU has no AMX tiles")
    return flags["amx-int8"]


@pytest.fixture()
def amx_build(kernels):
    """This CPU's AMX build, its tiles taking every product (the test is
    skipped where the CPU has none or the OS refuses them); its own start
    is restored after (the loaded library is the process's)."""
    amx = native.build_library(_amx_flags())
    if amx.instruction != "amx-int8":
        pytest.skip(amx.instruction)
    rows = amx.tile_rows
    amx.set_tile_rows(1)
    yield amx
    amx.set_tile_rows(rows)


@pytest.mark.parametrize("n,k", [(37, 1280), (16, 1536), (3, 256)])
def test_the_amx_tiles_give_the_avx2_products_bit_for_bit(amx_build, n, k):
    """Through the tiles (16 weight rows by 16 positions a product), every
    format's products equal the AVX2 build's bit for bit: any number of
    positions (part tiles of positions and of rows), each position's result
    the same as alone."""
    amx, avx2 = amx_build, native.layer_ops()
    gen = torch.Generator().manual_seed(5)
    values = (_random_q4(n, k, gen), _random_q6(n, k, gen),
              quantize_int8(torch.randn(n, k, generator=gen)))
    layers = {lib.row_group: [cls.build(v, None, lib.row_group) for cls, v in zip(
        (NativeInt4Linear, NativeInt6Linear, NativeInt8Linear), values)]
        for lib in (amx, avx2)}

    def products(lib, x):
        q4, q6, q8 = layers[lib.row_group]
        return (lib.q4_linear(x, q4.q, q4.scale, q4.minimum, n),
                lib.q6_linear(x, q6.low, q6.high, q6.scale, q6.d, n),
                lib.q8_linear(x, q8.q, q8.scale, n))
    for t in (1, 5, 16, 17, 40, 130):
        x = torch.randn(t, k, generator=gen) * 2
        for ours, theirs, fmt in zip(products(amx, x), products(avx2, x), ("q4", "q6", "q8")):
            assert torch.equal(ours, theirs), (fmt, t)
        alone = products(amx, x[-1:])
        assert all(torch.equal(a[0], b[-1]) for a, b in zip(alone, products(amx, x)))


def test_the_amx_tiles_start_where_they_are_told(amx_build):
    """The positions from which the tiles run are the build's own until
    changed; the other builds have none to change."""
    amx = amx_build
    assert amx.tile_rows == 1
    amx.set_tile_rows(64)
    assert amx.tile_rows == 64
    assert native.layer_ops().tile_rows is None
    with pytest.raises(ValueError, match="no AMX tiles"):
        native.layer_ops().set_tile_rows(1)


def test_an_amx_build_that_computes_wrongly_is_not_used(altered_source):
    """An AMX build whose tile products are off (here each 4-bit group's
    minimum left out, in the tiles' float steps only) fails the bit-for-bit
    check at the positions its tiles take, and the next build serves."""
    _amx_flags()
    altered_source("TILES_SOURCE", "a = _mm512_fmadd_ps(_mm512_set1_ps(scales[TM + row]), ds, a);",
                   "")
    kernels = native.native_kernels()
    assert kernels is not None and kernels.instruction.startswith("avx512-vnni")
    assert "the amx-int8 build is not used" in native.dot_product_reason()
    assert "4-bit products of 16 rows" in native.dot_product_reason()


def test_a_vpdpbusd_build_that_computes_wrongly_is_not_used(altered_source, monkeypatch):
    """A dot-product build that computes other numbers (here each 4-bit
    group sum one too large, in its vpdpbusd code only) is refused, and the
    AVX2 build serves."""
    altered_source("SOURCE", "#define Q4_DOT(s) (s)",
                   "#define Q4_DOT(s) _mm256_add_epi32(s, _mm256_set1_epi32(1))")
    _as_if_the_cpu_had_vpdpbusd(monkeypatch)
    kernels = native.native_kernels()
    assert kernels is not None and kernels.instruction == "avx2"
    assert native.layer_ops() is kernels
    assert "the stand-in build is not used" in native.dot_product_reason()
    assert "4-bit" in native.dot_product_reason()


def test_a_build_whose_512bit_attention_differs_is_not_used(altered_source, monkeypatch):
    """An AVX-512 build whose attention sums a score in another order (here
    the second step of hsum8x16 pairing lanes 0 + 1 where hsum8 adds 0 + 2,
    in its 512-bit passes only) is refused by the load-time check, and the
    AVX2 build serves."""
    flags = dict(build.dot_builds(cpu_flags()))
    if "avx512-vnni" not in flags:
        pytest.skip("this CPU has no AVX-512 build")
    monkeypatch.setattr(native, "dot_builds", lambda cpu: [("avx512-vnni", flags["avx512-vnni"])])
    altered_source("LAYER_OPS_SOURCE", "ab = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), "
                   "_mm512_shuffle_ps(a, b, 0xEE));", "ab = _mm512_add_ps(_mm512_shuffle_ps("
                   "a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));")
    kernels = native.native_kernels()
    assert kernels is not None and kernels.instruction == "avx2"
    reason = native.dot_product_reason()
    assert "the avx512-vnni build is not used" in reason
    assert "attention of 1 rows over a float32 cache differs" in reason


class _OneProductOff:
    """A library whose ``name`` products of ``rows`` rows are one float32
    step off in one value (what a float64 tolerance lets through)."""

    def __init__(self, inner, name: str, rows: int) -> None:
        self.inner, self.name, self.rows = inner, name, rows

    def __getattr__(self, attribute):
        run = getattr(self.inner, attribute)
        if attribute != self.name:
            return run

        def off(x, *args):
            y = run(x, *args)
            if y.shape[0] == self.rows:
                y[-1, -1] = torch.nextafter(y[-1, -1], torch.tensor(float("inf")))
            return y
        return off


@pytest.mark.parametrize("name, label, rows", [("q4_linear", "4-bit", 1),
                                               ("q6_linear", "6-bit", 5),
                                               ("q8_linear", "8-bit", 9)])
def test_products_one_step_off_the_avx2_ones_are_caught(kernels, name, label, rows):
    avx2 = native.layer_ops()
    with pytest.raises(build.Unavailable, match=f"its {label} products of {rows} rows differ"):
        self_check.check_same_products(_OneProductOff(avx2, name, rows), avx2)


@pytest.mark.parametrize("winner", ["stand-in", "avx2"])
def test_the_vpdpbusd_build_is_used_only_where_it_is_faster(fresh_cache, monkeypatch, winner):
    """Without the switch, the dot-product build is timed against the AVX2
    one once per machine (kept) and used only where it is faster."""
    monkeypatch.delenv(native.SWITCH)
    _as_if_the_cpu_had_vpdpbusd(monkeypatch)
    monkeypatch.setattr(kernel_choice, "time_against_torch",
                        lambda kernels, repeats=3: {"native": [1.0, 2.0], "torch": [9.0, 9.0]})
    calls = []

    def timing(candidates, repeats=3, positions=()):
        calls.append(sorted(candidates))
        assert positions == kernel_choice.DOT_TIMED_POSITIONS
        return {name: [1.0, 2.0, 5.0] if name == winner else [3.0, 4.0, 6.0]
                for name in candidates}

    monkeypatch.setattr(kernel_choice, "time_q4_mlp", timing)
    for _ in range(2):
        kernels = kernel_choice.product_kernels()
        want = "avx2" if winner == "avx2" else "avx2 stand-in for vpdpbusd"
        assert kernels.instruction == want and calls == [["avx2", "stand-in"]]
        reason = native.dot_product_reason()
        assert (reason is None) == (winner == "stand-in")
        if winner == "avx2":
            assert "no faster" in reason and "stand-in 3.0/4.0/6.0 ms" in reason
        native.reset()


@pytest.mark.parametrize("dot, avx2, used", [
    # a tie within noise at 1 and 4 positions, twice as fast at 128 (a Xeon
    # with AMX, where the sum at 1 and 4 alone kept the AVX2 build)
    ([0.97, 1.23, 12.9], [0.93, 1.19, 28.6], True),
    # twice as fast at 1 and 4 positions, a little slower at 128 (a sum
    # of times would let the 128 positions decide alone)
    ([0.50, 0.60, 30.0], [1.00, 1.20, 28.0], True),
    # faster at 1 and 4 positions, far slower at 128
    ([0.80, 1.00, 60.0], [1.00, 1.20, 28.0], False),
    ([1.00, 1.00, 1.00], [1.00, 1.00, 1.00], False),
])
def test_each_timed_position_count_weighs_alike_in_the_vpdpbusd_choice(monkeypatch, dot, avx2,
                                                                       used):
    monkeypatch.setattr(kernel_choice, "_timed_once",
                        lambda *args, **kwargs: {"vnni": dot, "avx2": avx2})
    reason = kernel_choice.dot_against_avx2("vnni", None, None)
    assert (reason is None) == used
    if not used:
        assert "no faster" in reason and "1/4/128 positions" in reason


def test_the_amx_tiles_are_tried_in_a_process_of_their_own(amx_build):
    """The probe of the tiles runs in a separate process and passes here."""
    self_check.check_tiles_in_a_process(amx_build)


def test_an_amx_build_whose_tiles_fault_is_not_used(altered_source):
    """Tiles that fault (here the probe traps, SIGILL, as an instruction
    the machine refuses would) end the probe process, never the caller's:
    the build is refused, saying so, and the next build serves."""
    _amx_flags()
    altered_source("TILES_SOURCE", "    if (!fr_amx_ready()) return 0;\n    static uint8_t w",
                   "    __builtin_trap();\n    static uint8_t w")
    kernels = native.native_kernels()
    assert kernels is not None and kernels.instruction.startswith("avx512-vnni")
    assert "its AMX tiles ended a probe process with SIGILL" in native.dot_product_reason()
