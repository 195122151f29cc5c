"""Load test of ``forerun serve`` with the official ``openai`` client.

Starts the server (a real process on 127.0.0.1) three times and measures:

* **throughput**: requests/min and generated tokens/s with 1, 4 and 16
  concurrent clients (greedy, streamed: each request's time to first token
  too), with the model's draft and with ``--draft none``: the speedup of
  speculative decoding through the server;
* **time to first token of a multi-turn chat**, turn by turn, with the
  prefix cache and with ``--no-prefix-cache``: what reusing the previous
  turn's prefill saves.

Not a test: run it on an idle machine.  The defaults are the issue's setup,
the 1.5B with its 0.5B draft::

    python benchmarks/server_load.py --out benchmarks/results/server_load.json

A quick check of the script itself on the 135M model::

    python benchmarks/server_load.py -m smollm2-135m --draft ngram --requests 4 \\
        --concurrency 1,2 --turns 2 --max-tokens 16

Requests are greedy (``temperature 0``) and use the prompts of
``forerun bench`` (``forerun/bench/prompts/forerun-bench.jsonl``), in
order, as chat messages.
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from harness import bench_prompts, machine_line, model_options, parser, write_result

FOLLOW_UPS = ["Make it shorter.", "Now explain it step by step.", "Add error handling.",
              "Write a test for it.", "What is its complexity?", "Rename the variables."]


class Server:
    """``forerun serve`` in a subprocess, on a free port of 127.0.0.1."""

    def __init__(self, args: list[str], label: str) -> None:
        self.label = label
        cmd = [sys.executable, "-m", "forerun.cli.main", "serve", "--port", "0", "-q", *args]
        print(f"[{label}] starting: {' '.join(cmd[2:])}", flush=True)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.url = None
        for line in self.proc.stdout:
            m = re.search(r"serving .* at (http://\S+)", line)
            if m:
                self.url = m.group(1)
                break
        if self.url is None:
            raise SystemExit(f"[{label}] forerun serve did not start (status "
                             f"{self.proc.wait()})")
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        print(f"[{label}] listening at {self.url}", flush=True)

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=3600)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def timed_request(client, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy chat request: text, tokens, time to first token,
    total time and forerun's statistics."""
    start = time.perf_counter()
    first = None
    pieces, usage, stats = [], None, None
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - start
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
            stats = (chunk.model_extra or {}).get("forerun")
    return {"text": "".join(pieces), "ttft": first, "seconds": time.perf_counter() - start,
            "completion_tokens": usage.completion_tokens if usage else 0,
            "prompt_tokens": usage.prompt_tokens if usage else 0, "forerun": stats}


def model_id(server: Server) -> str:
    return server.client().models.list().data[0].id


def throughput(server: Server, prompts: list[str], clients: int, requests: int,
               max_tokens: int) -> dict:
    """``requests`` requests spread over ``clients`` concurrent clients."""
    model = model_id(server)
    todo = [(i, prompts[i % len(prompts)]) for i in range(requests)]
    lock = threading.Lock()
    done: dict[int, dict] = {}

    def client_loop(_: int) -> None:
        client = server.client()
        while True:
            with lock:
                if not todo:
                    return
                index, prompt = todo.pop(0)
            r = timed_request(client, model, [{"role": "user", "content": prompt}], max_tokens)
            with lock:
                done[index] = r

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client_loop, range(clients)))
    wall = time.perf_counter() - start
    results = [done[i] for i in sorted(done)]  # in request order, not finishing order
    tokens = sum(r["completion_tokens"] for r in results)
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    accepted = sum((r["forerun"] or {}).get("accepted", 0) for r in results)
    drafted = sum((r["forerun"] or {}).get("drafted", 0) for r in results)
    return {"clients": clients, "requests": len(results), "seconds": wall,
            "requests_per_minute": 60 * len(results) / wall, "tokens": tokens,
            "tokens_per_second": tokens / wall,
            "ttft_median": statistics.median(ttfts) if ttfts else None,
            "acceptance_rate": accepted / drafted if drafted else None,
            "texts": [r["text"] for r in results]}


