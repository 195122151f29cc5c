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
flag builds again."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from forerun.machine.output_files import written_whole


def key(real: str, args: list[str], out_at: int) -> str:
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


def main(args: list[str]) -> int:
    real = os.environ["FORERUN_TESTS_REAL_CC"]
    if "-o" not in args or args.index("-o") + 1 >= len(args):
        return subprocess.run([real, *args]).returncode
    out_at = args.index("-o") + 1
    out = Path(args[out_at])
    kept = Path(os.environ["FORERUN_TESTS_COMPILED"]) / f"{key(real, args, out_at)}.so"
    if kept.is_file():
        shutil.copyfile(kept, out)       # a copy: a test may damage what it gets
        return 0
    done = subprocess.run([real, *args])
    if done.returncode == 0 and out.is_file():
        kept.parent.mkdir(parents=True, exist_ok=True)
        with written_whole(kept) as tmp:   # whole or not at all, beside another worker
            shutil.copyfile(out, tmp)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
