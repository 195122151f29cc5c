"""Building forerun's native library: the C sources, the compiler flags of
the AVX2 build and of the CPU's vpdpbusd builds (:data:`DOT_BUILDS`), and
the build cache.

A library is built once per source, compiler and flags, into
``<cache>/kernels/``, as an entry of forerun's cache like any other
(:mod:`forerun.machine.cache_files`): a manifest beside it
(``<name>.so.manifest.json``) records its size and SHA-256, which are
checked at every load *before* it is opened, since a damaged library can't
be opened safely (a foreign one lacks the symbols, a truncated one dies of
SIGBUS, a flipped one of SIGSEGV).  One that opens but has no
``fr_abi_version``, or another version, is damaged too.  A damaged library
is rebuilt, with a notice on stderr; where the cache can't be written it is
refused with a :class:`~forerun.errors.CacheError` naming the file.

A build compiles into a temporary beside the library (swept when its process
is gone), is opened and checked there, and is renamed into place under a
file lock, so two processes building at once both end with the one whole
library.  A cache that can't be written builds into a temporary folder,
opens the library there and deletes the folder at once (the loaded library
stays mapped): nothing is left behind, on any path.  What can't be had
raises :class:`Unavailable`, saying why."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Set
from pathlib import Path

from forerun.errors import CacheError
from forerun.kernels.binding import ABI_VERSION
from forerun.machine.cache_files import (
    OWN_TEMPORARIES,
    file_manifest_path,
    new_manifest,
    notice_rebuild,
    read_manifest_file,
    sweep_temporaries,
    temporary_prefix,
    write_json_atomically,
)
from forerun.machine.file_digest import describe_file, sha256_of
from forerun.machine.paths import cache_dir


class Unavailable(Exception):
    """The native library can't be had here: the message says why (no C
    compiler, a failed build, a failed check, ...)."""


SOURCE = Path(__file__).with_name("avx2_int_products.c")
LAYER_OPS_SOURCE = Path(__file__).with_name("avx2_layer_ops.c")
# Compiled into every build, empty but in the AMX one (FR_AMX).
TILES_SOURCE = Path(__file__).with_name("amx_int_products.c")
# A decoder layer's operations chained in one call (over the two above).
DECODER_LAYER_SOURCE = Path(__file__).with_name("decoder_layer.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
# Builds whose products use vpdpbusd (see the C file's FR_DPBUSD), best
# first: a name, the /proc/cpuinfo flags the CPU needs, the extra compiler
# flags.  The layouts are made for 256-bit registers; the AVX512-VNNI build
# also runs 512-bit passes over them (the C file's WIDE).  The AMX build is
# the AVX512-VNNI build with tile products for many positions
# (amx_int_products.c), in the same layout and with the same results.
_AVX512_VNNI = ("-mavx512vnni", "-mavx512vl", "-mavx512bw", "-mprefer-vector-width=256",
                "-DFR_DPBUSD=512")
DOT_BUILDS = (
    ("amx-int8", ("amx_int8", "amx_tile", "avx512_vnni", "avx512vl", "avx512bw"),
     (*_AVX512_VNNI, "-mamx-tile", "-mamx-int8", "-DFR_AMX")),
    ("avx512-vnni", ("avx512_vnni", "avx512vl", "avx512bw"), _AVX512_VNNI),
    ("avx-vnni", ("avx_vnni",), ("-mavxvnni", "-DFR_DPBUSD=256")),
)
# The vpdpbusd code with an AVX2 stand-in for the instruction, in row groups
# of 4 as the AVX512-VNNI build runs them: how a CPU without VNNI tests that
# code (tests/native_kernels/test_native.py).
STAND_IN_FLAGS = ("-DFR_DPBUSD=0", "-DFR_ROWS=4")


def sources() -> tuple[Path, ...]:
    """The C files the library is built from."""
    return SOURCE, LAYER_OPS_SOURCE, TILES_SOURCE, DECODER_LAYER_SOURCE


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


#: The version of the kernel libraries' manifests (``forerun cache`` checks
#: a library against it).
LIBRARY_VERSION = "1"
#: What a library whose file is there but has no manifest is: not verifiable.
UNVERIFIED = "unverified (no valid manifest)"
_OTHER_VERSION = "written by another version"


def library_problem(path: Path) -> str | None:
    """What is wrong with the library file ``path`` against its manifest
    (missing, unverified, another size or SHA-256), or None when it is
    whole.  The whole file is hashed: it is small (under 1 MB)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    manifest = read_manifest_file(file_manifest_path(path))
    if manifest is None:
        return UNVERIFIED
    if manifest.get("version") != LIBRARY_VERSION:
        return f"{_OTHER_VERSION} ({manifest.get('version')!r}, now {LIBRARY_VERSION!r})"
    info = manifest["files"].get(path.name)
    if info is None:
        return f"its manifest does not record {path.name}"
    if st.st_size != info["size"]:
        return f"{path.name} has {st.st_size} bytes, expected {info['size']}"
    try:
        if sha256_of(path) != info["sha256"]:
            return f"{path.name} is damaged (its SHA-256 differs from the one recorded)"
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    return None