def multi_turn(server: Server, first: str, turns: int, max_tokens: int) -> list[dict]:
    """One chat of ``turns`` turns: each turn's prompt is the whole chat so
    far.  Per turn: prompt tokens, time to first token, reused tokens."""
    model = model_id(server)
    client = server.client()
    messages = [{"role": "user", "content": first}]
    rows = []
    for turn in range(turns):
        r = timed_request(client, model, messages, max_tokens)
        rows.append({"turn": turn + 1, "prompt_tokens": r["prompt_tokens"], "ttft": r["ttft"],
                     "reused": (r["forerun"] or {}).get("prefix_cache_tokens", 0),
                     "text": r["text"]})
        messages += [{"role": "assistant", "content": r["text"]},
                     {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = model_options(parser(__doc__), context_length=4096)
    p.add_argument("--draft", default=None,
                   help="the draft of the speculative runs (default: the preset's own)")
    p.add_argument("--engine", default="torch")
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--turns", type=int, default=6, help="turns of the multi-turn chat")
    p.add_argument("--chat-category", default=None,
                   help="start the multi-turn chat with the first prompt of this category "
                        "(default: the first prompt; 'summarization' gives a long one)")
    p.add_argument("--multi-turn-only", action="store_true",
                   help="measure only the multi-turn chat, with and without the cache")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]

    print(machine_line(torch_info=False))
    questions = bench_prompts()
    prompts = [q.turns[0] for q in questions]
    chat_first = next((q.turns[0] for q in questions if q.category == args.chat_category),
                      None) if args.chat_category else prompts[0]
    if chat_first is None:
        p.error(f"no prompt of category {args.chat_category!r}")
    common = ["-m", args.model, "--engine", args.engine, "--context-length",
              str(args.context_length), "--max-queue", str(max(levels) + 4)]
    draft = ["--draft", args.draft] if args.draft else []
    report: dict = {"model": args.model, "engine": args.engine, "draft": args.draft or "default",
                    "max_tokens": args.max_tokens, "throughput": {}, "multi_turn": {}}

    runs = (("draft", draft),) if args.multi_turn_only else (("draft", draft),
                                                               ("none", ["--draft", "none"]))
    for label, extra in runs:
        server = Server(common + extra, label)
        try:
            rows = []
            for clients in ([] if args.multi_turn_only else levels):
                r = throughput(server, prompts, clients, args.requests, args.max_tokens)
                rows.append(r)
                print(f"[{label}] {clients:>2} clients: {r['requests_per_minute']:7.1f} req/min "
                      f"{r['tokens_per_second']:7.2f} tok/s, median TTFT "
                      f"{r['ttft_median'] or 0:.2f} s", flush=True)
            report["throughput"][label] = rows
            if label == "draft":
                report["multi_turn"]["cache"] = multi_turn(server, chat_first, args.turns,
                                                           args.max_tokens)
        finally:
            server.stop()
    server = Server(common + draft + ["--no-prefix-cache"], "no-cache")
    try:
        report["multi_turn"]["no_cache"] = multi_turn(server, chat_first, args.turns,
                                                      args.max_tokens)
    finally:
        server.stop()

    if not args.multi_turn_only:
        print("\n| clients | draft req/min | draft tok/s | none req/min | none tok/s | speedup "
              "| same texts |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for d, n in zip(report["throughput"]["draft"], report["throughput"]["none"]):
            same = sum(a == b for a, b in zip(d["texts"], n["texts"]))
            print(f"| {d['clients']} | {d['requests_per_minute']:.1f} "
                  f"| {d['tokens_per_second']:.2f} | {n['requests_per_minute']:.1f} "
                  f"| {n['tokens_per_second']:.2f} "
                  f"| {d['tokens_per_second'] / n['tokens_per_second']:.2f}x "
                  f"| {same}/{len(d['texts'])} |")
    print("\n| turn | prompt tokens | reused | TTFT with cache | TTFT without | same text |")
    print("|---:|---:|---:|---:|---:|:---:|")
    for w, c in zip(report["multi_turn"]["cache"], report["multi_turn"]["no_cache"]):
        print(f"| {w['turn']} | {w['prompt_tokens']} | {w['reused']} | {w['ttft'] or 0:.3f} s "
              f"| {c['ttft'] or 0:.3f} s | {'yes' if w['text'] == c['text'] else 'NO'} |")
    if args.out:
        print()
        write_result(args.out, report, torch_info=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
