"""Replay the greedy mismatches a ``forerun bench`` report flagged: is each a
near-tie of plain decoding?

    python benchmarks/replay_mismatches.py bench-out/RUN/report.json
        [--threads N]

For every row whose greedy tokens differ from plain decoding of the same
engine, this loads the report's model on its engine, feeds the conversation
up to the first differing token exactly as plain decoding does (the prompt in
one feed, then one token per forward), and prints whether that reproduces
plain decoding's token and the margin between the top two logits there.  A
reproduced token with a small margin means the speculative method's forward
(several positions at once) and plain decoding's (one position) rounded
differently at a near-tie, not that the method accepted a wrong token.

Needs the report's model (and forerun[llama] for llama.cpp reports); the
prompts must be the report's prompt file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from harness import load_model, parser

from forerun.bench.prompts import load_prompts


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("report", type=Path, help="a report.json written by forerun bench")
    ap.add_argument("--threads", type=int, default=None,
                    help="threads for the llama.cpp engine (default: the bench's)")
    args = ap.parse_args()

    report = json.loads(args.report.read_text())
    settings = report["settings"]
    engine = settings.get("engine", "torch")
    options = {"n_threads": args.threads} if args.threads and engine == "llama.cpp" else None
    model = load_model(model=settings["model"], engine=engine,
                       context_length=settings.get("context_length"), engine_options=options)
    prompts = {p.question_id: p for p in load_prompts(settings.get("prompts"))}
    rows = {(r["question_id"], r["method"]): r for r in report["rows"]}
    decoder = model.decoder
    replayed: dict[tuple, tuple] = {}
    mismatched = [r for r in report["rows"] if r.get("mismatch")]
    if not mismatched:
        print("no greedy mismatches in this report")
        return
    for row in mismatched:
        turn = row["first_mismatch"]["turn"] - 1
        position = row["first_mismatch"]["position"]
        plain_turns = rows[(row["question_id"], "plain")]["turns"]
        key = (row["question_id"], turn, position)
        if key not in replayed:
            prompt = prompts[row["question_id"]]
            messages = []
            for i in range(turn):   # earlier turns: plain decoding's answers, as in the bench
                answer = model.tokenizer.decode(plain_turns[i]["tokens"], skip_special_tokens=True)
                messages += [{"role": "user", "content": prompt.turns[i]},
                             {"role": "assistant", "content": answer}]
            messages.append({"role": "user", "content": prompt.turns[turn]})
            ids = model.encode_prompt(messages=messages)
            tokens = plain_turns[turn]["tokens"]
            decoder.reset()
            logits = decoder.feed(ids, last_only=True).logits[-1]
            for token in tokens[:position]:
                logits = decoder.feed([token]).logits[-1]
            top = torch.topk(logits.float(), 2)
            replayed[key] = (len(ids), int(top.indices[0]) == tokens[position],
                             float(top.values[0] - top.values[1]))
        n, same, margin = replayed[key]
        print(f"{row['category']}/{row['question_id']} turn {turn + 1} token {position} "
              f"{row['method']}: prompt of {n} tokens; plain's token reproduced: {same}; "
              f"top-2 logit margin {margin:.3f}")
    decoder.reset()


if __name__ == "__main__":
    main()
