"""The packed-weight cache: a GGUF's q4/q8 network is built once and read
back bit for bit; a damaged or stale entry is rebuilt, never used; an
unwritable cache costs a warning, not the load."""

from __future__ import annotations

import json

import pytest
import torch

import forerun
import forerun.loading.gguf_quantized as gguf_quantized
from forerun.loading.cache_entry import check
from forerun.loading.content_key import file_digest
from forerun.loading.packed_cache import FILE_NAME, packed_entry

CPU = torch.device("cpu")


def logits(path, fmt: str) -> torch.Tensor:
    model = forerun.load(path, context_length=64, progress=False, weights=fmt)
    return model.decoder.feed(list(range(3, 40))).logits


def entry(path, fmt):
    return packed_entry(file_digest(path), fmt, CPU)


class GGUFRead(Exception):
    pass


@pytest.fixture()
def forbid_gguf_reads(monkeypatch):
    """Reading a tensor from the GGUF raises: what a cached load must not do."""
    def refuse(self, name):
        raise GGUFRead(name)
    return lambda: monkeypatch.setattr(gguf_quantized.GGUFQuantizedWeights, "__getitem__",
                                       refuse)


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_a_second_load_reads_the_packed_network(gguf_path, cache, forbid_gguf_reads, fmt):
    first = logits(gguf_path, fmt)
    assert check(entry(gguf_path, fmt)) is None
    forbid_gguf_reads()
    assert torch.equal(logits(gguf_path, fmt), first)
    # The check of this test: a load that must build reads the GGUF.
    with pytest.raises(GGUFRead):
        logits(gguf_path, "q8" if fmt == "q4" else "q4")


@pytest.mark.parametrize("damage", ["flipped", "truncated", "deleted", "manifest"])
def test_a_damaged_entry_is_rebuilt(gguf_path, cache, damage):
    first = logits(gguf_path, "q4")
    folder = entry(gguf_path, "q4").path
    target = folder / FILE_NAME
    data = bytearray(target.read_bytes())
    if damage == "flipped":
        for i in range(len(data) // 2, len(data) // 2 + 64):
            data[i] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "truncated":
        target.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "deleted":
        target.unlink()
    else:
        (folder / "manifest.json").write_text("garbage")
    assert check(entry(gguf_path, "q4")) is not None
    assert torch.equal(logits(gguf_path, "q4"), first)
    assert check(entry(gguf_path, "q4"), checksums="all") is None


def test_a_network_of_another_layout_is_rebuilt(gguf_path, cache):
    """A whole file that does not describe this model (a forerun that laid
    the network out differently) is rebuilt, with a warning."""
    from safetensors.torch import load_file, save_file

    from forerun.loading.cache_entry import describe_files, write_json_atomically

    first = logits(gguf_path, "q4")
    e = entry(gguf_path, "q4")
    target = e.path / FILE_NAME
    tensors = load_file(str(target))
    save_file(tensors, str(target), metadata={"forerun": json.dumps({"layers": []})})
    manifest = json.loads(e.manifest_path.read_text())
    manifest["files"] = describe_files(e.path, [FILE_NAME])
    write_json_atomically(e.manifest_path, manifest)
    assert check(e) is None
    with pytest.warns(UserWarning, match="rebuilding"):
        again = logits(gguf_path, "q4")
    assert torch.equal(again, first)


def test_an_unwritable_cache_costs_a_warning(gguf_path, cache, monkeypatch):
    first = logits(gguf_path, "q4")
    import forerun.loading.packed_cache as packed_cache

    def unwritable(entry, build, progress=False):
        raise forerun.errors.CacheError("the cache is read-only")
    monkeypatch.setattr(packed_cache, "ensure", unwritable)
    with pytest.warns(UserWarning, match="packed-weight cache is not used"):
        assert torch.equal(logits(gguf_path, "q4"), first)