class _NotOurs(Exception):
    """A library file that opens but is not forerun's kernel library of this
    ABI (or does not open at all): the message says what it is."""


def _open(path: Path) -> ctypes.CDLL:
    """The library at ``path`` opened, with its ABI version checked; raises
    _NotOurs.  Only a file checked against its manifest, or just built, is
    opened: opening a damaged one can crash the process."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise _NotOurs(f"it does not load ({exc})") from exc
    try:
        version = lib.fr_abi_version()
    except AttributeError:
        raise _NotOurs("it has no fr_abi_version: not forerun's kernel library") from None
    if version != ABI_VERSION:
        raise _NotOurs(f"it is of ABI version {version}, not {ABI_VERSION}")
    return lib


def _library_name(compiler: str, flags: tuple[str, ...]) -> str:
    """The file name of the library built by ``compiler`` with ``flags``:
    keyed by the sources, the flags and the compiler's version."""
    source = b"".join(s.read_bytes() for s in sources())
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError) as exc:
        raise Unavailable(f"the C compiler {compiler} does not run ({exc})") from exc
    key = hashlib.sha256(b"|".join([source, " ".join(flags).encode(), compiler.encode(),
                                    "".join(version).encode()])).hexdigest()[:16]
    return f"{SOURCE.stem}-{key}.so"


def _compile(compiler: str, flags: tuple[str, ...], out: Path) -> None:
    """Build the library from :func:`sources` into ``out``; raises
    Unavailable where the compiler doesn't run or the build fails (the
    caller removes ``out``).  The compiler's own temporaries go to a folder
    of the build's, removed however the build ends (a compiler killed when
    the build is interrupted leaves its files behind)."""
    files = sources()
    try:
        with tempfile.TemporaryDirectory(prefix="forerun-cc-") as scratch:
            done = subprocess.run([compiler, *flags, *map(str, files), "-o", str(out)],
                                  capture_output=True, text=True, timeout=300,
                                  env={**os.environ, "TMPDIR": scratch})
    except (OSError, subprocess.SubprocessError) as exc:
        raise Unavailable(f"{compiler} failed to build the kernels ({exc})") from exc
    if done.returncode != 0:
        raise Unavailable(f"{compiler} failed to build "
                          f"{' and '.join(s.name for s in files)}: "
                          f"{done.stderr.strip()[-400:]}")


def _open_built(compiler: str, path: Path) -> ctypes.CDLL:
    """A library just built, opened; one that is not ours is a failed build."""
    try:
        return _open(path)
    except _NotOurs as exc:
        raise Unavailable(f"{compiler} built a library that is not usable: {exc}") from None


class _ReadOnly(Exception):
    """The cache's kernels folder can't be written (the OSError is the cause)."""


def load_library(compiler: str, extra_flags: tuple[str, ...] = ()) -> tuple[ctypes.CDLL, Path]:
    """The library built from :func:`sources` by ``compiler`` with
    :data:`FLAGS` and ``extra_flags``, opened, and where it lives (or lived:
    a library built into a temporary folder has been deleted since).  The
    cached file where it is whole (checked against its manifest before it
    is opened); else built now, into the cache where it can be written (a
    damaged one is rebuilt, with a notice), else into a temporary folder.
    Raises Unavailable where the compiler doesn't run or the build fails,
    and CacheError where the cached file is damaged and the cache can't be
    written to rebuild it."""
    lib, path = _library(compiler, (*FLAGS, *extra_flags), load=True)
    assert lib is not None
    return lib, path


def compile_library(compiler: str, extra_flags: tuple[str, ...] = ()) -> Path:
    """The library as :func:`load_library` has it, not opened: the checked
    file in the cache.  Raises Unavailable where the cache can't be written
    (the library would have nowhere to stay)."""
    return _library(compiler, (*FLAGS, *extra_flags), load=False)[1]


