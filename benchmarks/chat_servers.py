"""A multi-turn chat against ``forerun serve`` and llama.cpp's own server,
on the same GGUF, the servers alternated round by round: each turn's time
to first token as the client sees it.

    python benchmarks/chat_servers.py --llama-server PATH [-m qwen2.5-coder-1.5b]
        [--turns 4] [--max-tokens 96] [--rounds 3] [--draft none] [--out FILE.json]

A chat's turn ``k`` sends the whole conversation again (the system
message, every earlier question and answer, question ``k``: the questions
of ``chat_turns.py``), greedy, streamed through the official ``openai``
client.  Both servers keep the last request's cache and reuse what the next
prompt shares with it (forerun: its prefix cache, every position it shares
where the engine's positions are exact; llama-server: its slot's cache,
``cache_prompt`` on by default).  Each server runs one slot on 2 threads
and answers a short warm-up request first; a fresh server per round.  The
table gives each turn's median TTFT over the rounds, and whether every
round's answers were the same as the first round's (forerun's must be).

``--llama-server``: a ``llama-server`` binary built from the llama.cpp
source that llama-cpp-python vendors (see ``batched_serving.py``).  Run it
on an idle machine (nothing else running): every figure is a time.
"""

from __future__ import annotations

import statistics
import time

from batched_serving import forerun_server, llama_server, preset_gguf, warm_up
from chat_turns import QUESTIONS, SYSTEM
from harness import machine_line, model_options, parser, write_result


def chat(url: str, turns: int, max_tokens: int) -> list[dict]:
    """One conversation: per turn the TTFT, the wall time and the text."""
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600)
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": SYSTEM}]
    rows = []
    for question in QUESTIONS[:turns]:
        messages.append({"role": "user", "content": question})
        t0 = time.perf_counter()
        first, pieces = None, []
        stream = client.chat.completions.create(model=model, messages=messages,
                                                max_tokens=max_tokens, temperature=0,
                                                stream=True)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                pieces.append(chunk.choices[0].delta.content)
        text = "".join(pieces)
        rows.append({"ttft": (first or time.perf_counter()) - t0,
                     "seconds": time.perf_counter() - t0, "text": text})
        messages.append({"role": "assistant", "content": text})
    return rows


def main() -> int:
    p = model_options(parser(__doc__))
    p.add_argument("--llama-server", required=True, help="a llama-server binary")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--draft", default="none", help="forerun's drafter (none or ngram)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not 1 <= args.turns <= len(QUESTIONS):
        raise SystemExit(f"--turns must be 1 to {len(QUESTIONS)}")
    gguf = preset_gguf(args.model)
    starts = {"forerun": lambda: forerun_server(args.model, 1, args.context, args.draft),
              "llama-server": lambda: llama_server(args.llama_server, gguf, 1, args.context)}
    runs: dict[str, list[list[dict]]] = {name: [] for name in starts}
    for r in range(args.rounds):
        for name in (list(starts) if r % 2 == 0 else list(starts)[::-1]):
            server = starts[name]()
            try:
                warm_up(server.url)
                runs[name].append(chat(server.url, args.turns, args.max_tokens))
            finally:
                server.stop()
            print(f"round {r + 1}, {name}: TTFT " + ", ".join(
                f"{t['ttft']:.2f}" for t in runs[name][-1]) + " s", flush=True)
    print(machine_line(f"{args.model}, {args.turns} turns of {args.max_tokens} tokens, "
                       f"forerun --draft {args.draft}, median of {args.rounds} rounds"))
    same = {name: all([t["text"] for t in run] == [t["text"] for t in runs[name][0]]
                      for run in runs[name]) for name in runs}
    print("every round's answers the same as the first: " + ", ".join(
        f"{name} {same[name]}" for name in runs))
    print(f"{'turn':>4} {'forerun TTFT s':>15} {'llama-server TTFT s':>20} {'ratio':>6}")
    rows = []
    for k in range(args.turns):
        med = {name: statistics.median(run[k]["ttft"] for run in runs[name]) for name in runs}
        rows.append({"turn": k + 1, **{f"{name}_ttft": med[name] for name in runs}})
        print(f"{k + 1:>4} {med['forerun']:15.2f} {med['llama-server']:20.2f} "
              f"{med['llama-server'] / med['forerun']:6.2f}")
    if args.out:
        write_result(args.out, {"model": args.model, "turns": rows, "same": same,
                                "runs": runs, "draft": args.draft})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
