"""forerun's native matrix products against the same kernels at another git
revision, side by side in one process, on the matrices of a whole decoding
step of Qwen2.5-1.5B (28 layers of q/k/v, o, gate/up and down, half the down
projections in 6 bits as Q4_K_M stores them, and the 6-bit LM head), with
distinct weights per matrix so that they stream from memory as a real step's
do.

    python benchmarks/products_ab.py --against HEAD~1 [--positions 1,2,3,4,5,6]
        [--rounds 6] [--build avx2|dot|amx|amx-both] [--cflags -DFR_TILE=6]

It builds ``forerun/kernels/avx2_int_products.c`` as it was at
``--against`` and as it is in this tree (with the flags forerun builds it
with; ``--build dot`` adds this CPU's vpdpbusd flags to both), fills the
matrices with random bytes (the layouts differ between revisions, the
amount of work does not), and times one pass over all of them per number of
positions, alternating the two builds pass by pass so that a drift of the
machine touches both alike.  It prints the mean of the rounds after the
first, in ms, and each build's cost of T positions over one.  ``--build
amx`` times this tree's AMX tiles against the AVX512-VNNI passes at
``--against``; ``--build amx-both`` builds both with the tiles (and
``forerun/kernels/amx_int_products.c`` as it was at ``--against`` and as it
is here), so a change to the tiles is timed against the tiles before it.

Run it on an idle machine (nothing else running): every figure is a time.
"""

from __future__ import annotations

import ctypes
import tempfile
from pathlib import Path

import torch
from harness import (
    ROOT,
    build_library,
    interleaved,
    machine_line,
    parser,
    positions_list,
    source_at,
    timed,
)

from forerun.kernels.build import DOT_BUILDS, TILES_SOURCE, dot_builds
from forerun.kernels.layouts import padded_rows
from forerun.machine.cpu import cpu_flags

SOURCE = "forerun/kernels/avx2_int_products.c"
# (out, in, 6-bit) of one layer's matrices, then the LM head.
LAYER = ((2048, 1536, False), (1536, 1536, False), (17920, 1536, False))
HEAD = (151936, 1536, True)


def build(source: bytes, folder: Path, name: str, extra: tuple[str, ...],
          tiles: Path = TILES_SOURCE) -> ctypes.CDLL:
    lib = build_library(source, folder, name, extra, (tiles,) if "-DFR_AMX" in extra else ())
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.fr_q4_linear.argtypes = [p, i, i, i, p, p, p, i, p, i]
    lib.fr_q6_linear.argtypes = [p, i, i, i, p, p, p, p, i, p, i]
    return lib


