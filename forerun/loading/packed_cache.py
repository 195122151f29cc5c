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
(forerun's layout of the file).  The entry is a
:class:`~forerun.loading.cache_entry.CacheEntry`: checked at load, rebuilt
when damaged, built under a lock and published atomically.  When the cache
can't be written the network is built from the GGUF, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import sys
import warnings
from pathlib import Path

import torch

from forerun.engines.transformer import Transformer
from forerun.errors import CacheError, ModelFormatError
from forerun.loading.cache_entry import CacheEntry, ensure, remove_path
from forerun.protocol.model_config import ModelConfig

PACKED_VERSION = "4"
FILE_NAME = "network.safetensors"


def packed_entry(digest: str, fmt: str, device: torch.device) -> CacheEntry:
    """The cache entry of the ``fmt`` network of the GGUF whose SHA-256 is
    ``digest``, built for ``device``."""
    from forerun.engines.kernel_choice import product_kernels
    from forerun.kernels.binding import ABI_VERSION
    from forerun.machine.paths import cache_dir

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
    from forerun.loading.content_key import file_digest
    from forerun.loading.gguf_quantized import GGUFQuantizedWeights

    built: list[Transformer] = []

    def build_network() -> Transformer:
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
        return {"source": str(gguf_path.resolve()), "name": f"{gguf_path.name} ({fmt})"}

    try:
        entry = packed_entry(digest or file_digest(gguf_path), fmt, device)
        folder = ensure(entry, build, progress=progress)
    except CacheError as exc:
        warnings.warn(f"forerun: the packed-weight cache is not used: {exc}", stacklevel=3)
        return built[0] if built else build_network()
    if built:
        return built[0]
    try:
        return _read(folder / FILE_NAME, config, device)
    except ModelFormatError as exc:
        # Whole on disk (the manifest's checksums hold) but not a network of
        # this model: written by a forerun that laid it out differently.
        warnings.warn(f"forerun: rebuilding {entry.what}: {exc}", stacklevel=3)
        remove_path(entry.path)
        folder = ensure(entry, build, progress=progress)
        return built[0] if built else _read(folder / FILE_NAME, config, device)


def _read(path: Path, config: ModelConfig, device: torch.device) -> Transformer:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = json.loads((f.metadata() or {}).get("forerun", "null"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, ValueError, OSError) as exc:
        raise ModelFormatError(f"{path} can't be read: {exc}") from exc
    if not isinstance(meta, dict):
        raise ModelFormatError(f"{path} does not describe a network")
    return Transformer.from_state(config, meta, tensors, device=device)
