"""forerun's GGUF header parser against the ``gguf`` package's reader (the
reference), and on damaged files."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from forerun.errors import ModelFormatError  # noqa: E402
from forerun.loading.gguf_reader import GGUFHeader  # noqa: E402


def write_sample(path, *, alignment=None):
    """A GGUF with a value of every type, arrays (a vocabulary-like one
    among them) and tensors of several types and ranks."""
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment == 48:    # not a power of two: written as a bare key
        w.add_uint32("general.alignment", alignment)
    elif alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1.25e-6)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "Grüße, 世界")
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -2**62)
    w.add_float64("t.f64", 3.141592653589793)
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.5])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.empty", [])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(3000)] + ["", "ä€"])
    rng = np.random.default_rng(0)
    w.add_tensor("a", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("b", rng.standard_normal(32).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32),
                              gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("c", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("d", rng.standard_normal((2, 3, 32)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def assert_reads_as_reference(path):
    ours = GGUFHeader(path)
    ref = gguf.GGUFReader(str(path), "r")
    fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(fields)
    for key, value in fields.items():
        if key == "t.nested":   # the package's contents() flattens nested arrays
            continue
        assert ours.fields[key] == value, key
        assert type(ours.fields[key]) is type(value), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, theirs in zip(ours.tensors, ref.tensors):
        assert mine.shape == tuple(reversed(theirs.shape.tolist()))
        assert mine.tensor_type == theirs.tensor_type
        assert (mine.data_offset, mine.n_bytes) == (theirs.data_offset, theirs.n_bytes)
        assert np.array_equal(mine.data, np.asarray(theirs.data).reshape(-1).view(np.uint8))
    return ours


def test_every_value_and_tensor_reads_as_the_gguf_package_reads_it(tmp_path):
    header = assert_reads_as_reference(write_sample(tmp_path / "m.gguf"))
    assert header.fields["t.str"] == "Grüße, 世界"
    assert header.fields["t.nested"] == [[1, 2], [3]]
    assert header.tensors[3].shape == (2, 3, 32)


def test_a_set_alignment_moves_the_tensor_data(tmp_path):
    header = assert_reads_as_reference(write_sample(tmp_path / "m.gguf", alignment=64))
    assert all(t.data_offset % 64 == 0 for t in header.tensors)


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_a_real_model_reads_as_the_gguf_package_reads_it(preset_gguf, name):
    header = assert_reads_as_reference(preset_gguf(name))
    assert len(header.fields["tokenizer.ggml.tokens"]) > 49_000


def _header_end(path) -> int:
    return GGUFHeader(path).tensors[0].data_offset


def test_a_file_cut_anywhere_in_its_header_is_a_clear_error(tmp_path):
    whole = write_sample(tmp_path / "m.gguf").read_bytes()
    end = _header_end(tmp_path / "m.gguf")
    cut = tmp_path / "cut.gguf"
    for n in list(range(4, 200)) + list(range(200, end, 97)):
        cut.write_bytes(whole[:n])
        with pytest.raises(ModelFormatError, match="truncated or corrupt|truncated"):
            GGUFHeader(cut)


def test_a_file_cut_in_its_tensor_data_names_the_tensor(tmp_path):
    whole = write_sample(tmp_path / "m.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:-10])
    with pytest.raises(ModelFormatError, match="tensor 'd' ends at byte .* Download or copy"):
        GGUFHeader(cut)


def test_corrupt_bytes_give_a_format_error_or_a_parse_never_a_crash(tmp_path):
    path = write_sample(tmp_path / "m.gguf")
    whole = bytearray(path.read_bytes())
    end = _header_end(path)
    rng = np.random.default_rng(1)
    bad = tmp_path / "bad.gguf"
    errors = 0
    for _ in range(300):
        damaged = bytearray(whole)
        for at in rng.integers(4, end, size=int(rng.integers(1, 4))):
            damaged[at] = int(rng.integers(0, 256))
        bad.write_bytes(bytes(damaged))
        try:
            GGUFHeader(bad)
        except ModelFormatError:
            errors += 1
    # Most damage lands in a string or a number and still parses; lengths,
    # types and counts hit must be refused, and some are.
    assert errors > 30


@pytest.mark.parametrize("patch, message", [
    ((4, (1).to_bytes(4, "little")), "GGUF version 1; forerun reads versions 2 and 3"),
    ((4, (3).to_bytes(4, "big")), "big-endian GGUF file"),
    ((4, (77).to_bytes(4, "little")), "version field reads 77"),
    ((8, (2**60).to_bytes(8, "little")), "the header's entries runs past the end"),
])
def test_bad_header_words_are_named(tmp_path, patch, message):
    whole = bytearray(write_sample(tmp_path / "m.gguf").read_bytes())
    at, raw = patch
    whole[at:at + len(raw)] = raw
    (tmp_path / "bad.gguf").write_bytes(bytes(whole))
    with pytest.raises(ModelFormatError, match=message):
        GGUFHeader(tmp_path / "bad.gguf")


def test_an_alignment_that_is_not_a_power_of_two_is_refused(tmp_path):
    with pytest.raises(ModelFormatError, match="alignment is 48"):
        GGUFHeader(write_sample(tmp_path / "m.gguf", alignment=48))


def test_deeply_nested_arrays_are_refused_not_recursed(tmp_path):
    path = tmp_path / "deep.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    value: list = [1]
    for _ in range(12):
        value = [value]
    w.add_array("t.deep", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(ModelFormatError, match="nests arrays more than 8 deep"):
        GGUFHeader(path)
