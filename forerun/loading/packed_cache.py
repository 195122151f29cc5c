"""A GGUF model's network as the PyTorch engine builds it in a quantized
weight format, kept in forerun's cache.

Building the ``q4`` or ``q8`` network of a GGUF reads every tensor, turns
its blocks into int4 groups or int8 rows and packs them for the kernels:
tens of seconds for a 1.5B model.  What comes out (packed int4 matrices,
int8 rows, bfloat16 scales, float norms) is saved once, by
:meth:`~forerun.engines.transformer.Transformer.state`, to
``<cache>/packed/<key>/network.safetensors``, and later loads read it back
as is.  The key holds the GGUF's SHA-256, the format, the device type, the
torch version (the packed layout is torch's), whether forerun's native
kernels run and in which row groups (their layout is forerun's) and
:data:`PACKED_VERSION`
(forerun's layout of the file and the kernels' ABI).  The entry is a
:class:`~forerun.loading.cache_entry.CacheEntry`: checked at load, rebuilt
when damaged, built under a lock and published atomically.  When the cache
can't be written the network is built from the GGUF, with a warning.

The entry's own check re-reads a large file only when its modification time
or inode changed, so bit rot (bytes flipped in place, size and time kept)
would pass it.  Every load therefore verifies the whole network: the file
is read through once and hashed with xxh3_128 (recorded in the manifest's
metadata at build; several GB/s, against SHA-256's 1.4 on an EPYC with SHA
extensions), then mapped (copy-on-write), the tensors views of the mapping;
the file must be the same one (inode, size, modification time) before the
read and after the mapping.  Read, not hashed through the mapping, so that
only the pages the model touches count in its memory: an embedding table is
read a few rows a token (the 1.5B's int8 table is 223 MB, the 0.5B's 130
MB), and hashed through the mapping all of it stayed resident.  A network
whose digest differs is rebuilt from the GGUF with a notice, never used.  An
entry built before the digest was recorded is checked against its
manifest's SHA-256 once, then gets it.

On the CPU every tensor but the embedding table is then read again, from the
page cache, into memory in transparent huge pages where the system has them
(:mod:`forerun.machine.huge_pages`: each decoding step streams them, and in
2 MiB pages the 1.5B decoded 1.05 to 1.10 times as fast on a Zen 4), and
the file must still be the one hashed after that read.  A first load reads
back the network it has just stored, to have them too.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sys
import warnings
from pathlib import Path
from typing import Any, cast

import torch

from forerun.engines.kernel_choice import product_kernels
from forerun.engines.transformer import Transformer
from forerun.errors import CacheError, ModelFormatError
from forerun.kernels.binding import ABI_VERSION
from forerun.loading.cache_entry import (
    CacheEntry,
    ensure,
    read_manifest,
    remove_path,
    write_json_atomically,
)
from forerun.loading.content_key import file_digest
from forerun.loading.gguf_quantized import GGUFQuantizedWeights
from forerun.machine import huge_pages
from forerun.machine.cache_files import notice_rebuild
from forerun.machine.paths import cache_dir
from forerun.protocol.model_config import ModelConfig


def packed_version(abi: int) -> str:
    """An entry's version: forerun's layout of the file, and the ABI of the
    native kernels whose packed layout it holds.  The ABI is also in the
    entry's key, so a new ABI builds a new entry; with it in the version
    too, the entries of an older ABI are outdated, and ``forerun cache
    prune`` deletes them (a torch-layout entry, which no ABI touches, is
    rebuilt once after a bump: off the CPU only)."""
    return f"4-abi{abi}"


PACKED_VERSION = packed_version(ABI_VERSION)
FILE_NAME = "network.safetensors"
#: The digest of the network checked at every load, kept in the manifest's metadata.
FAST_DIGEST = "xxh3_128"
#: The names of the embedding table's tensors in the file (it stays mapped).
EMBEDDING_PREFIX = "embed."
_CHUNK = 16 << 20
# safetensors' dtype names.
_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
           "U16": torch.uint16, "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64,
           "U64": torch.uint64, "F16": torch.float16, "BF16": torch.bfloat16,
           "F32": torch.float32, "F64": torch.float64}


class DamagedNetwork(ModelFormatError):
    """The stored network's bytes are not those recorded when it was built."""


def packed_entry(digest: str, fmt: str, device: torch.device) -> CacheEntry:
    """The cache entry of the ``fmt`` network of the GGUF whose SHA-256 is
    ``digest``, built for ``device``."""
    # The layers' layout depends on whether forerun's native kernels run
    # here, and on the row groups of the build that does.
    native = product_kernels() if device.type == "cpu" else None
    kernels = f"native{ABI_VERSION}-rows{native.row_group}" if native is not None else "torch"
    key = hashlib.sha256(f"{digest}|{fmt}|{device.type}|{torch.__version__}|{kernels}"
                         .encode()).hexdigest()[:32]
    return CacheEntry(cache_dir() / "packed" / key,
                      f"the {fmt} weights of the model {digest[:12]}", version=PACKED_VERSION)


