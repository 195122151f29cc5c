"""Building forerun's native library: the C sources, the compiler flags of
the AVX2 build and of the CPU's vpdpbusd builds (:data:`DOT_BUILDS`), and
the build cache.  A library is built once per source, compiler and flags,
into ``<cache>/kernels/`` (written to a temporary name and renamed, so two
processes building at once both end with a whole file; a cache that can't
be written builds into a temporary folder).  What can't be had raises
:class:`Unavailable`, saying why."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Set
from pathlib import Path

from forerun.machine.paths import cache_dir


class Unavailable(Exception):
    """The native library can't be had here: the message says why (no C
    compiler, a failed build, a failed check, ...)."""


SOURCE = Path(__file__).with_name("avx2_int_products.c")
LAYER_OPS_SOURCE = Path(__file__).with_name("avx2_layer_ops.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
# Builds whose products use vpdpbusd (see the C file's FR_DPBUSD), best
# first: a name, the /proc/cpuinfo flags the CPU needs, the extra compiler
# flags.  256-bit registers either way: the layouts are made for them.
DOT_BUILDS = (
    ("avx512-vnni", ("avx512_vnni", "avx512vl"),
     ("-mavx512vnni", "-mavx512vl", "-mprefer-vector-width=256", "-DFR_DPBUSD=512")),
    ("avx-vnni", ("avx_vnni",), ("-mavxvnni", "-DFR_DPBUSD=256")),
)
# The vpdpbusd code with an AVX2 stand-in for the instruction, in row groups
# of 4 as the AVX512-VNNI build runs them: how a CPU without VNNI tests that
# code (tests/kernels/test_native.py).
STAND_IN_FLAGS = ("-DFR_DPBUSD=0", "-DFR_ROWS=4")


def sources() -> tuple[Path, Path]:
    """The C files the library is built from."""
    return SOURCE, LAYER_OPS_SOURCE


@functools.cache
def source_digest(*files: Path) -> str:
    """The digest of the C sources ``files`` (read once: every calibration
    record's key asks for it)."""
    return hashlib.sha256(b"".join(s.read_bytes() for s in files)).hexdigest()[:12]


def find_compiler() -> str:
    """The C compiler: ``$CC``, else ``cc`` or ``gcc`` on the path; raises
    Unavailable where there is none."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise Unavailable("no C compiler was found (install gcc, or set CC)")
    return compiler


def compile_library(compiler: str, extra_flags: tuple[str, ...] = ()) -> Path:
    """The shared library built from :func:`sources` by ``compiler`` with
    :data:`FLAGS` and ``extra_flags``: the cached file where there is one,
    else built now; raises Unavailable where the compiler doesn't run or the
    build fails."""
    files = sources()
    source = b"".join(s.read_bytes() for s in files)
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError) as exc:
        raise Unavailable(f"the C compiler {compiler} does not run ({exc})") from exc
    flags = (*FLAGS, *extra_flags)
    key = hashlib.sha256(b"|".join([source, " ".join(flags).encode(), compiler.encode(),
                                    "".join(version).encode()])).hexdigest()[:16]
    name = f"{SOURCE.stem}-{key}.so"
    try:
        folder = cache_dir() / "kernels"
        if (folder / name).is_file():
            return folder / name
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so.tmp")
    except Exception:                        # a cache that can't be written: a temporary one
        folder = Path(tempfile.mkdtemp(prefix="forerun-kernels-"))
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so.tmp")
    os.close(fd)
    path = folder / name
    try:
        done = subprocess.run([compiler, *flags, *map(str, files), "-o", tmp],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise Unavailable(f"{compiler} failed to build "
                              f"{' and '.join(s.name for s in files)}: "
                              f"{done.stderr.strip()[-400:]}")
        os.replace(tmp, path)
    except (OSError, subprocess.SubprocessError) as exc:
        raise Unavailable(f"{compiler} failed to build the kernels ({exc})") from exc
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


def dot_build(cpu_flags: Set[str]) -> tuple[str, tuple[str, ...]] | None:
    """The first of :data:`DOT_BUILDS` whose CPU flags are all in
    ``cpu_flags``, as (name, extra compiler flags); None if none is."""
    for name, needs, extra in DOT_BUILDS:
        if all(f in cpu_flags for f in needs):
            return name, extra
    return None