def _library(compiler: str, flags: tuple[str, ...],
             load: bool) -> tuple[ctypes.CDLL | None, Path]:
    name = _library_name(compiler, flags)
    try:
        path = cache_dir() / "kernels" / name
    except CacheError as exc:                       # a cache path that is a file
        return _build_in_temporary_folder(compiler, flags, name, load, exc)
    problem, recheck = library_problem(path), True
    if problem is None:
        try:
            lib = _open(path) if load else None
        except _NotOurs as exc:
            problem, recheck = str(exc), False
        else:
            _touch(path)
            return lib, path
    try:
        return _build_in_cache(compiler, flags, path, problem, load, recheck)
    except _ReadOnly as exc:
        cause = exc.__cause__
        if _is_damage(problem):
            manifest = file_manifest_path(path)
            why = (cause.strerror or cause) if isinstance(cause, OSError) else cause
            raise CacheError(
                f"forerun's native kernel library {path} is damaged ({problem}) and can't be "
                f"rebuilt, as {path.parent} can't be written ({why}); delete {path} and "
                f"{manifest.name}, make {path.parent} writable or set FORERUN_CACHE to a "
                f"writable directory (FORERUN_NATIVE_KERNELS=0 runs without these "
                f"kernels)") from None
        return _build_in_temporary_folder(compiler, flags, name, load, cause)


def _is_damage(problem: str) -> bool:
    """Whether ``problem`` is damage to the cached file (not its absence, a
    missing manifest or another version's, which a read-only cache works
    around by building in a temporary folder, as before)."""
    return not (problem in ("missing", UNVERIFIED) or problem.startswith(_OTHER_VERSION))


def _build_in_cache(compiler: str, flags: tuple[str, ...], path: Path, problem: str,
                    load: bool, recheck: bool) -> tuple[ctypes.CDLL | None, Path]:
    """Build the library into a temporary beside ``path``, open it there
    (``load``), and publish it with its manifest under the library's file
    lock; raises _ReadOnly where the folder can't be written.  ``recheck``:
    look again under the lock, since another process may have built it."""
    from filelock import FileLock

    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=folder, prefix=temporary_prefix(path))
    except OSError as exc:
        raise _ReadOnly() from exc
    os.close(fd)
    tmp = Path(name)
    OWN_TEMPORARIES.add(str(tmp))
    try:
        sweep_temporaries(folder)                  # what killed builds left
        with FileLock(str(folder / f".{path.name}.lock")):
            if recheck and library_problem(path) is None:
                try:
                    lib = _open(path) if load else None
                except _NotOurs as exc:
                    problem = str(exc)
                else:
                    return lib, path
            if problem != "missing":
                notice_rebuild("forerun's native kernel library", path, problem)
            _compile(compiler, flags, tmp)
            lib = _open_built(compiler, tmp) if load else None
            record = describe_file(tmp)
            os.replace(tmp, path)                  # keeps the stamp the record holds
            write_json_atomically(file_manifest_path(path), new_manifest(
                LIBRARY_VERSION, f"the native kernel library {path.name}", {path.name: record},
                {"compiler": compiler, "flags": " ".join(flags)}))
    except OSError as exc:
        raise Unavailable(f"the kernels could not be written to {folder} ({exc})") from exc
    finally:
        tmp.unlink(missing_ok=True)
        OWN_TEMPORARIES.discard(str(tmp))
    return lib, path


def _build_in_temporary_folder(compiler: str, flags: tuple[str, ...], name: str, load: bool,
                               why: object) -> tuple[ctypes.CDLL | None, Path]:
    """The library built into a temporary folder, opened, and the folder
    deleted (the library stays loaded); for a cache that can't be written."""
    if not load:
        raise Unavailable(f"the kernels can't be kept in forerun's cache ({why})")
    try:
        with tempfile.TemporaryDirectory(prefix="forerun-kernels-") as folder:
            path = Path(folder) / name
            _compile(compiler, flags, path)
            return _open_built(compiler, path), path
    except OSError as exc:
        raise Unavailable(f"the kernels could not be built in a temporary folder "
                          f"({exc})") from exc


def _touch(path: Path) -> None:
    """Record the library's last use (its manifest's modification time), for
    ``forerun cache prune --unused-days``."""
    try:
        os.utime(file_manifest_path(path))
    except OSError:
        pass


def dot_builds(cpu_flags: Set[str]) -> list[tuple[str, tuple[str, ...]]]:
    """The :data:`DOT_BUILDS` whose CPU flags are all in ``cpu_flags``, best
    first, as (name, extra compiler flags)."""
    return [(name, extra) for name, needs, extra in DOT_BUILDS
            if all(f in cpu_flags for f in needs)]
