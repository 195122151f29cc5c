"""A short ``last_only`` feed (a draft model's catch-up on a round's
committed tokens, a prompt's last partial block) run position by position
in forerun's native layer operations against torch's batched operators, on
the real models, the two alternating in one process.

    python benchmarks/short_feeds.py [--positions 1,2,3,4,6,8,12,16,32]
        [--repeats 10] [--context 100]

For each model (the 1.5B target in q4, the 0.5B draft in q4-all, as a
draft runs beside it) it fills ``--context`` positions, then times
``Transformer.forward`` of T positions with the last row's logits only,
``rowwise`` (per position, what ``TorchDecoder.feed`` runs where the
native layer operations run) and batched (torch's operators), each T's two in
turn, rolling the cache back after each, and prints the median ms.

Run it on an idle machine (nothing else running): every figure is a time.
"""

from __future__ import annotations

import torch
from harness import (
    interleaved,
    load_model,
    machine_line,
    median_ms,
    parser,
    positions_list,
    prefill,
    timed,
)

MODELS = (("qwen2.5-coder-1.5b", "q4"), ("qwen2.5-coder-0.5b", "q4-all"))


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--positions", default="1,2,3,4,6,8,12,16,32")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--context", type=int, default=100)
    args = p.parse_args()
    counts = positions_list(args.positions)
    print(machine_line(f"median of {args.repeats} forwards after {args.context} positions, "
                       "ms"))
    for name, weights in MODELS:
        model = load_model(model=name, weights=weights)
        decoder, network = model.decoder, model.decoder.model
        if network.layer_ops is None:
            raise SystemExit("forerun's native layer operations don't run here")
        prefill(model, args.context)
        base = decoder.length

        def forward(t: int, rowwise: bool, network=network, decoder=decoder,
                    base=base) -> float:
            seconds = timed(network.forward, torch.arange(2000, 2000 + t),
                            torch.arange(base, base + t), decoder.cache, None,
                            logits_rows=slice(-1, None), rowwise=rowwise)
            decoder.rollback(base)
            return seconds

        spent = interleaved({(t, rowwise): (lambda t=t, rowwise=rowwise: forward(t, rowwise))
                             for t in counts for rowwise in (True, False)}, args.repeats)
        print(f"{name} ({weights})")
        print(f"{'T':>4} {'per position':>13} {'batched':>8} {'ratio':>6}")
        for t in counts:
            one = median_ms(spent[(t, True)])
            batched = median_ms(spent[(t, False)])
            print(f"{t:>4} {one:13.2f} {batched:8.2f} {one / batched:6.2f}")


if __name__ == "__main__":
    main()