def packed_network(gguf_path: Path, config: ModelConfig, fmt: str, device: torch.device, *,
                   digest: str | None = None, progress: bool = True) -> Transformer:
    """The ``fmt`` (``"q4"``, ``"q8"`` or ``"q4-all"``) network of
    ``gguf_path`` on ``device``: read from the cache, or built from the GGUF and stored."""
    built: list[Transformer] = []

    def build_network() -> Transformer:
        # (the gguf package, and the yaml it imports, only where the GGUF is read)

        if progress:
            print(f"forerun: packing {gguf_path.name} into {fmt} weights (first load only)",
                  file=sys.stderr, flush=True)
        return Transformer(config, GGUFQuantizedWeights(gguf_path, config),
                           weights_format=fmt, device=device)

    def build(tmp: Path) -> dict:
        from safetensors.torch import save_file

        network = build_network()
        built.append(network)
        meta, tensors = network.state()
        save_file({k: t.cpu() for k, t in tensors.items()}, str(tmp / FILE_NAME),
                  metadata={"forerun": json.dumps(meta)})
        digests, _ = _file_digests(tmp / FILE_NAME, _hashers(sha256=False))
        return {"source": str(gguf_path.resolve()), "name": f"{gguf_path.name} ({fmt})",
                **{k: v for k, v in digests.items() if k == FAST_DIGEST}}

    def ensured():
        """The network ``build`` made (or one built in memory where the cache
        can't be used); None when the entry was already whole, to be read.
        Where the weights go into huge pages, the network just stored is
        read back as a later load reads it (its memory in huge pages)."""
        try:
            ensure(entry, build, progress=progress)
        except CacheError as exc:
            warnings.warn(f"forerun: the packed-weight cache is not used: {exc}", stacklevel=4)
            return built[0] if built else build_network()
        if not built:
            return None
        if device.type == "cpu" and huge_pages.available():
            try:
                return _read(entry, config, device)
            except ModelFormatError:
                pass    # (the built network is as good, in pages of 4 KiB)
        return built[0]

    try:
        entry = packed_entry(digest or file_digest(gguf_path), fmt, device)
    except CacheError as exc:
        warnings.warn(f"forerun: the packed-weight cache is not used: {exc}", stacklevel=3)
        return build_network()
    network = ensured()
    if network is not None:
        return network
    try:
        return _read(entry, config, device)
    except ModelFormatError as exc:
        if isinstance(exc, DamagedNetwork):
            # Bit rot that kept the file's size and modification time: the
            # entry's check let it through, the digest of every load did not.
            notice_rebuild(entry.what, entry.path, str(exc))
        else:
            # Whole on disk but not a network of this model: written by a
            # forerun that laid it out differently.
            warnings.warn(f"forerun: rebuilding {entry.what}: {exc}", stacklevel=3)
        remove_path(entry.path)
    network = ensured()
    if network is not None:
        return network
    try:
        return _read(entry, config, device)
    except ModelFormatError as exc:   # still there: a cache that can't be written
        warnings.warn(f"forerun: the packed-weight cache is not used: {exc}; delete "
                      f"{entry.path}", stacklevel=3)
        return build_network()


def _hashers(*, sha256: bool) -> dict[str, Any]:
    """Fresh hashers: xxh3_128, and SHA-256 when ``sha256`` is set or the
    xxhash package is missing (then the manifest's SHA-256 is checked)."""
    hashers: dict[str, Any] = {}
    try:
        import xxhash
    except ImportError:
        sha256 = True
    else:
        hashers[FAST_DIGEST] = xxhash.xxh3_128()
    if sha256:
        hashers["sha256"] = hashlib.sha256()
    return hashers


def _map(path: Path) -> torch.Tensor:
    """The bytes of ``path`` as a uint8 tensor over a copy-on-write mapping
    of the file (writing to it never reaches the file)."""
    size = path.stat().st_size
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
    return torch.empty(0, dtype=torch.uint8).set_(cast(torch.UntypedStorage, storage))


def _file_digests(path: Path, hashers: dict[str, Any]) -> tuple[dict[str, str], tuple]:
    """Hash the file at ``path`` by reading it (the page cache, not this
    process's memory), and return the digests and the file's identity
    (device, inode, size, modification time) as it was opened."""
    with open(path, "rb", buffering=0) as f:
        st = os.fstat(f.fileno())
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while n := f.readinto(buffer):
            for h in hashers.values():
                h.update(view[:n])
    return ({name: h.hexdigest() for name, h in hashers.items()},
            (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))


