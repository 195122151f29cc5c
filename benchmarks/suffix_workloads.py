"""Suffix drafting on the workloads it is for, and on the bench's prompts:
plain decoding, prompt lookup (`ngram`) and suffix drafting (`suffix`), each
generation timed end to end (the whole prompt read: the model's cached
prompt is forgotten first), the three methods in turn on every item.

Workloads (none from Spec-Bench or the test sets it draws on):

* `repeat`: three requests, each asked twice in a row (greedy);
* `regenerate`: three chats answered, then regenerated (sampled at
  temperature 0.7, another seed: a user asking for another answer);
* `edit`: one piece of code changed in five rounds ("rename X", "add type
  hints", ...), each round's prompt holding the code the last round gave;
* `bench`: `forerun bench`'s prompts (`--limit` a category), every turn.

Suffix drafting's store is cleared before each workload, so a workload
drafts only from its own earlier requests.  ``--methods`` chooses the
methods (default ``plain,ngram,suffix``; also ``draft-lookup`` and
``draft-lookup-suffix``: the 0.5B draft beside prompt lookup or suffix
drafting); at most one of them remembers answers.  Every method's tokens are
checked against plain decoding's (greedy, and sampled with the same seed:
deterministic drafts give plain sampling's very tokens).

    python benchmarks/suffix_workloads.py --out benchmarks/results/DATE-suffix-workloads.json
"""

from __future__ import annotations

import re
import statistics
import time
from collections import defaultdict
from typing import Any

from harness import (
    bench_prompts,
    chat_ids,
    load_model,
    machine_line,
    model_options,
    parser,
    write_result,
)

#: The methods it can run (``--methods``), as ``Model.generate``'s
#: ``speculative``; the draft model is the 1.5B preset's, the 0.5B.
METHODS: dict[str, dict[str, Any]] = {
    "plain": {}, "ngram": {"draft": "ngram"}, "suffix": {"draft": "suffix"},
    "draft-lookup": {"draft": "qwen2.5-coder-0.5b", "draft_lookup": True},
    "draft-lookup-suffix": {"draft": "qwen2.5-coder-0.5b", "draft_lookup": "suffix"},
}
#: Methods that record answers in the model's suffix store: one a run, so
#: that none drafts from an answer another method gave to the same request.
REMEMBERING = ("suffix", "draft-lookup-suffix")

REPEATED = (
    "Write a Python function that parses an ISO 8601 date string and returns a datetime, "
    "with error handling.",
    "Explain how a hash map handles collisions, with a short example.",
    "Write a bash script that backs up a directory into a dated tar.gz archive and keeps "
    "the last seven archives.",
)
REGENERATED = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Suggest a name and a tagline for a bakery that only sells sourdough bread, and explain "
    "the choice.",
    "Give me five ideas for a weekend project with a Raspberry Pi.",
)
CODE = '''class Inventory:
    def __init__(self):
        self.items = {}

    def add_item(self, name, price, quantity=1):
        if name in self.items:
            self.items[name]["quantity"] += quantity
        else:
            self.items[name] = {"price": price, "quantity": quantity}

    def remove(self, name, quantity=1):
        item = self.items[name]
        item["quantity"] -= quantity
        if item["quantity"] <= 0:
            del self.items[name]

    def price_of(self, name):
        return self.items[name]["price"]

    def names(self):
        return sorted(self.items)
'''
EDITS = (
    "Rename the method add_item to add.",
    "Add type hints to every method.",
    "Make remove raise a KeyError with a clear message when the item is missing.",
    "Add a method total_value that returns the sum of price times quantity.",
    "Add a docstring to the class and to each method.",
)


def ask(model, method: str, ids: list[int], n: int, temperature: float = 0.0,
        seed: int = 0) -> dict[str, Any]:
    """One generation, the whole prompt read: its tokens, text, seconds and
    counters."""
    model.reset_cache()
    start = time.perf_counter()
    result = model.generate(prompt_ids=ids, max_new_tokens=n,
                            speculative=METHODS[method] or None, temperature=temperature,
                            seed=seed)
    seconds = time.perf_counter() - start
    s = result.stats
    return {"tokens": list(result.tokens), "text": result.text, "seconds": seconds,
            "new_tokens": s.new_tokens, "prefill_seconds": s.prefill_seconds,
            "rounds": s.rounds, "drafted": s.drafted, "accepted": s.accepted}


def each_method(model, methods: list[str], record: list, workload: str, label: str,
                ids: list[int], n: int, **sampling: Any) -> dict[str, Any]:
    """The item asked of every method in turn; plain's run, with every
    method's run recorded (and checked against plain's tokens)."""
    runs = {m: ask(model, m, ids, n, **sampling) for m in methods}
    for m, run in runs.items():
        same = run["tokens"] == runs["plain"]["tokens"]
        if not same:
            print(f"MISMATCH: {workload} {label} {m} differs from plain decoding")
        record.append({"workload": workload, "item": label, "method": m,
                       "identical": same, "prompt_tokens": len(ids),
                       **{k: v for k, v in run.items() if k not in ("tokens", "text")}})
    last = methods[-1]
    r = runs[last]
    print(f"{workload:10} {label:24} " + "  ".join(
        f"{m} {runs[m]['seconds']:6.1f}s" for m in methods)
        + f"  {last}: {r['accepted']}/{r['drafted']} in {r['rounds']} rounds", flush=True)
    return runs["plain"]


