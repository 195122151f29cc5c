"""forerun's native attention against the same kernel at another git
revision, side by side in one process: the whole step, and the attention's
share of it, for one position and for a verification's rowwise forwards.

    python benchmarks/attention_ab.py --against HEAD~1
        [--model qwen2.5-coder-1.5b] [--weights q4] [--context 600]
        [--positions 1,2,4] [--steps 10]

It builds ``forerun/kernels/avx2_layer_ops.c`` as it was at ``--against``
(with the flags forerun builds it with), prefills ``--context`` tokens,
then times forwards of each number of ``--positions``, switching the
attention between the two builds step by step so that a drift of the
machine touches both alike, and prints the median of each in ms.  Both
must give the same logits to the bit (the kernels promise it); the script
stops with an error where they differ.

Run it on an idle machine (nothing else running): every figure is a time.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import forerun
from forerun.machine.calibration import cpu_name
from forerun.kernels import native

SOURCE = "forerun/kernels/avx2_layer_ops.c"


def build_at(revision: str, folder: Path) -> ctypes.CDLL:
    """The layer operations as they were at ``revision``, built into ``folder``."""
    root = Path(__file__).resolve().parent.parent
    source = folder / "layer_ops.c"
    source.write_bytes(subprocess.run(["git", "show", f"{revision}:{SOURCE}"], cwd=root,
                                      check=True, capture_output=True).stdout)
    library = folder / "layer_ops.so"
    subprocess.run(["cc", *native.FLAGS, str(source), "-o", str(library), "-lm"], check=True)
    return ctypes.CDLL(str(library))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", required=True, help="a git revision, e.g. HEAD~1")
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--weights", default="q4")
    p.add_argument("--context", type=int, default=600)
    p.add_argument("--positions", default="1,2,4")
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    model = forerun.load(args.model, weights=args.weights, progress=False)
    decoder = model.decoder
    ops = decoder.model.layer_ops
    if ops is None:
        raise SystemExit("forerun's native layer operations do not run here")
    counts = [int(n) for n in args.positions.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        theirs = build_at(args.against, Path(tmp)).fr_attention
        theirs.argtypes, theirs.restype = ops._attention.argtypes, ops._attention.restype
        builds = {"this tree": ops._attention, f"at {args.against}": theirs}
        spent = [0.0]
        attention = ops.attention

        def timed(*a, **k):
            start = time.perf_counter()
            out = attention(*a, **k)
            spent[0] += time.perf_counter() - start
            return out

        ops.attention = timed
        ids = [100 + (i * 7919) % 30000 for i in range(args.context)]
        decoder.feed(ids, last_only=True)
        base = decoder.length
        times: dict[tuple[str, int], list[tuple[float, float]]] = {}
        logits: dict[tuple[str, int], torch.Tensor] = {}
        for _ in range(args.steps):
            for t in counts:
                for name, fn in builds.items():
                    ops._attention = fn
                    decoder.rollback(base)
                    spent[0] = 0.0
                    start = time.perf_counter()
                    out = decoder.feed(ids[:t]).logits
                    times.setdefault((name, t), []).append((time.perf_counter() - start,
                                                            spent[0]))
                    if not torch.equal(logits.setdefault((name, t), out), out):
                        raise SystemExit(f"{name}'s logits for {t} positions vary between steps")
        ops._attention, ops.attention = builds["this tree"], attention
        decoder.rollback(base)
    print(f"{args.model} ({args.weights}) after {args.context} tokens, {cpu_name()}, "
          f"{torch.get_num_threads()} threads; median of {args.steps} steps, ms")
    print(f"{'positions':>9}  {'build':16} {'step':>8} {'attention':>10}")
    for t in counts:
        for name in builds:
            rows = times[(name, t)]
            print(f"{t:>9}  {name:16} {statistics.median(r[0] for r in rows) * 1e3:8.2f} "
                  f"{statistics.median(r[1] for r in rows) * 1e3:10.2f}")
        if not torch.equal(*(logits[(name, t)] for name in builds)):
            raise SystemExit(f"the two builds' logits differ for {t} positions")
    print("logits: identical to the bit")


if __name__ == "__main__":
    main()
