"""What one EAGLE-3 draft step costs beside one target step, for heads of
several MLP widths, draft vocabularies and weight formats, side by side in
one run (random weights: the cost does not depend on them).

    python benchmarks/eagle_step_cost.py [--widths 4096,8960] \\
        [--vocab 16384,32768] [--formats q8,q4] [--context 300] [--rounds 30]

A target step is a one-token ``last_only`` feed at ``--context`` positions;
a draft step is one head slot reading the head's own output at as many
slots (each rolled back after it); the ways interleaved round by round;
medians.  Run it on an idle machine.
"""

from __future__ import annotations

from harness import (
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
    p = model_options(parser(__doc__), context=300)
    p.add_argument("--widths", default="4096,8960")
    p.add_argument("--vocab", default="16384,32768")
    p.add_argument("--formats", default="q8,q4")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import time

    import torch

    from forerun.drafters.eagle.head import EagleHead
    from forerun.drafters.eagle.weights import Eagle3Config, Eagle3Weights, default_aux_layers

    target = load_model(args)
    decoder = target.decoder
    c = decoder.model.config
    tokens = prefill(target, args.context)
    base = args.context
    token = tokens[-1]

    def target_step() -> float:
        decoder.rollback(base)
        start = time.perf_counter()
        decoder.feed([token], last_only=True)
        return time.perf_counter() - start

    def head_step(head: EagleHead):
        cache = head.new_cache(base + 1)
        head.forward(torch.tensor(tokens[1:] + [token]), torch.randn(base, head.feature_size),
                     torch.arange(base), cache)
        feature = torch.randn(1, c.hidden_size)
        one, at = torch.tensor([token]), torch.tensor([base])

        def run() -> float:
            cache.rollback(base)
            start = time.perf_counter()
            head.forward(one, feature, at, cache)
            return time.perf_counter() - start
        return run

    ways = {"target": target_step}
    for width in positions_list(args.widths):
        for vocab in positions_list(args.vocab):
            config = Eagle3Config(
                hidden_size=c.hidden_size, intermediate_size=width, num_heads=c.num_heads,
                num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                rope_theta=c.rope_theta, rope_scaling=c.rope_scaling, vocab_size=c.vocab_size,
                draft_vocab_size=vocab, aux_layers=default_aux_layers(c.num_layers))
            weights = Eagle3Weights.random(config)
            for fmt in args.formats.split(","):
                head = EagleHead(weights, decoder.embed_tokens, weights_format=fmt)
                ways[f"mlp {width}, vocab {vocab}, {fmt}"] = head_step(head)
    with torch.inference_mode():
        results = interleaved(ways, args.rounds)
    target_ms = median_ms(results["target"])
    print(machine_line(f"target {target.name} ({decoder.settings.weights}), {base} positions"))
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