def matrices(layers: int) -> list[tuple]:
    """Random bytes for each matrix of a step: (N, K, six, arrays)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [m for n in range(layers) for m in (*LAYER, (1536, 8960, n % 2 == 1))] + [HEAD]
    out = []
    for n, k, six in shapes:
        rows = padded_rows(n, 4)          # room for either build's row groups

        def b(width, dtype=torch.uint8, rows=rows):
            return torch.randint(0, 256, (rows, width), dtype=torch.uint8,
                                 generator=gen).view(dtype)
        if six:
            arrays = (b(k // 2), b(k // 4), b(k // 16, torch.int8),
                      torch.rand(rows, k // 256, generator=gen) * 1e-3)
        else:
            arrays = (b(k // 2), (torch.rand(rows, k // 32, generator=gen) * 1e-2).half(),
                      (torch.rand(rows, k // 32, generator=gen) * -1e-2).half())
        out.append((n, k, six, arrays))
    return out


def one_pass(lib: ctypes.CDLL, mats: list[tuple], x: torch.Tensor, y: torch.Tensor,
             t: int) -> float:
    threads = torch.get_num_threads()

    def products() -> None:
        for n, k, six, a in mats:
            if six:
                lib.fr_q6_linear(x.data_ptr(), t, k, k, a[0].data_ptr(), a[1].data_ptr(),
                                 a[2].data_ptr(), a[3].data_ptr(), n, y.data_ptr(), threads)
            else:
                lib.fr_q4_linear(x.data_ptr(), t, k, k, a[0].data_ptr(), a[1].data_ptr(),
                                 a[2].data_ptr(), n, y.data_ptr(), threads)
    return timed(products)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--against", required=True, help="a git revision, e.g. HEAD~1")
    p.add_argument("--positions", default="1,2,3,4,5,6")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--build", choices=("avx2", "dot", "amx", "amx-both"), default="avx2",
                   help="avx2: forerun's AVX2 build; dot: this CPU's best vpdpbusd build; "
                        "amx: AVX512-VNNI at --against, AMX tiles in this tree; amx-both: "
                        "AMX tiles in both")
    p.add_argument("--tile-rows", type=int, default=0,
                   help="--build amx: the positions from which this tree's tiles run; "
                        "amx-both: both builds' (0: the build's own)")
    p.add_argument("--cflags", default="",
                   help="extra compiler flags for this tree's build only, e.g. -DFR_TILE=6")
    args = p.parse_args()
    if args.rounds < 2:
        p.error("--rounds must be at least 2 (the first warms up)")
    extra: tuple[str, ...] = ()
    ours: tuple[str, ...] = ()
    builds_here = dict(dot_builds(cpu_flags()))
    if args.build == "dot":
        if not builds_here:
            raise SystemExit("this CPU has no vpdpbusd build")
        extra = next(iter(builds_here.values()))
    elif args.build in ("amx", "amx-both"):
        if "amx-int8" not in builds_here:
            raise SystemExit("this CPU has no AMX tiles (amx_int8, amx_tile)")
        extra = dict((n, e) for n, _, e in DOT_BUILDS)["avx512-vnni"]
        ours = tuple(f for f in builds_here["amx-int8"] if f not in extra)
        if args.build == "amx-both":
            extra, ours = builds_here["amx-int8"], ()
    theirs = source_at(args.against, SOURCE)
    counts = positions_list(args.positions)
    mats = matrices(args.layers)
    x = torch.randn(max(counts), 8960)
    y = torch.empty(max(counts), HEAD[0])
    with tempfile.TemporaryDirectory() as tmp:
        their_tiles = Path(tmp) / "their_tiles.c"
        their_tiles.write_bytes(source_at(args.against, str(TILES_SOURCE.relative_to(ROOT)))
                                if args.build == "amx-both" else TILES_SOURCE.read_bytes())
        builds = {f"at {args.against}": build(theirs, Path(tmp), "theirs", extra, their_tiles),
                  "this tree": build((ROOT / SOURCE).read_bytes(), Path(tmp), "ours",
                                     (*extra, *ours, *args.cflags.split()))}
        if args.tile_rows:
            for name, lib in builds.items():
                if args.build == "amx-both" or name == "this tree":
                    lib.fr_set_amx_rows(args.tile_rows)
        passes = interleaved({(name, t): (lambda lib=lib, t=t: one_pass(lib, mats, x, y, t))
                              for t in counts for name, lib in builds.items()}, args.rounds)
        # The first round warms up.
        spent = {key: sum(times[1:]) / (args.rounds - 1) for key, times in passes.items()}
    print(machine_line(f"{args.build} build; {args.layers} layers and the LM head; mean of "
                       f"{args.rounds - 1} rounds, ms"))
    names = list(builds)
    print(f"{'positions':>9}  " + "  ".join(f"{n:>14} {'x one':>6}" for n in names)
          + f"  {'ours/theirs':>11}")
    for t in counts:
        cells = "  ".join(f"{spent[(n, t)] * 1e3:14.1f} {spent[(n, t)] / spent[(n, 1)]:6.2f}"
                          for n in names)
        print(f"{t:>9}  {cells}  {spent[(names[1], t)] / spent[(names[0], t)]:11.3f}")


if __name__ == "__main__":
    main()
