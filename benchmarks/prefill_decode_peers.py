"""Prefill and one-position decoding of forerun's torch engine against stock
llama-cpp-python on the same GGUF, side by side in one run: prompt tokens/s
of reading prompts of several lengths, and tokens/s of plain greedy decoding
after each.

    python benchmarks/prefill_decode_peers.py [--model qwen2.5-coder-1.5b]
        [--lengths 128,512,1536] [--new-tokens 64] [--rounds 2]
        [--out results.json]

The peers are llama-cpp-python's ``Llama`` as it comes
(``forerun.bench.llama_cpp_reference.stock_llama``: its own batch sizes, f16
keys and values, flash attention off) and the same with flash attention on,
so that llama.cpp's best setting at each length is in the table.  Where
forerun's kernels have AMX tiles, forerun runs once more with them off.  forerun
runs its default weights (the GGUF's own 4- and 6-bit blocks, ``q4``) with
plain decoding.  Prompts are the text of forerun's own docs cut to each
length, fed as token ids (no chat template), so every runner reads the same
tokens; answers are greedy and may end only at ``--new-tokens``.

Prefill is the time to the first new token (the prompt's forward and one
choice of token); decoding is the rest, per token.  Each round runs every
(length, runner) once, in an order that alternates between rounds, so that
a drift of the machine touches all alike; the table gives medians.  Run it
on an idle machine: every figure is a time.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from harness import (
    ROOT,
    forerun_greedy,
    llama_greedy,
    load_model,
    machine_line,
    model_options,
    parser,
    write_result,
)


def without_tiles(kernels, run):
    """``run()`` with the kernels' AMX tiles off (the AVX512-VNNI passes for
    every product: the same results, the earlier speed)."""
    rows = kernels.tile_rows
    kernels.set_tile_rows(1 << 30)
    try:
        return run()
    finally:
        kernels.set_tile_rows(rows)


def doc_ids(model, length: int) -> list[int]:
    """The first ``length`` tokens of forerun's docs."""
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = model.tokenizer.encode(text)
    if len(ids) < length:
        raise SystemExit(f"the docs hold {len(ids)} tokens, fewer than {length}")
    return ids[:length]


def main() -> None:
    p = model_options(parser(__doc__), context_length=2048)
    p.add_argument("--lengths", default="128,512,1536")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None, help="write the runs as JSON here")
    args = p.parse_args()
    lengths = [int(v) for v in args.lengths.split(",")]
    if max(lengths) + args.new_tokens > args.context_length:
        p.error("--context-length must hold the longest prompt and its answer")

    from forerun.bench.llama_cpp_reference import stock_llama
    from forerun.kernels.native import native_kernels
    from forerun.loading.load import resolve_spec

    print(machine_line())
    ours = load_model(args)
    path = resolve_spec(args.model)
    stock = stock_llama(path, context_length=args.context_length)
    flash = stock_llama(path, context_length=args.context_length, flash_attn=True)
    runners = {"forerun": lambda ids, n: forerun_greedy(ours, ids, n, draft="none"),
               "llama.cpp stock": lambda ids, n: llama_greedy(stock, ids, n),
               "llama.cpp flash attention": lambda ids, n: llama_greedy(flash, ids, n)}
    kernels = native_kernels()
    if kernels is not None and kernels.tile_rows is not None:
        runners["forerun without AMX tiles"] = lambda ids, n: without_tiles(
            kernels, lambda: forerun_greedy(ours, ids, n, draft="none"))
    prompts = {length: doc_ids(ours, length) for length in lengths}
    for run in runners.values():                         # warm-up
        run(prompts[lengths[0]][:32], 4)
    runs: list[dict] = []
    for r in range(args.rounds):
        order = list(runners) if r % 2 == 0 else list(reversed(runners))
        for length in lengths:
            for name in order:
                tokens, total, first, _ = runners[name](prompts[length], args.new_tokens)
                runs.append({"round": r, "length": length, "runner": name,
                             "prefill_tok_s": length / first,
                             "decode_tok_s": (len(tokens) - 1) / max(total - first, 1e-9),
                             "tokens": tokens})
                print(f"  round {r} {length:5d} tokens {name:26s} prefill "
                      f"{runs[-1]['prefill_tok_s']:7.1f} tok/s  decode "
                      f"{runs[-1]['decode_tok_s']:6.2f} tok/s", flush=True)

    def median(length: int, name: str, key: str) -> float:
        return statistics.median(x[key] for x in runs
                                 if x["length"] == length and x["runner"] == name)

    print(f"\n{args.model}, {args.new_tokens} new tokens, greedy, medians of "
          f"{args.rounds} rounds")
    print("| prompt tokens | runner | prefill tok/s | decode tok/s |")
    print("|---:|---|---:|---:|")
    for length in lengths:
        for name in runners:
            print(f"| {length} | {name} | {median(length, name, 'prefill_tok_s'):.1f} | "
                  f"{median(length, name, 'decode_tok_s'):.2f} |")
    print("\nforerun / llama.cpp's best setting at each length:")
    for length in lengths:
        best = {key: max(median(length, n, key) for n in runners if n.startswith("llama"))
                for key in ("prefill_tok_s", "decode_tok_s")}
        print(f"  {length:5d} tokens: prefill "
              f"{median(length, 'forerun', 'prefill_tok_s') / best['prefill_tok_s']:.2f}x, "
              f"decode {median(length, 'forerun', 'decode_tok_s') / best['decode_tok_s']:.2f}x")
    for name in runners:
        if name != "forerun":
            pairs = [(x, y) for x in runs for y in runs if x["runner"] == name
                     and y["runner"] == "forerun" and (x["round"], x["length"]) ==
                     (y["round"], y["length"])]
            same = sum(x["tokens"] == y["tokens"] for x, y in pairs)
            print(f"{name}: the same tokens as forerun in {same} of {len(pairs)} runs")
    if args.out:
        write_result(Path(args.out), {"model": args.model, "new_tokens": args.new_tokens,
                                      "lengths": lengths, "runs": runs})
    stock.close()
    flash.close()


if __name__ == "__main__":
    main()
