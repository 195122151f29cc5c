"""What a Medusa training step costs in float32 and in bfloat16 (autocast),
side by side in one process, rounds alternating: the step of
``forerun train medusa`` (three heads' forwards over the candidate
vocabulary, the loss, the backward and AdamW) on random data of the real
shapes (Qwen2.5-1.5B's hidden size 1,536).

    python benchmarks/medusa_step_cost.py [--vocab 60000] [--batch 128] [--rounds 5]

Run it on an idle machine: every figure is a time.  The ratio is what
``--compute bfloat16`` buys on this CPU (2.54x on a Zen 4 with
AVX512-BF16; where bfloat16 products are emulated it is below 1)."""

from __future__ import annotations

import statistics
import time

import torch
from harness import machine_line, parser

from forerun.drafters.medusa.training import (
    TeacherData,
    TrainSettings,
    _Heads,
    batch_loss,
    own_paths,
)


def teacher(rows: int, hidden: int, vocab: int, top_k: int, gen: torch.Generator
            ) -> TeacherData:
    """Random teacher data of one chunk of ``rows`` positions."""
    return TeacherData(hidden=torch.randn(rows, hidden, generator=gen),
                       top_ids=torch.randint(0, vocab, (rows, top_k), generator=gen),
                       top_logp=torch.randn(rows, top_k, generator=gen),
                       tokens=torch.randint(0, vocab, (rows,), generator=gen),
                       chunk=torch.zeros(rows, dtype=torch.long), offset=torch.arange(rows),
                       length=torch.full((rows,), rows, dtype=torch.long))


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--vocab", type=int, default=60_000,
                   help="candidate vocabulary (the run's `forerun medusa info` says it)")
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=10, help="steps timed per round")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    data = teacher(4096, args.hidden, args.vocab, 10, gen)
    local = torch.arange(args.vocab)
    own = own_paths(data, args.heads)
    lm_rows = torch.randn(args.vocab, args.hidden, generator=gen) * 0.02
    models = {c: _Heads(args.heads, args.hidden, lm_rows, own_lm_head=False)
              for c in ("float32", "bfloat16")}
    opts = {c: torch.optim.AdamW(m.parameters(), lr=1e-4) for c, m in models.items()}
    times: dict[str, list[float]] = {c: [] for c in models}

    def steps(compute: str) -> float:
        settings = TrainSettings(heads=args.heads, compute=compute)
        start = time.perf_counter()
        for _ in range(args.steps):
            rows = torch.randint(0, data.tokens.numel() - args.heads - 1, (args.batch,),
                                 generator=gen)
            loss = batch_loss(models[compute], data, rows, local, own, settings)
            opts[compute].zero_grad(set_to_none=True)
            loss.backward()
            opts[compute].step()
        return (time.perf_counter() - start) / args.steps

    for compute in models:        # warm-up: allocations, the bfloat16 rows
        steps(compute)
    for _ in range(args.rounds):
        for compute in models:
            times[compute].append(steps(compute))
    print(machine_line(f"{args.heads} heads, batch {args.batch}, candidate vocabulary "
                       f"{args.vocab}, hidden {args.hidden}"))
    full, half = statistics.median(times["float32"]), statistics.median(times["bfloat16"])
    for compute, t in (("float32", full), ("bfloat16", half)):
        print(f"{compute:>9}: {t * 1e3:7.1f} ms a step (median of {args.rounds} rounds), "
              f"{args.batch / t:6.0f} tokens/s")
    print(f"bfloat16 over float32: {full / half:.2f}x")


if __name__ == "__main__":
    main()
