"""A decoding step and a verification with a layer's small operations in
forerun's native library (``forerun/kernels/avx2_layer_ops.c``) and in
torch's operators, side by side in one process.

    python benchmarks/layer_ops.py [--model qwen2.5-coder-0.5b] [--weights q4-all]
        [--context 200] [--positions 1,5] [--steps 20] [--rounds 3]

It prefills ``--context`` tokens, then times forwards of each number of
``--positions`` (a verification's rowwise forward for more than one),
alternating the two ways round by round so that a drift of the machine
touches both alike, and prints the best round of each in ms.

Run it on an idle machine (nothing else running): every figure is a time.
"""

from __future__ import annotations

import argparse
import time

import torch

import forerun
from forerun.machine.calibration import cpu_name
from forerun.kernels import native


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--weights", default="q4-all")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--positions", default="1,5")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    model = forerun.load(args.model, weights=args.weights, progress=False)
    network = model.decoder.model
    ops = network.layer_ops
    if ops is None:
        raise SystemExit("forerun's native layer operations don't run here: "
                         f"{native.unavailable_reason()}")
    print(f"CPU: {cpu_name()}, torch {torch.__version__}, threads {torch.get_num_threads()}; "
          f"{args.model} in {network.weights_format}, {args.context} positions of context")
    cache = network.new_cache(args.context + 64)
    tokens = torch.tensor(model._probe_tokens(args.context))
    network.forward(tokens, torch.arange(args.context), cache, None)
    base = cache.length
    best: dict[tuple[int, str], float] = {}
    for _ in range(args.rounds):
        for t in (int(v) for v in args.positions.split(",")):
            fed = torch.full((t,), int(tokens[-1]))
            positions = torch.arange(base, base + t)
            for way in ("torch", "native"):
                network.layer_ops = ops if way == "native" else None
                times = []
                for _ in range(args.steps + 2):
                    cache.rollback(base)
                    start = time.perf_counter()
                    network.forward(fed, positions, cache, None, rowwise=t > 1)
                    times.append(time.perf_counter() - start)
                mean = sum(times[2:]) / args.steps
                best[(t, way)] = min(best.get((t, way), mean), mean)
    network.layer_ops = ops
    for (t, way), seconds in sorted(best.items()):
        print(f"{t} position(s), {way:6}: {seconds * 1000:6.1f} ms")


if __name__ == "__main__":
    main()
