"""A whole prompt's prefill, its blocks through forerun's native layer
operations (what the torch engine runs where they exist) against torch's
operators, the two alternating in one process.

    python benchmarks/prompt_blocks.py [--model qwen2.5-coder-1.5b]
        [--lengths 128,512,1536] [--rounds 5]

For each length it prefills a prompt of real text (``probe_tokens``) with
:func:`forerun.decoding.prefill.prefill`, in the engine's blocks of 128
positions, prefix reuse off, once with the model's native layer operations
and once without them (``Transformer.layer_ops`` set to None for that run:
every block through torch's operators), and prints each way's median
tok/s, their ratio, and how far apart the last position's logits are (the
native way's are those of feeding the tokens one by one).

Run it on an idle machine (nothing else running): every figure is a time.
"""

from __future__ import annotations

import statistics

from harness import interleaved, load_model, machine_line, model_options, parser, timed

from forerun.api.engine_policy import probe_tokens
from forerun.decoding.prefill import prefill


def main() -> None:
    p = model_options(parser(__doc__))
    p.add_argument("--lengths", default="128,512,1536")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    model = load_model(args, context_length=max(lengths) + 64)
    decoder, network = model.decoder, model.decoder.model
    ops = network.layer_ops
    if ops is None:
        raise SystemExit("forerun's native layer operations don't run here")
    decoder.reuse_prefixes = False
    print(machine_line(f"{args.model}, median of {args.rounds} alternated rounds"))
    print(f"{'tokens':>6} {'native tok/s':>13} {'torch tok/s':>12} {'ratio':>6} "
          f"{'max |logit diff|':>17}")
    for n in lengths:
        tokens = probe_tokens(model, n)
        last = {}

        def run(native: bool, tokens=tokens, last=last) -> float:
            network.layer_ops = ops if native else None
            try:
                seconds = timed(lambda: last.__setitem__(native, prefill(decoder, tokens).logits))
            finally:
                network.layer_ops = ops
            return seconds

        spent = interleaved({True: lambda: run(True), False: lambda: run(False)}, args.rounds)
        native, torch_ops = (n / statistics.median(spent[k]) for k in (True, False))
        gap = float((last[True] - last[False]).abs().max())
        print(f"{n:>6} {native:13.1f} {torch_ops:12.1f} {native / torch_ops:6.2f} {gap:17.3f}")


if __name__ == "__main__":
    main()
