"""Concurrent clients against ``forerun serve --parallel N`` and llama.cpp's
own server with ``--parallel N``, on the same GGUF, in one run.

    python benchmarks/batched_serving.py [-m qwen2.5-coder-1.5b] [--clients 1,2,4,8,16]
        [--max-tokens 128] [--llama-server PATH] [--draft none] [--out FILE.json]

For each N, each server is started with ``--parallel N`` and N clients (the
official ``openai`` client, streamed) each send one greedy chat request of
``--max-tokens`` tokens at the same moment, every client a different prompt
(``forerun bench``'s prompts, in order).  Per server and N: aggregate
generated tokens/s (all tokens over the wall time from the first request to
the last answer), p50 and p95 time to first token, p50 gap between streamed
chunks (inter-token latency), and how many answers equal the same prompt's
answer with fewer clients (in the first run that had it: at N = 16, the
first 8 prompts; forerun's must all equal, a batch never changes an
answer).  Before the measured requests each server answers one short
warm-up request (8 tokens, a prompt of its own), so that a fresh server's
first-request costs don't weigh on the few-client levels alone.  Each
server runs on 2 threads (``-t 2`` for llama.cpp); llama.cpp gets ``N x``
the context so that each of its slots has the context forerun gives each
request.

``--rounds R`` runs every (N, server) R times, round by round, the servers
in alternating order from one round to the next, and the table gives each
figure's median over the rounds: this VM's speed drifts by up to 1.5x
within minutes, and one run per server can catch one of them in a slow
minute (one client's ITL here: 100 and 110 ms in two runs, 70 and 72 ms
in two others the same hour).

``--llama-server``: a ``llama-server`` binary built from the llama.cpp
source that llama-cpp-python vendors (``pip download --no-binary :all:
llama-cpp-python``, then ``cmake -B build && cmake --build build --target
llama-server``); without it only forerun runs.  Run it on an idle machine.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from harness import bench_prompts, machine_line, model_options, parser, write_result


class Process:
    """A server in a subprocess, on a free port of 127.0.0.1, ready when
    ``ready`` (a regex) appears in its output."""

    def __init__(self, cmd: list[str], ready: str, url: str | None = None) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.url = url
        tail: list[str] = []
        for line in self.proc.stdout:
            tail = (tail + [line])[-20:]
            m = re.search(ready, line)
            if m:
                self.url = self.url or m.group(1)
                break
        else:
            raise SystemExit(f"{cmd[0]} did not start:\n{''.join(tail)}")
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def forerun_server(model: str, n: int, context: int, draft: str) -> Process:
    return Process([sys.executable, "-m", "forerun.cli.main", "serve", "-m", model, "--port",
                    "0", "-q", "--parallel", str(n), "--draft", draft, "--context-length",
                    str(context), "--max-queue", str(n + 4)], r"serving .* at (http://\S+)")


def llama_server(binary: str, gguf: Path, n: int, context: int) -> Process:
    """llama.cpp's server; with its extra weight buffers (repacking) off
    where forerun's llama.cpp engine turns them off (CPUs with AMX, whose
    kernels crash some virtual machines)."""
    from forerun.engines.llama_cpp_engine import default_extra_buffers

    port = free_port()
    repack = [] if default_extra_buffers() else ["--no-repack"]
    return Process([binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                    "-t", "2", "-tb", "2", "--parallel", str(n), "-c", str(context * n),
                    "--no-webui", "--temp", "0", *repack],
                   r"listening on (http://\S+)",
                   url=f"http://127.0.0.1:{port}/v1")


def one_request(url: str, prompt: str, max_tokens: int, start: threading.Barrier) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600)
    model = client.models.list().data[0].id
    start.wait(120)
    t0 = time.perf_counter()
    stamps, pieces, usage = [], [], None
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter()
    return {"text": "".join(pieces), "t0": t0, "end": end,
            "ttft": stamps[0] - t0 if stamps else None,
            "gaps": [b - a for a, b in zip(stamps, stamps[1:])],
            "tokens": usage.completion_tokens if usage else len(pieces)}


def warm_up(url: str) -> None:
    """One short request before the measured ones, so that a server's
    first-request costs (its weights' first reads from the page cache, lazy
    set-up) are not charged to the first level of clients alone."""
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600)
    client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": "Say hello in one word."}])


def load(url: str, prompts: list[str], max_tokens: int) -> dict:
    barrier = threading.Barrier(len(prompts))
    out: list[dict] = [{} for _ in prompts]

    def run(i: int) -> None:
        out[i] = one_request(url, prompts[i], max_tokens, barrier)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(r["end"] for r in out) - min(r["t0"] for r in out)
    ttfts = sorted(r["ttft"] for r in out if r["ttft"] is not None)
    gaps = [g for r in out for g in r["gaps"]]
    return {"clients": len(prompts), "seconds": wall,
            "tokens": sum(r["tokens"] for r in out),
            "tokens_per_second": sum(r["tokens"] for r in out) / wall,
            "ttft_p50": statistics.median(ttfts),
            "ttft_p95": ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))],
            "itl_p50": statistics.median(gaps) if gaps else None,
            "texts": [r["text"] for r in out]}


def level_medians(runs: list[dict]) -> dict:
    """One (clients, server)'s figures over its rounds: the median of each
    time and rate, and the answers that equal the same prompts' first
    answers summed over the rounds."""
    def median(key: str) -> float:
        return statistics.median(r[key] or 0.0 for r in runs)

    return {"tokens_per_second": median("tokens_per_second"), "ttft_p50": median("ttft_p50"),
            "ttft_p95": median("ttft_p95"), "itl_p50": median("itl_p50"),
            "same_as_alone": sum(r["same_as_alone"] for r in runs),
            "compared": sum(r["compared"] for r in runs)}


def preset_gguf(model: str) -> Path:
    """The GGUF file forerun runs for ``model`` (a preset or a path)."""
    from forerun.loading.presets import PRESETS, resolve_preset

    if model in PRESETS:
        return resolve_preset(model, progress=False)
    return Path(model)


def main() -> int:
    p = model_options(parser(__doc__))
    p.add_argument("--clients", default="1,2,4,8,16")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--context", type=int, default=4096, help="positions per request")
    p.add_argument("--draft", default="none", help="forerun's drafter (none or ngram)")
    p.add_argument("--llama-server", default=None, help="a llama-server binary")
    p.add_argument("--rounds", type=int, default=1,
                   help="runs of each (clients, server), the servers' order alternating")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    levels = [int(c) for c in args.clients.split(",")]
    print(machine_line(torch_info=False), flush=True)
    prompts = [q.turns[0] for q in bench_prompts()]
    if len(prompts) < max(levels):
        p.error(f"{len(prompts)} prompts for {max(levels)} clients")
    servers = {"forerun": lambda n: forerun_server(args.model, n, args.context, args.draft)}
    if args.llama_server:
        gguf = preset_gguf(args.model)
        servers["llama.cpp"] = lambda n: llama_server(args.llama_server, gguf, n, args.context)
    report: dict = {"model": args.model, "max_tokens": args.max_tokens, "draft": args.draft,
                    "rounds": args.rounds, "runs": {name: [] for name in servers}}
    alone: dict[str, list[str]] = {}
    for round_ in range(args.rounds):
        order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
        for n in levels:
            for name in order:
                server = servers[name](n)
                try:
                    warm_up(server.url)
                    r = load(server.url, prompts[:n], args.max_tokens)
                finally:
                    server.stop()
                # Each prompt's answer in the first run it was in (the fewest
                # clients), against which its later answers are compared.
                reference = alone.setdefault(name, [])
                r["round"] = round_
                r["compared"] = min(n, len(reference))
                r["same_as_alone"] = sum(t == reference[i] for i, t in enumerate(r["texts"])
                                         if i < len(reference))
                reference.extend(r["texts"][len(reference):])
                report["runs"][name].append(r)
                print(f"[{name}] round {round_ + 1}, {n:>2} clients: "
                      f"{r['tokens_per_second']:7.2f} tok/s, TTFT p50 {r['ttft_p50']:.2f} s "
                      f"p95 {r['ttft_p95']:.2f} s, ITL p50 {(r['itl_p50'] or 0) * 1000:.1f} ms",
                      flush=True)
    report["medians"] = medians = {name: {n: level_medians([r for r in rows
                                                            if r["clients"] == n])
                                          for n in levels}
                                   for name, rows in report["runs"].items()}
    first = next(iter(servers))
    print(f"\nmedians of {args.rounds} round(s)")
    print("\n| server | clients | tok/s | x 1 client | x llama.cpp | TTFT p50 | TTFT p95 "
          "| ITL p50 | answers as alone |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, by_n in medians.items():
        for n, m in by_n.items():
            peer = medians.get("llama.cpp", {}).get(n)
            versus = (f"{m['tokens_per_second'] / peer['tokens_per_second']:.2f}"
                      if name == first and peer else "")
            print(f"| {name} | {n} | {m['tokens_per_second']:.1f} | "
                  f"{m['tokens_per_second'] / by_n[levels[0]]['tokens_per_second']:.2f} | "
                  f"{versus} | {m['ttft_p50']:.2f} s | {m['ttft_p95']:.2f} s | "
                  f"{m['itl_p50'] * 1000:.0f} ms | {m['same_as_alone']}/{m['compared']} |")
    if args.out:
        write_result(args.out, report, torch_info=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
