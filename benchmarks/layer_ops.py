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

import torch
from harness import (
    interleaved,
    load_model,
    machine_line,
    model_options,
    parser,
    positions_list,
    timed,
)

from forerun.api.engine_policy import probe_tokens
from forerun.kernels import native


def main() -> None:
    p = model_options(parser(__doc__), "qwen2.5-coder-0.5b", weights="q4-all", context=200)
    p.add_argument("--positions", default="1,5")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    model = load_model(args)
    network = model.decoder.model
    ops = network.layer_ops
    if ops is None:
        raise SystemExit("forerun's native layer operations don't run here: "
                         f"{native.unavailable_reason()}")
    print(machine_line(f"{args.model} in {network.weights_format}, {args.context} positions "
                       "of context"))
    cache = network.new_cache(args.context + 64)
    tokens = torch.tensor(probe_tokens(model, args.context))
    network.forward(tokens, torch.arange(args.context), cache, None)
    base = cache.length

    def mean_step(t: int, way: str) -> float:
        """Mean seconds of a forward of ``t`` positions, after 2 untimed."""
        network.layer_ops = ops if way == "native" else None
        fed = torch.full((t,), int(tokens[-1]))
        positions = torch.arange(base, base + t)
        times = []
        for _ in range(args.steps + 2):
            cache.rollback(base)
            times.append(timed(network.forward, fed, positions, cache, None, rowwise=t > 1))
        return sum(times[2:]) / args.steps

    ways = {(t, way): (lambda t=t, way=way: mean_step(t, way))
            for t in positions_list(args.positions) for way in ("torch", "native")}
    best = interleaved(ways, args.rounds)
    network.layer_ops = ops
    for (t, way), means in sorted(best.items()):
        print(f"{t} position(s), {way:6}: {min(means) * 1000:6.1f} ms")


if __name__ == "__main__":
    main()
