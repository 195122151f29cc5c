"""forerun's prefill with its AMX tiles on and off, alternated in one
process: tokens/s of reading a whole prompt (the cache forgotten before each
run), on a CPU whose native kernels were built with AMX.

    python benchmarks/prefill_tiles.py [--model qwen2.5-coder-1.5b]
        [--length 512] [--rounds 10] [--tile-rows 64]

The tiles change only the speed: both settings must give the same first
token (checked).  Prompts are forerun's docs cut to ``--length`` tokens.
Each round runs both settings, in an order that alternates between rounds;
the report gives each run, the medians and the median of the paired
ratios.  Run it on an idle machine: every figure is a time.
"""

from __future__ import annotations

import statistics

from harness import ROOT, forerun_greedy, load_model, machine_line, model_options, parser


def main() -> None:
    p = model_options(parser(__doc__), context_length=2048)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--tile-rows", type=int, default=0,
                   help="positions from which the tiles run (0: the build's own)")
    args = p.parse_args()
    from forerun.kernels.native import native_kernels

    model = load_model(args)
    kernels = native_kernels()
    if kernels is None or kernels.tile_rows is None:
        raise SystemExit("forerun's kernels have no AMX tiles on this machine "
                         f"({'none' if kernels is None else kernels.instruction})")
    tiles = args.tile_rows or kernels.tile_rows
    settings = {f"tiles from {tiles} positions": tiles, "no tiles": 1 << 30}
    text = "\n\n".join(f.read_text() for f in sorted((ROOT / "docs").glob("*.md")))
    ids = model.tokenizer.encode(text)[:args.length]
    forerun_greedy(model, ids[:64], 1, draft="none")            # warm-up
    speed: dict[str, list[float]] = {name: [] for name in settings}
    first: dict[str, set[int]] = {name: set() for name in settings}
    print(machine_line(f"{args.model}, {len(ids)} prompt tokens"))
    for r in range(args.rounds):
        order = list(settings) if r % 2 == 0 else list(reversed(settings))
        for name in order:
            kernels.set_tile_rows(settings[name])
            tokens, _, seconds, _ = forerun_greedy(model, ids, 1, draft="none")
            speed[name].append(len(ids) / seconds)
            first[name].add(tokens[0])
            print(f"  round {r} {name:28s} {speed[name][-1]:7.1f} tok/s", flush=True)
    kernels.set_tile_rows(tiles)
    on, off = settings
    for name in settings:
        print(f"{name:28s} median {statistics.median(speed[name]):7.1f} tok/s")
    ratios = [a / b for a, b in zip(speed[on], speed[off])]
    print(f"paired ratio on/off: median {statistics.median(ratios):.2f} "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f})")
    same = len(first[on] | first[off]) == 1
    print(f"the same first token in every run: {same}")
    if not same:
        raise SystemExit("the tiles changed a result")


if __name__ == "__main__":
    main()
