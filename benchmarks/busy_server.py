"""A server started on an idle machine, then made busy: how much of its idle
decoding speed ``forerun serve`` keeps once another process takes a core,
with its thread count following the load (the default) and fixed
(``FORERUN_THREADS_FOLLOW_LOAD=0``), on each engine.

    python benchmarks/busy_server.py [-m qwen2.5-coder-1.5b] [--engines torch llama.cpp]
        [--tokens 64] [--rounds 2] [--out FILE.json]

Each (engine, setting) starts its own server (``--parallel 1 --draft
none``) on the idle machine, so its OpenMP runtime chooses to spin as an
idle machine's does; one request warms it, one 64-token greedy chat request
is timed idle, then a Python busy loop starts on one core and, 3 s later,
the same request is timed again.  The figure is decode tokens/s (after the
first token), the median over ``--rounds``; the answers must be the same
busy and idle.  Nothing else may run meanwhile.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time

from batched_serving import Process, one_request
from busy_machine import busy_loop
from harness import machine_line, parser, write_result

SETTINGS = {"follow": {}, "fixed": {"FORERUN_THREADS_FOLLOW_LOAD": "0"}}
PROMPT = "Write a Python function that checks whether a string is a palindrome."


def server(model: str, engine: str, env: dict[str, str]) -> Process:
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        return Process([sys.executable, "-m", "forerun.cli.main", "serve", "-m", model,
                        "--engine", engine, "--port", "0", "-q", "--parallel", "1",
                        "--draft", "none"], r"serving .* at (http://\S+)")
    finally:
        os.environ.clear()
        os.environ.update(saved)


def timed(url: str, tokens: int) -> tuple[float, str]:
    got = one_request(url, PROMPT, tokens, threading.Barrier(1))
    decode = got["end"] - got["t0"] - got["ttft"]
    return (got["tokens"] - 1) / decode, got["text"]


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--model", "-m", default="qwen2.5-coder-1.5b")
    p.add_argument("--engines", nargs="+", default=["torch", "llama.cpp"],
                   choices=["torch", "llama.cpp"])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    print(machine_line())
    cells: dict[tuple[str, str, str], list[float]] = {}
    same = True
    for r in range(args.rounds):
        for engine in args.engines:
            for setting, env in SETTINGS.items():
                srv = server(args.model, engine, env)
                try:
                    timed(srv.url, 8)                                   # warm
                    idle, idle_text = timed(srv.url, args.tokens)
                    spinner = busy_loop()
                    try:
                        time.sleep(3)
                        busy, busy_text = timed(srv.url, args.tokens)
                    finally:
                        spinner.kill()
                        spinner.wait()
                finally:
                    srv.stop()
                same = same and idle_text == busy_text
                cells.setdefault((engine, setting, "idle"), []).append(idle)
                cells.setdefault((engine, setting, "busy"), []).append(busy)
                print(f"round {r + 1}: {engine:9} {setting:6} idle {idle:6.2f} tok/s, busy "
                      f"{busy:6.2f} tok/s", flush=True)
    rows = []
    print("\n| engine | threads | idle tok/s | busy tok/s | kept |\n|---|---|---:|---:|---:|")
    for engine in args.engines:
        for setting in SETTINGS:
            idle = statistics.median(cells[(engine, setting, "idle")])
            busy = statistics.median(cells[(engine, setting, "busy")])
            rows.append({"engine": engine, "setting": setting, "idle_tps": idle,
                         "busy_tps": busy, "kept": busy / idle,
                         "idle_runs": cells[(engine, setting, "idle")],
                         "busy_runs": cells[(engine, setting, "busy")]})
            print(f"| {engine} | {setting} | {idle:.2f} | {busy:.2f} | {busy / idle:.0%} |")
    print(f"\nthe same answer busy and idle, every run: {same}")
    if args.out:
        write_result(args.out, {"model": args.model, "tokens": args.tokens,
                                "rounds": args.rounds, "rows": rows, "same_answers": same})


if __name__ == "__main__":
    main()
