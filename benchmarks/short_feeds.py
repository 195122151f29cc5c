"""A short ``last_only`` feed (a draft model's catch-up on a round's
committed tokens, a prompt's last partial block) run position by position
in forerun's native layer operations against torch's batched operators, on
the real models, the two alternating in one process.

    python benchmarks/short_feeds.py [--positions 1,2,3,4,6,8,12,16,32]
        [--repeats 10] [--context 100]

For each model (the 1.5B target in q4, the 0.5B draft in q4-all, as a
draft runs beside it) it fills ``--context`` positions, then times
``Transformer.forward`` of T positions with the last row's logits only,
``rowwise`` (per position, what ``TorchDecoder.feed`` runs up to
``PER_POSITION_FEED`` positions) and batched (beyond), each T's two in
turn, rolling the cache back after each, and prints the median ms.

Run it on an idle machine (nothing else running): every figure is a time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import forerun
from forerun.machine.calibration import cpu_name
from forerun.engines.torch_engine import PER_POSITION_FEED

MODELS = (("qwen2.5-coder-1.5b", "q4"), ("qwen2.5-coder-0.5b", "q4-all"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--positions", default="1,2,3,4,6,8,12,16,32")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--context", type=int, default=100)
    args = p.parse_args()
    counts = [int(t) for t in args.positions.split(",")]
    print(f"{cpu_name()}, {torch.get_num_threads()} threads; median of {args.repeats} "
          f"forwards after {args.context} positions, ms; the engine runs up to "
          f"{PER_POSITION_FEED} per position")
    for name, weights in MODELS:
        model = forerun.load(name, weights=weights)
        decoder, network = model.decoder, model.decoder.model
        if network.layer_ops is None:
            raise SystemExit("forerun's native layer operations don't run here")
        decoder.reset()
        decoder.feed(list(range(1000, 1000 + args.context)), last_only=True)
        base = decoder.length
        spent = {(t, rowwise): [] for t in counts for rowwise in (True, False)}
        for _ in range(args.repeats):
            for t in counts:
                ids = torch.arange(2000, 2000 + t)
                positions = torch.arange(base, base + t)
                for rowwise in (True, False):
                    start = time.perf_counter()
                    network.forward(ids, positions, decoder.cache, None,
                                    logits_rows=slice(-1, None), rowwise=rowwise)
                    spent[(t, rowwise)].append(time.perf_counter() - start)
                    decoder.rollback(base)
        print(f"{name} ({weights})")
        print(f"{'T':>4} {'per position':>13} {'batched':>8} {'ratio':>6}")
        for t in counts:
            one = statistics.median(spent[(t, True)]) * 1e3
            batched = statistics.median(spent[(t, False)]) * 1e3
            print(f"{t:>4} {one:13.2f} {batched:8.2f} {one / batched:6.2f}")


if __name__ == "__main__":
    main()
