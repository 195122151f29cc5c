"""Peak memory of ``forerun serve --parallel N`` with every slot's context
filled: N clients each send a prompt of about ``--prompt-tokens`` tokens at
once (forerun's docs, cut at a different place per client) and ask for
``--max-tokens`` more, so every slot's KV cache holds a long sequence.

    python benchmarks/server_memory.py [-m qwen2.5-coder-1.5b] [--parallel 8]
        [--context-length 4096] [--prompt-tokens 3800] [--max-tokens 64]
        [--kv-cache auto|float16|float32]

It reports the server process's peak RSS (``VmHWM`` from ``/proc``, read
just before it is stopped), its RSS with the model loaded and idle, and
what the server's memory check allows for the slots.  Run it on an idle
machine.
"""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path

from batched_serving import Process, one_request
from harness import ROOT, machine_line, parser


def status_mb(pid: int, field: str) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", text).group(1)) / 1024


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--model", "-m", default="qwen2.5-coder-1.5b")
    p.add_argument("--parallel", type=int, default=8)
    p.add_argument("--context-length", type=int, default=4096)
    p.add_argument("--prompt-tokens", type=int, default=3800)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--kv-cache", default="auto", help="the server's --kv-cache")
    args = p.parse_args()
    print(machine_line())
    text = "\n\n".join(f.read_text() for f in sorted((ROOT / "docs").glob("*.md")))
    # About 4 characters a token in English prose and Markdown; each client
    # its own cut, so that no prefix is shared.
    size = args.prompt_tokens * 3
    prompts = [text[i * 997:i * 997 + size] for i in range(args.parallel)]
    srv = Process([sys.executable, "-m", "forerun.cli.main", "serve", "-m", args.model,
                   "--port", "0", "-q", "--parallel", str(args.parallel), "--draft", "none",
                   "--context-length", str(args.context_length), "--kv-cache", args.kv_cache],
                  r"serving .* at (http://\S+)")
    pid = srv.proc.pid
    try:
        idle = status_mb(pid, "VmRSS")
        barrier = threading.Barrier(args.parallel)
        results: list[dict] = []

        def client(prompt: str) -> None:
            results.append(one_request(srv.url, "Summarise:\n" + prompt, args.max_tokens,
                                       barrier))

        threads = [threading.Thread(target=client, args=(pr,)) for pr in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        peak = status_mb(pid, "VmHWM")
        now = status_mb(pid, "VmRSS")
    finally:
        srv.stop()
    tokens = sum(r["tokens"] for r in results)
    print(f"{args.model}, --parallel {args.parallel}, --context-length {args.context_length}, "
          f"--kv-cache {args.kv_cache}, {len(results)} requests of about "
          f"{args.prompt_tokens} prompt tokens, {tokens} generated")
    print(f"RSS loaded and idle: {idle:.0f} MiB; after the requests: {now:.0f} MiB; "
          f"peak: {peak:.0f} MiB")


if __name__ == "__main__":
    main()