def _identity(path: Path) -> tuple:
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _read(entry: CacheEntry, config: ModelConfig, device: torch.device) -> Transformer:
    """The network stored in ``entry``, its every byte checked against the
    digest its manifest records.  Raises DamagedNetwork when they differ,
    ModelFormatError when the file can't be read or isn't a network."""
    path = entry.path / FILE_NAME
    manifest = read_manifest(entry) or {}
    meta: dict = manifest["meta"] if isinstance(manifest.get("meta"), dict) else {}
    fast = meta.get(FAST_DIGEST)
    try:
        digests, read = _file_digests(path, _hashers(sha256=not isinstance(fast, str)))
        data = _map(path)
        mapped = _identity(path)
    except (OSError, RuntimeError) as exc:
        raise ModelFormatError(f"{path} can't be read: {exc}") from exc
    if mapped != read:
        raise DamagedNetwork(f"{FILE_NAME} changed while it was read")
    name = FAST_DIGEST if isinstance(fast, str) and FAST_DIGEST in digests else "sha256"
    want = fast if name == FAST_DIGEST else manifest.get("files", {}).get(FILE_NAME, {}).get(name)
    if digests[name] != want:
        raise DamagedNetwork(f"{FILE_NAME} is damaged (its {name} differs from the one "
                             f"recorded)")
    if name == "sha256" and FAST_DIGEST in digests:
        # Built before the digest was recorded: whole by its SHA-256, so record it.
        manifest["meta"] = {**meta, FAST_DIGEST: digests[FAST_DIGEST]}
        try:
            write_json_atomically(entry.manifest_path, manifest)
        except OSError:
            pass   # a read-only cache checks the SHA-256 again next time
    network, tensors = _tensors(data, path)
    if device.type == "cpu":
        try:
            tensors = _in_huge_pages(tensors, data, path)
        except OSError as exc:
            raise ModelFormatError(f"{path} can't be read: {exc}") from exc
        if _identity(path) != read:
            raise DamagedNetwork(f"{FILE_NAME} changed while it was read")
    return Transformer.from_state(config, network, tensors, device=device)


def _in_huge_pages(tensors: dict[str, torch.Tensor], data: torch.Tensor, path: Path
                   ) -> dict[str, torch.Tensor]:
    """``tensors`` (views of ``data``, the mapping of ``path``) with all but
    the embedding table read into memory in huge pages, where the system
    has them (:mod:`forerun.machine.huge_pages`: every decoding step streams
    them).  The embedding table, read a few rows a token, stays mapped, so
    that only the rows read count in the process's memory."""
    names = [name for name, t in tensors.items()
             if not name.startswith(EMBEDDING_PREFIX) and t.nbytes]
    base = data.data_ptr()
    copies = huge_pages.read_ranges(
        path, [(tensors[n].data_ptr() - base, tensors[n].nbytes) for n in names])
    if copies is None:
        return tensors
    return {**tensors, **{n: c.view(tensors[n].dtype).reshape(tensors[n].shape)
                          for n, c in zip(names, copies)}}


def _tensors(data: torch.Tensor, path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The forerun metadata and the tensors of the safetensors file whose
    bytes are ``data``; the tensors are views of ``data``, not copies."""
    try:
        (length,) = struct.unpack("<Q", data[:8].numpy().tobytes())
        base = 8 + length
        if base > len(data):
            raise ValueError("its header runs past its end")
        header = json.loads(data[8:base].numpy().tobytes())
        meta = json.loads((header.pop("__metadata__", None) or {}).get("forerun", "null"))
        tensors = {}
        for name, info in header.items():
            dtype = _DTYPES[info["dtype"]]
            shape = [int(n) for n in info["shape"]]
            start, end = (base + int(n) for n in info["data_offsets"])
            if not (base <= start <= end <= len(data)
                    and end - start == math.prod(shape) * dtype.itemsize):
                raise ValueError(f"the tensor {name} lies outside the file or has a wrong size")
            raw = data[start:end]
            if start % dtype.itemsize:       # (safetensors aligns them: never seen)
                raw = raw.clone()
            tensors[name] = raw.view(dtype).reshape(shape)
    except (ValueError, KeyError, TypeError, AttributeError, struct.error) as exc:
        raise ModelFormatError(f"{path} can't be read: {exc}") from exc
    if not isinstance(meta, dict):
        raise ModelFormatError(f"{path} does not describe a network")
    return meta, tensors
