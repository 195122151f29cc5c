"""The packed-weight cache: a GGUF's q4/q8 network is built once and read
back bit for bit; a damaged or stale entry is rebuilt, never used; an
unwritable cache costs a warning, not the load."""

from __future__ import annotations

import json
import os

import pytest
import torch

import forerun
import forerun.loading.cache_entry as cache_entry
import forerun.loading.gguf_quantized as gguf_quantized
import forerun.loading.packed_cache as packed_cache
from forerun.loading.cache_entry import check
from forerun.loading.content_key import file_digest
from forerun.loading.packed_cache import FAST_DIGEST, FILE_NAME, packed_entry
from forerun.machine import huge_pages

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


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_an_architectures_own_norms_are_packed_too(arch, cache, tmp_path, forbid_gguf_reads,
                                                   matrix_kernels):
    """Qwen3's q/k norms and Gemma 3's four norms a layer come back from
    the packed network bit for bit, on either kernels (on torch's, Gemma 3's
    tied LM head reads the stored embedding: it once crashed the process,
    its int8 weights read where the file put them, off a 16-byte boundary)."""
    from tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch=arch, hidden_size=128,
                           intermediate_size=256)
    first = logits(path, "q8")
    forbid_gguf_reads()
    assert torch.equal(logits(path, "q8"), first)


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
    import xxhash
    from safetensors.torch import load_file, save_file

    from forerun.loading.cache_entry import describe_files, write_json_atomically

    first = logits(gguf_path, "q4")
    e = entry(gguf_path, "q4")
    target = e.path / FILE_NAME
    tensors = load_file(str(target))
    save_file(tensors, str(target), metadata={"forerun": json.dumps({"layers": []})})
    manifest = json.loads(e.manifest_path.read_text())
    manifest["files"] = describe_files(e.path, [FILE_NAME])
    manifest["meta"][FAST_DIGEST] = xxhash.xxh3_128(target.read_bytes()).hexdigest()
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


def rot(path, count: int = 192) -> None:
    """Flip ``count`` bytes in the middle of ``path`` in place, keeping its
    size, modification time and inode, as disk corruption does."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        data = f.read(count)
        f.seek(st.st_size // 2)
        f.write(bytes(b ^ 0xFF for b in data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
        st.st_size, st.st_mtime_ns, st.st_ino)


@pytest.fixture()
def large_files(monkeypatch):
    """Every file is "large" to the entry's check (re-read only when its
    stamp changed), as the 121 MB network of the report was."""
    monkeypatch.setattr(cache_entry, "SMALL_FILE_BYTES", 0)


def test_bit_rot_that_keeps_the_stamp_is_rebuilt(gguf_path, cache, large_files, capsys):
    """Issue 42, row 2: 192 bytes flipped in a packed network, its mtime kept,
    gave different text from then on.  Every load checks the whole file."""
    first = logits(gguf_path, "q4")
    e = entry(gguf_path, "q4")
    rot(e.path / FILE_NAME)
    assert check(e) is None                       # the stamp shortcut can't see it
    capsys.readouterr()
    assert torch.equal(logits(gguf_path, "q4"), first)
    assert "damaged (its xxh3_128 differs" in capsys.readouterr().err
    assert check(e, checksums="all") is None      # the rebuilt entry is whole


@pytest.mark.parametrize("damage", [False, True])
def test_an_entry_without_the_digest_is_checked_by_its_sha256(gguf_path, cache, large_files,
                                                             forbid_gguf_reads, capsys, damage):
    """An entry built before the fast digest was recorded is checked against
    its manifest's SHA-256 and, whole, gets the digest; damaged, is rebuilt."""
    first = logits(gguf_path, "q4")
    e = entry(gguf_path, "q4")
    manifest = json.loads(e.manifest_path.read_text())
    digest = manifest["meta"].pop(FAST_DIGEST)
    e.manifest_path.write_text(json.dumps(manifest))
    if damage:
        rot(e.path / FILE_NAME)
    else:
        forbid_gguf_reads()
    capsys.readouterr()
    assert torch.equal(logits(gguf_path, "q4"), first)
    assert ("rebuilding" in capsys.readouterr().err) == damage
    assert json.loads(e.manifest_path.read_text())["meta"][FAST_DIGEST] == digest


