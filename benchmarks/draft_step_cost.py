"""What one draft step costs beside one target step, with the draft's whole
vocabulary and cut to its ``N`` most frequent tokens (FR-Spec), side by side
in one run.

    python benchmarks/draft_step_cost.py [--vocab 8192,16384,32768] \\
        [--context 300] [--rounds 30] [--draft-weights q4-all]

Each way is a one-token ``last_only`` feed at ``--context`` positions
(rolled back after each), the ways interleaved round by round; medians.
Run it on an idle machine.
"""

from __future__ import annotations

from harness import (
    DRAFT,
    frequency_order,
    interleaved,
    load_model,
    machine_line,
    median_ms,
    model_options,
    parser,
    positions_list,
    prefill,
    write_result,
)


def main() -> None:
    p = model_options(parser(__doc__), draft=DRAFT, context=300)
    p.add_argument("--order", default="bench-out/token-order.safetensors",
                   help="the token frequency order's file (counted on this installation's "
                        "Python text when missing)")
    p.add_argument("--vocab", default="8192,16384,32768")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--draft-weights", default="q4-all")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import time

    import torch

    from forerun.drafters.draft_vocabulary import vocabulary_from_order

    target = load_model(args)
    draft = load_model(args, model=args.draft, weights=args.draft_weights)
    order = frequency_order(draft.tokenizer, args.order)
    sizes = positions_list(args.vocab)
    vocabularies = {n: vocabulary_from_order(order, n, draft.decoder.vocab_size,
                                             draft.eos_token_ids) for n in sizes}

    tokens = prefill(target, args.context)
    prefill(draft, args.context)
    base = args.context
    token = tokens[-1]

    def step(model, ids=None):
        def run() -> float:
            model.decoder.restrict_output(ids)
            model.decoder.rollback(base)
            start = time.perf_counter()
            model.decoder.feed([token], last_only=True)
            return time.perf_counter() - start
        return run

    ways = {"target": step(target), "draft": step(draft)}
    for n, v in vocabularies.items():
        ways[f"draft {n}"] = step(draft, v.ids)
    with torch.inference_mode():
        results = interleaved(ways, args.rounds)
    draft.decoder.restrict_output(None)
    target_ms = median_ms(results["target"])
    print(machine_line(f"target {target.name} ({target.decoder.settings.weights}), draft "
                       f"{draft.name} ({args.draft_weights}), {base} positions"))
    lines = ["| step | ms | of a target step |", "|---|---:|---:|"]
    for key, seconds in results.items():
        ms = median_ms(seconds)
        lines.append(f"| {key} | {ms:.2f} | {ms / target_ms:.3f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        write_result(args.out, {"args": vars(args), "table": table,
                                "ms": {k: median_ms(v) for k, v in results.items()}})


if __name__ == "__main__":
    main()
