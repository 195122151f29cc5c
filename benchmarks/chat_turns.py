"""A multi-turn chat's prefills with the prefix cache three ways, alternated
in one process: each turn's time to its first token and the prompt tokens it
took from the cache.

    python benchmarks/chat_turns.py [--model qwen2.5-coder-1.5b]
        [--turns 4] [--new-tokens 96] [--rounds 3] [--out FILE.json]

A chat's turn ``k`` sends the whole conversation again: the system message,
every earlier question and answer, and question ``k``.  The three ways:

* ``cold``: no prefix reuse (every turn prefilled whole);
* ``blocks``: what every engine did before: the turn keeps the whole
  128-position prefill blocks of the previous prompt it starts with (the
  engine told that its positions are not exact);
* ``exact``: where the engine's positions are exact (forerun's engine on its
  native CPU kernels), the turn keeps every position it shares with the
  cache, the previous answer's included.

Each round runs the whole chat once per way, the ways' order rotating from
round to round, and checks that the three give the same answers (greedy).
The questions are this file's own (no evaluation set's).  It prints, per
turn, the prompt's length, the median seconds to the first token and the
reused tokens of each way.

Run it on an idle machine (nothing else running): every figure is a time.
"""

from __future__ import annotations

import statistics
import time

from harness import load_model, machine_line, model_options, parser, write_result

SYSTEM = ("You are a careful senior Python developer. Answer with short, correct "
          "code and one or two sentences of explanation.")
QUESTIONS = (
    "Write a function that parses a duration such as '1h30m' or '45s' into seconds.",
    "Make it reject empty strings and unknown units with a ValueError that names the "
    "problem.",
    "Now add support for days ('2d') and write three pytest tests for it.",
    "Rewrite the parser with a single regular expression and explain the pattern.",
    "How would you make it accept a plain number of seconds such as '90' too?",
    "Summarise the final version's behaviour in a docstring.",
)


def chat(model, way: str, turns: int, new_tokens: int) -> list[dict]:
    """One conversation, turn by turn: its answers and each prefill's facts."""
    decoder = model.decoder
    decoder._exact = None if way == "exact" else False    # "blocks": not exact
    if decoder.exact_positions != (way == "exact"):
        raise SystemExit("chat_turns.py could not set the engine's exact positions "
                         "(TorchDecoder._exact); fix the script for this version")
    model.reuse_prompts = way != "cold"
    model.reset_cache()
    messages = [{"role": "system", "content": SYSTEM}]
    out = []
    for question in QUESTIONS[:turns]:
        messages.append({"role": "user", "content": question})
        start = time.perf_counter()
        result = model.generate(messages=messages, max_new_tokens=new_tokens, temperature=0)
        wall = time.perf_counter() - start
        stats = result.stats
        out.append({"prompt_tokens": stats.prompt_tokens, "reused": stats.reused_prompt_tokens,
                    "first_token_s": stats.prefill_seconds, "wall_s": wall,
                    "text": result.text})
        messages.append({"role": "assistant", "content": result.text})
    decoder._exact = None
    return out


def main() -> None:
    p = model_options(parser(__doc__))
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not 1 <= args.turns <= len(QUESTIONS):
        raise SystemExit(f"--turns must be 1 to {len(QUESTIONS)}")
    model = load_model(args, context_length=4096)
    if not model.decoder.exact_positions:
        raise SystemExit("this engine's positions are not exact here (forerun's engine on "
                         "its native CPU kernels has them): nothing to compare")
    ways = ("cold", "blocks", "exact")
    runs: dict[str, list[list[dict]]] = {w: [] for w in ways}
    for r in range(args.rounds):
        for w in ways[r % 3:] + ways[:r % 3]:
            runs[w].append(chat(model, w, args.turns, args.new_tokens))
    texts = {w: [t["text"] for t in runs[w][0]] for w in ways}
    same = all(texts[w] == texts["cold"] for w in ways) and all(
        [t["text"] for t in run] == texts["cold"] for w in ways for run in runs[w])
    print(machine_line(f"{args.model}, {args.turns} turns of {args.new_tokens} new tokens, "
                       f"median of {args.rounds} rounds"))
    print(f"answers the same three ways, every round: {same}")
    print(f"{'turn':>4} {'prompt':>6} " + " ".join(
        f"{w + ' TTFT s':>13} {w + ' reused':>13}" for w in ways))
    rows = []
    for k in range(args.turns):
        row = {"turn": k + 1, "prompt_tokens": runs["cold"][0][k]["prompt_tokens"]}
        cells = []
        for w in ways:
            ttft = statistics.median(run[k]["first_token_s"] for run in runs[w])
            reused = runs[w][0][k]["reused"]
            row[w] = {"first_token_s": ttft, "reused": reused}
            cells.append(f"{ttft:13.2f} {reused:13d}")
        rows.append(row)
        print(f"{k + 1:>4} {row['prompt_tokens']:>6} " + " ".join(cells))
    total = {w: sum(r[w]["first_token_s"] for r in rows) for w in ways}
    print("all turns' TTFT: " + ", ".join(f"{w} {total[w]:.2f} s" for w in ways)
          + f"; exact / blocks {total['exact'] / total['blocks']:.2f}")
    if args.out:
        write_result(args.out, {"model": args.model, "turns": rows, "same_answers": same,
                                "new_tokens": args.new_tokens, "rounds": args.rounds})


if __name__ == "__main__":
    main()