def code_of(answer: str, previous: str) -> str:
    """The code block of an answer (to its end if the fence was cut off)."""
    found = re.search(r"```(?:python)?\n(.*?)(?:```|$)", answer, re.S)
    return found.group(1) if found and found.group(1).strip() else previous


def main() -> None:
    p = parser(__doc__)
    model_options(p, weights="q4")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per answer")
    p.add_argument("--edit-tokens", type=int, default=320, help="new tokens per code edit")
    p.add_argument("--limit", type=int, default=3, help="bench prompts per category")
    p.add_argument("--workloads", default="repeat,regenerate,edit,bench")
    p.add_argument("--methods", default="plain,ngram,suffix",
                   help=f"comma-separated, plain first: {', '.join(METHODS)}")
    p.add_argument("--out", default=None, help="write the runs as JSON here")
    args = p.parse_args()
    methods = args.methods.split(",")
    if methods[0] != "plain" or not set(methods) <= set(METHODS):
        p.error(f"--methods: plain first, then any of {', '.join(METHODS)}")
    if len(set(methods) & set(REMEMBERING)) > 1:
        p.error(f"--methods: at most one of {', '.join(REMEMBERING)} a run (they share the "
                f"model's store of answers)")
    model = load_model(args)
    print(machine_line())
    store = model.suffix_store()
    record: list[dict[str, Any]] = []
    chosen = args.workloads.split(",")
    # a warm-up, untimed: each method's set-up (and cost measurement) first
    for m in methods:
        ask(model, m, chat_ids(model, "Say hello."), 8)
    store.clear()
    if "repeat" in chosen:
        store.clear()
        for i, text in enumerate(REPEATED):
            for time_ in ("first", "again"):
                each_method(model, methods, record, "repeat", f"{i}-{time_}", chat_ids(model, text),
                            args.tokens)
    if "regenerate" in chosen:
        store.clear()
        for i, text in enumerate(REGENERATED):
            for seed, time_ in ((1, "first"), (2, "again")):
                each_method(model, methods, record, "regenerate", f"{i}-{time_}",
                            chat_ids(model, text), args.tokens, temperature=0.7, seed=seed)
    if "edit" in chosen:
        store.clear()
        code = CODE
        for i, edit in enumerate(EDITS):
            text = (f"Here is my code:\n```python\n{code}```\n{edit} Reply with the complete "
                    f"updated code in one python block.")
            plain = each_method(model, methods, record, "edit", f"round-{i + 1}",
                                chat_ids(model, text), args.edit_tokens)
            code = code_of(plain["text"], code)
    if "bench" in chosen:
        store.clear()
        for prompt in bench_prompts(args.limit):
            history: list[dict[str, str]] = []
            for t, turn in enumerate(prompt.turns):
                plain = each_method(model, methods, record, "bench",
                                    f"{prompt.category}-{prompt.question_id}-{t + 1}",
                                    chat_ids(model, turn, history), args.tokens)
                history += [{"role": "user", "content": turn},
                            {"role": "assistant", "content": plain["text"]}]
    summary = summarize(record, methods)
    if args.out:
        write_result(args.out, {"settings": vars(args), "summary": summary, "runs": record})


def summarize(record: list[dict[str, Any]], methods: list[str]) -> list[dict[str, Any]]:
    """Per workload (the bench's per category, the repeated workloads' second
    asks apart): seconds and tokens per method, each method's tok/s over
    plain's, and the last method's tokens per verification."""
    groups: dict[tuple[str, str], dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in record:
        name = r["workload"]
        if name == "bench":
            name = "bench " + r["item"].rsplit("-", 2)[0]
        groups[(name, "all")][r["method"]].append(r)
        if r["item"].endswith("-again"):
            groups[(name, "asked again")][r["method"]].append(r)
    rows = []
    others, last = methods[1:], methods[-1]
    print("\n| workload | asks | plain tok/s | " + " | ".join(others)
          + f" | {last} tokens per verification | identical |")
    print("|---|---|---:|" + "---:|" * len(others) + "---:|---|")
    for (name, part), runs in sorted(groups.items()):
        rate = {m: sum(r["new_tokens"] for r in rs) / sum(r["seconds"] for r in rs)
                for m, rs in runs.items()}
        s = runs[last]
        rounds = sum(r["rounds"] for r in s)
        per = (sum(r["accepted"] for r in s) + rounds) / rounds if rounds else 1.0
        same = all(r["identical"] for rs in runs.values() for r in rs)
        row = {"workload": name, "part": part, "asks": len(runs["plain"]), "tok_s": rate,
               **{f"{m}_x": rate[m] / rate["plain"] for m in others},
               "last_tokens_per_round": per, "identical": same}
        rows.append(row)
        print(f"| {name} ({part}) | {row['asks']} | {rate['plain']:.1f} | "
              + " | ".join(f"{row[f'{m}_x']:.2f}x" for m in others)
              + f" | {per:.2f} | {'yes' if same else 'NO'} |")
    bench = [r for r in rows if r["workload"].startswith("bench") and r["part"] == "all"]
    if bench:
        print(f"bench categories: {last} {min(r[f'{last}_x'] for r in bench):.2f}x to "
              f"{max(r[f'{last}_x'] for r in bench):.2f}x plain (median "
              f"{statistics.median(r[f'{last}_x'] for r in bench):.2f}x)")
    return rows

if __name__ == "__main__":
    main()
