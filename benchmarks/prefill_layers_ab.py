"""A whole prompt's prefill with forerun's native library as it was at
another git revision against this tree's, side by side in one process.

    python benchmarks/prefill_layers_ab.py --against HEAD~1
        [--model qwen2.5-coder-1.5b] [--lengths 128,512,1536] [--rounds 9]

Both libraries are built from all their C sources (products, layer
operations, tiles, the decoder layer) with the flags of this CPU's best
build (or the AVX2 one where it has none).  A prefill's blocks run each
layer in one native call (``decoder_layer.c``); the script loads the model
once and switches which library those calls go to, prompt by prompt, the
order alternating between rounds, so that a drift of the machine touches
both alike.  Prompts are forerun's docs cut to each length, read whole
(the model's cached prompt is forgotten first).  It prints, per length,
the median of the per-round ratios (this tree's tok/s over the other's;
the first round warms up and is left out), their range, the medians of
each, and whether the two gave the same greedy tokens after the prompt.

Run it on an idle machine (nothing else running): every figure is a time.
"""

from __future__ import annotations

import ctypes
import statistics
import subprocess
import tempfile
from pathlib import Path

from harness import ROOT, forerun_greedy, load_model, machine_line, model_options, parser, source_at
from prefill_decode_peers import doc_ids

from forerun.kernels.binding import NativeKernels
from forerun.kernels.build import FLAGS, dot_builds, sources
from forerun.machine.cpu import cpu_flags


def library(folder: Path, name: str, files: dict[str, bytes],
            extra: tuple[str, ...]) -> NativeKernels:
    """The C ``files`` (name: text) built together into ``folder``."""
    paths = []
    for file, text in files.items():
        path = folder / name / file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text)
        paths.append(str(path))
    out = folder / f"{name}.so"
    subprocess.run(["cc", *FLAGS, *extra, *paths, "-o", str(out), "-lm"], check=True)
    return NativeKernels(ctypes.CDLL(str(out)), out)


def main() -> None:
    p = model_options(parser(__doc__), context_length=2048)
    p.add_argument("--against", required=True, help="the git revision to compare with")
    p.add_argument("--lengths", default="128,512,1536")
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    if args.rounds < 2:
        p.error("--rounds must be at least 2 (the first warms up)")
    lengths = [int(v) for v in args.lengths.split(",")]
    if max(lengths) + 2 > args.context_length:
        p.error("--context-length must hold the longest prompt")
    builds = dot_builds(cpu_flags())
    build, extra = builds[0] if builds else ("avx2", ())
    model = load_model(args)
    net = model.decoder.model
    if not getattr(net, "fuse_layers", False) or net.fused_layers()[0] is None:
        raise SystemExit("this model's layers don't run in one native call here "
                         "(float weights, or the native kernels are off)")
    with tempfile.TemporaryDirectory() as tmp:
        files = [s.relative_to(ROOT) for s in sources()]
        libs = {f"at {args.against}": library(Path(tmp), "theirs", {
                    f.name: source_at(args.against, str(f)) for f in files}, extra),
                "this tree": library(Path(tmp), "ours", {
                    f.name: (ROOT / f).read_bytes() for f in files}, extra)}
        kept = list(net._fused)
        ways = {name: [(parts, None if fused is None else (lib, fused[1]))
                       for parts, fused in kept] for name, lib in libs.items()}
        prompts = {n: doc_ids(model, n) for n in lengths}
        rates: dict[tuple[str, int], list[float]] = {(w, n): [] for w in ways for n in lengths}
        tokens: dict[tuple[str, int], list[int]] = {}
        names = list(ways)
        try:
            for r in range(args.rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    net._fused[:] = ways[name]
                    for n in lengths:
                        toks, _, first, _ = forerun_greedy(model, prompts[n], 2)
                        tokens[(name, n)] = toks
                        rates[(name, n)].append(n / first)
        finally:
            net._fused[:] = kept
    print(machine_line(f"{build} build; {args.rounds - 1} rounds after one to warm up"))
    theirs, ours = names
    print(f"{'tokens':>6}  {'ours/theirs':>11}  {'range':>13}  {theirs + ' tok/s':>18}  "
          f"{'this tree tok/s':>15}  same tokens")
    for n in lengths:
        a, b = rates[(theirs, n)][1:], rates[(ours, n)][1:]
        ratios = sorted(y / x for x, y in zip(a, b))
        print(f"{n:>6}  {statistics.median(ratios):11.3f}  {ratios[0]:6.3f}-{ratios[-1]:.3f}  "
              f"{statistics.median(a):18.1f}  {statistics.median(b):15.1f}  "
              f"{tokens[(theirs, n)] == tokens[(ours, n)]}")


if __name__ == "__main__":
    main()