def test_bit_rot_in_a_cache_that_cant_be_written(gguf_path, cache, large_files, monkeypatch):
    """A damaged network that can't be deleted is not used: built from the
    GGUF, with a warning naming what to delete."""
    first = logits(gguf_path, "q4")
    rot(entry(gguf_path, "q4").path / FILE_NAME)
    monkeypatch.setattr(packed_cache, "remove_path", lambda p: None)
    with pytest.warns(UserWarning, match="packed-weight cache is not used.*damaged"):
        assert torch.equal(logits(gguf_path, "q4"), first)


def test_a_network_replaced_while_it_is_read_is_rebuilt(gguf_path, cache, monkeypatch, capsys):
    """The file hashed must be the file mapped: one whose inode, size or
    modification time changed between the two is not used."""
    first = logits(gguf_path, "q4")
    real = packed_cache._identity
    monkeypatch.setattr(packed_cache, "_identity", lambda path: (*real(path)[:3], -1))
    capsys.readouterr()
    assert torch.equal(logits(gguf_path, "q4"), first)
    assert f"{FILE_NAME} changed while it was read" in capsys.readouterr().err


def test_an_older_abis_entry_is_outdated_and_pruned(gguf_path, cache, capsys):
    """The native kernels' ABI is part of an entry's version: an entry an
    older build wrote (the same key, its version of then) is not whole, and
    a plain ``forerun cache prune`` deletes it; the current one stays."""
    from forerun.cli.main import main
    from forerun.kernels.binding import ABI_VERSION
    from forerun.loading.cache_entry import MANIFEST_NAME

    logits(gguf_path, "q8")
    current = entry(gguf_path, "q8")
    assert check(current) is None
    assert packed_cache.packed_version(ABI_VERSION - 1) != packed_cache.PACKED_VERSION
    logits(gguf_path, "q4")
    older = entry(gguf_path, "q4")
    manifest = older.path / MANIFEST_NAME
    data = json.loads(manifest.read_text())
    data["version"] = packed_cache.packed_version(ABI_VERSION - 1)
    manifest.write_text(json.dumps(data))
    assert "another version" in (check(older) or "")
    assert main(["cache", "prune"]) == 0
    assert not older.path.exists() and check(current) is None


@pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages here")
def test_a_cached_network_streams_from_huge_pages_but_its_embedding(gguf_path, cache,
                                                                    monkeypatch):
    """Loaded from the cache, every tensor but the embedding table is read
    into the huge-page mapping, not left a view of the file's; the logits
    are those of the network read as mapped, bit for bit."""
    read: list[list[tuple[int, int]]] = []
    real = huge_pages.read_ranges
    monkeypatch.setattr(huge_pages, "read_ranges",
                        lambda path, ranges: read.append(list(ranges)) or real(path, ranges))
    first = logits(gguf_path, "q4")         # built, stored, and read back into huge pages
    assert len(read) == 1
    assert torch.equal(logits(gguf_path, "q4"), first)
    ranges = read[1]
    assert ranges == read[0]
    folder = entry(gguf_path, "q4").path
    network, tensors = packed_cache._tensors(packed_cache._map(folder / FILE_NAME),
                                             folder / FILE_NAME)
    streamed = [name for name, t in tensors.items() if not name.startswith("embed.")]
    assert len(ranges) == len(streamed) and any(n.startswith("embed.") for n in tensors)
    monkeypatch.setenv("FORERUN_HUGE_PAGES", "0")
    assert torch.equal(logits(gguf_path, "q4"), first)
    assert len(read) == 3   # asked, and declined: the mapped network was used


def test_a_network_changed_while_its_huge_pages_are_read_is_rebuilt(gguf_path, cache,
                                                                    monkeypatch, capsys):
    """The bytes copied must come from the file hashed: a network whose
    modification time changes during the copy is rebuilt, not used."""
    first = logits(gguf_path, "q4")
    real = huge_pages.read_ranges

    def touching(path, ranges):
        os.utime(path, ns=(1, 1))
        return real(path, ranges)
    monkeypatch.setattr(huge_pages, "read_ranges", touching)
    monkeypatch.setattr(huge_pages, "available", lambda: True)
    capsys.readouterr()
    assert torch.equal(logits(gguf_path, "q4"), first)
    assert f"{FILE_NAME} changed while it was read" in capsys.readouterr().err
