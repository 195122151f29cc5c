"""The C compiler the suite gives forerun (``CC``, set by tests/conftest.py):
the real one, with what it built kept in the tests' cache and given again
for the same command and inputs.

Many kernel tests build the library again in an empty forerun cache, to
test what forerun does around a build (a damaged or foreign file rebuilt,
a read-only cache, a build whose results differ refused).  Each build took
6 to 15 s and more on slow hosts; the compiler's output for the same
sources and flags is the same every time, so it is compiled once.  What
forerun does is unchanged: it still runs ``$CC``, reads its status and
output, and checks, publishes and loads the file it wrote.

    caching_compiler.py ARGS...

``FORERUN_TESTS_REAL_CC`` names the real compiler and
``FORERUN_TESTS_COMPILED`` the folder of kept outputs.  A command without
``-o`` runs the real compiler as it is (the launcher conftest.py writes
hands ``--version``, which forerun asks at every load, to the real compiler
without starting Python); a failed build is never kept.  The key is the
real compiler's path and version, the arguments but the output's path, each
source (an argument that is a file) by its bytes, so a changed source or
flag builds again.

A command that builds from C sources (forerun's: ``cc FLAGS a.c b.c ... -o
lib.so``) is run as its parts: each source compiled alone (``-c``) into an
object kept under its own key (the flags and that source's bytes), then the
objects linked by the same command.  So a test that alters one source (a
wrong product, a wrong fused layer) compiles that file alone and takes the
others' objects as they are: the attention's file alone takes 9 s to
compile on a Xeon, the others together 3.  gcc compiles each source of
such a command on its own and links the objects the same way, so the
library does the same."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from forerun.machine.output_files import written_whole


def key(real: str, args: list[str], out_at: int | None) -> str:
    version = subprocess.run([real, "--version"], capture_output=True,
                             text=True).stdout.splitlines()[:1]
    digest = hashlib.sha256("\0".join([real, *version]).encode())
    for i, arg in enumerate(args):
        if i == out_at:
            continue
        # A source by its bytes, not its path: a test's altered copy lives
        # in a new temporary folder every run.
        digest.update(b"\0" + (Path(arg).read_bytes() if os.path.isfile(arg) else arg.encode()))
    return digest.hexdigest()[:32]


def keep(out: Path, kept: Path) -> None:
    """A copy of ``out`` at ``kept``, whole or not at all (beside another
    worker writing the same)."""
    kept.parent.mkdir(parents=True, exist_ok=True)
    with written_whole(kept) as tmp:
        shutil.copyfile(out, tmp)


def compiled(real: str, flags: list[str], source: str, folder: Path) -> Path | None:
    """``source`` compiled alone with ``flags`` into an object: the kept one
    for the same compiler, flags and bytes, else compiled now and kept;
    None where it does not compile (the compiler's messages went to stderr)."""
    command = [*flags, "-c", source]
    kept = folder / "objects" / f"{key(real, command, None)}.o"
    if kept.is_file():
        return kept
    scratch = folder / "objects" / f".{os.getpid()}.o"
    scratch.parent.mkdir(parents=True, exist_ok=True)
    try:
        if subprocess.run([real, *command, "-o", str(scratch)]).returncode != 0:
            return None
        keep(scratch, kept)
    finally:
        scratch.unlink(missing_ok=True)
    return kept


def built(real: str, args: list[str], out_at: int, folder: Path) -> int:
    """The command ``args`` (output at ``args[out_at]``) as its parts: each C
    source compiled alone (kept per source), then the objects linked by the
    same command.  The real compiler's status; a command with no C source
    runs whole."""
    sources = [i for i, arg in enumerate(args)
               if i != out_at and arg.endswith(".c") and os.path.isfile(arg)]
    if not sources:
        return subprocess.run([real, *args]).returncode
    # The compiler's flags: everything but the sources, the output and what
    # only a link reads (libraries).
    flags = [arg for i, arg in enumerate(args)
             if i not in sources and i not in (out_at - 1, out_at) and not arg.startswith("-l")]
    link = list(args)
    for i in sources:
        obj = compiled(real, flags, args[i], folder)
        if obj is None:
            return 1
        link[i] = str(obj)
    return subprocess.run([real, *link]).returncode


def main(args: list[str]) -> int:
    real = os.environ["FORERUN_TESTS_REAL_CC"]
    if "-o" not in args or args.index("-o") + 1 >= len(args) or "-c" in args:
        return subprocess.run([real, *args]).returncode
    out_at = args.index("-o") + 1
    out = Path(args[out_at])
    folder = Path(os.environ["FORERUN_TESTS_COMPILED"])
    kept = folder / f"{key(real, args, out_at)}.so"
    if kept.is_file():
        shutil.copyfile(kept, out)       # a copy: a test may damage what it gets
        return 0
    status = built(real, args, out_at, folder)
    if status == 0 and out.is_file():
        keep(out, kept)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
