"""How often a draft model agrees with its target, by what the draft reads
(its window of the prompt) and what it can say (its vocabulary): the
tables that choose the draft window and the draft vocabulary.

    python benchmarks/draft_acceptance.py --limit 3 -n 128 \\
        --windows 16,32,64,128,256,512,all [--vocab 8192,16384,32768] \\
        [--continuations FILE.json] [--out RESULT.json]

For every prompt of the bench set (at most ``--limit`` per category, every
turn of a multi-turn prompt asked after the target's answer to the turn
before, as ``forerun bench`` asks them) the target's greedy continuation of
``-n`` tokens is generated once (kept in ``--continuations``, reused when
the file matches).  The draft is then teacher-forced on it: fed its view of
the prompt (``DraftContext``: the first 4 and last ``W - 4`` tokens of a
prompt longer than ``W``) and the continuation, and each position's argmax
is compared with the target's next token.  Greedy chain speculation accepts
a drafted token exactly when the draft's argmax, given the committed tokens,
is the target's, so the agreement per position gives:

* ``agreement``: the share of positions the draft predicts;
* ``accepted@k``: the mean tokens a chain of ``k`` drafts gets accepted per
  verification (walking the continuation as verification would);
* ``draft prefill``: the prompt tokens the draft reads.

``--vocab N``: the same with the draft's argmax taken over the ``N`` most
frequent tokens of ``--order`` (counted on this installation's Python text
when the file is missing; :mod:`forerun.drafters.draft_vocabulary`), as a
draft with a cut LM head (FR-Spec) would.

It times nothing: acceptance does not depend on the machine's load.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from harness import (
    DRAFT,
    bench_prompts,
    frequency_order,
    load_model,
    machine_line,
    model_options,
    parser,
    write_result,
)

from forerun.drafters.draft_window import SINK_TOKENS


def window_view(prompt: list[int], window: int | None) -> list[int]:
    """What a draft with ``window`` reads of ``prompt`` (DraftContext's view)."""
    if window is None or len(prompt) <= window:
        return list(prompt)
    return prompt[:SINK_TOKENS] + prompt[len(prompt) - (window - SINK_TOKENS):]


def continuations(target, prompts, n: int, path: Path | None) -> list[dict]:
    """The target's greedy answers, turn by turn (from ``path`` when it holds
    this model's answers for the same prompts and ``n``)."""
    key = {"model": target.identity, "n": n, "prompts": [p.label for p in prompts]}
    if path is not None and path.exists():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return saved["turns"]
    turns = []
    for p in prompts:
        history: list[dict] = []
        for i, text in enumerate(p.turns):
            messages = history + [{"role": "user", "content": text}]
            ids = target.encode_prompt(messages=messages)
            out = target.generate(prompt_ids=ids, max_new_tokens=n, temperature=0)
            turns.append({"label": p.label, "category": p.category, "turn": i + 1,
                          "prompt": ids, "output": out.tokens})
            print(f"  {p.label} turn {i + 1}: {len(ids)} prompt, {len(out.tokens)} new",
                  flush=True)
            history = messages + [{"role": "assistant", "content": out.text}]
    if path is not None:
        path.write_text(json.dumps({"key": key, "turns": turns}))
    return turns


def draft_predictions(draft, view: list[int], output: list[int], vocab=None):
    """The draft's argmax after ``view`` and each token of ``output`` but the
    last (restricted to the ids ``vocab`` where given): its prediction of
    every output token."""
    import torch

    decoder = draft.decoder
    decoder.reset()
    first = decoder.feed(view, last_only=True).logits[-1:]
    rest = decoder.feed(output[:-1], last_only=False).logits if len(output) > 1 else first[:0]
    logits = torch.cat([first, rest])
    decoder.reset()
    if vocab is None:
        return {None: logits.argmax(-1).tolist()}
    return {n: ids[logits[:, ids].argmax(-1)].tolist() for n, ids in vocab.items()}


def accepted_per_round(hits: list[bool], k: int) -> float:
    """Mean drafted tokens accepted per verification of ``k``-token chains
    over positions whose draft hits are ``hits`` (each round commits the
    accepted drafts and the target's own token)."""
    pos, rounds, accepted = 0, 0, 0
    while pos < len(hits):
        m = 0
        while m < k and pos + m < len(hits) and hits[pos + m]:
            m += 1
        rounds += 1
        accepted += m
        pos += m + 1
    return accepted / rounds if rounds else 0.0


def main() -> None:
    p = model_options(parser(__doc__), draft=DRAFT)
    p.add_argument("--limit", type=int, default=3, help="prompts per category")
    p.add_argument("--categories", default=None)
    p.add_argument("-n", type=int, default=128, help="new tokens per turn")
    p.add_argument("--windows", default="16,32,64,128,256,512,all")
    p.add_argument("--order", default="bench-out/token-order.safetensors",
                   help="the token frequency order's file (counted on this installation's "
                        "Python text when missing)")
    p.add_argument("--vocab", default="", help="draft vocabulary sizes to try, e.g. 16384,32768")
    p.add_argument("--continuations", type=Path, default=None,
                   help="JSON file that keeps the target's answers between runs")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    windows = [None if w == "all" else int(w) for w in args.windows.split(",")]
    sizes = [int(v) for v in args.vocab.split(",") if v.strip()]

    prompts = bench_prompts(args.limit, args.categories)
    target = load_model(args)
    turns = continuations(target, prompts, args.n, args.continuations)
    del target
    draft = load_model(args, model=args.draft, weights="q4-all")
    vocab = None
    if sizes:
        import torch

        order = frequency_order(draft.tokenizer, args.order)
        vocab = {n: torch.tensor(sorted(order[:n]), dtype=torch.long) for n in sizes}
        vocab[None] = torch.arange(draft.decoder.vocab_size)
    rows = []
    for w in windows:
        for t in turns:
            view = window_view(t["prompt"], w)
            predicted = draft_predictions(draft, view, t["output"], vocab)
            for n, pred in predicted.items():
                hits = [a == b for a, b in zip(pred, t["output"])]
                rows.append({"window": w, "vocab": n, "label": t["label"],
                             "category": t["category"], "turn": t["turn"],
                             "prompt_tokens": len(t["prompt"]), "draft_prefill": len(view),
                             "positions": len(hits), "hits": sum(hits),
                             **{f"accepted@{k}": accepted_per_round(hits, k) for k in (2, 4, 8)}})
        print(f"window {w or 'all'} done", flush=True)

    table = summarize(rows)
    print(table)
    if args.out:
        write_result(args.out, {"machine": machine_line(), "args": vars(args) | {
            "continuations": str(args.continuations), "out": str(args.out)},
            "rows": rows, "table": table})


def summarize(rows: list[dict]) -> str:
    """A markdown table: agreement and accepted@4 per window (and vocabulary)
    and category, with the mean draft prefill."""
    categories = list(dict.fromkeys(r["category"] for r in rows))
    keys = list(dict.fromkeys((r["window"], r["vocab"]) for r in rows))
    head = "| window | vocab | " + " | ".join(categories) + " | all | draft prefill |"
    lines = [head, "|" + "---|" * (len(categories) + 4)]
    for w, n in keys:
        sel = [r for r in rows if (r["window"], r["vocab"]) == (w, n)]
        cells = []
        for c in categories + [None]:
            rs = [r for r in sel if c is None or r["category"] == c]
            hits = sum(r["hits"] for r in rs) / max(1, sum(r["positions"] for r in rs))
            acc4 = statistics.mean(r["accepted@4"] for r in rs)
            cells.append(f"{hits:.2f} / {acc4:.2f}")
        prefill = statistics.mean(r["draft_prefill"] for r in sel)
        lines.append(f"| {w or 'all'} | {n or 'full'} | " + " | ".join(cells)
                     + f" | {prefill:.0f} |")
    lines.append("\ncells: agreement / mean accepted drafts per verification of 4-token chains")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
