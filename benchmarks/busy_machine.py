"""Decoding speed idle and beside a busy core: how much of its idle speed
forerun keeps when another process takes one core (a Python busy loop), for
plain decoding and the default drafter, under each OpenMP setting given.

Each (setting, method, condition) runs in a fresh process, since OpenMP
reads its settings once, when it starts; the runs are interleaved round by
round (idle and busy alternating) so that drift hits every cell alike.  The
figure is decode tokens per second (prefill excluded), the median over
``--rounds``.  Nothing else may run meanwhile.

    python benchmarks/busy_machine.py --model smollm2-135m --methods none
    python benchmarks/busy_machine.py --settings default passive \\
        --out benchmarks/results/busy-machine.json
    python benchmarks/busy_machine.py --engines torch llama.cpp --methods none

``--engines``: forerun's engines to run (``llama.cpp`` needs
``forerun[llama]``); each row names its engine.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from harness import machine_line, parser, write_result

# Environment settings to compare: "default" is what forerun does by itself
# (forerun.machine.wait_policy), "unset" what it did before.
SETTINGS = {
    "default": {},
    "unset": {"FORERUN_OMP_DEFAULTS": "0"},
    "active": {"OMP_WAIT_POLICY": "active"},
    "passive": {"OMP_WAIT_POLICY": "passive"},
    "spin-10k": {"GOMP_SPINCOUNT": "10000"},
    "spin-100k": {"GOMP_SPINCOUNT": "100000"},
    "1-thread": {"OMP_NUM_THREADS": "1"},
}

PROMPT = "Write a Python function that checks whether a string is a palindrome."

CHILD = r"""
import json, sys, forerun
model = forerun.load(sys.argv[1], progress=False, engine=sys.argv[5])
method = sys.argv[2]
if method == "default":     # the preset's own drafter, as forerun generate runs it
    from forerun.speculation.config import resolve_for_preset
    kwargs = {"speculative": resolve_for_preset(sys.argv[1])}
else:
    kwargs = {"draft": method}
model.generate(sys.argv[3], max_new_tokens=8, **kwargs)          # warm
out = model.generate(sys.argv[3], max_new_tokens=int(sys.argv[4]), ignore_eos=True, **kwargs)
import os
print(json.dumps({"tps": out.stats.tokens_per_second, "method": out.stats.method,
                  "tokens": out.tokens, "policy": os.environ.get("OMP_WAIT_POLICY")}))
"""


def busy_loop() -> subprocess.Popen:
    """Another process holding one core until killed."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(0.5)
    return proc


def one_run(model: str, engine: str, method: str, tokens: int, env: dict, busy: bool) -> dict:
    spinner = busy_loop() if busy else None
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, model, method, PROMPT, str(tokens),
                              engine],
                             env={**os.environ, **env}, capture_output=True, text=True,
                             timeout=1800)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    if out.returncode != 0:
        raise SystemExit(f"run failed ({engine}, {env}, {method}, busy={busy}):\n"
                         f"{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--model", "-m", default="qwen2.5-coder-1.5b")
    p.add_argument("--methods", nargs="+", default=["none", "default"],
                   help="'none' (plain decoding), 'default' (the preset's drafter) or a "
                        "--draft value")
    p.add_argument("--settings", nargs="+", default=["default", "unset"],
                   choices=sorted(SETTINGS))
    p.add_argument("--engines", nargs="+", default=["torch"], choices=["torch", "llama.cpp"])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="write the result here (JSON)")
    args = p.parse_args()

    print(machine_line())
    cells: dict[tuple[str, str, str, str], list[float]] = {}
    tokens_of: dict[tuple[str, str, str], list[int]] = {}
    for r in range(args.rounds):
        for engine in args.engines:
            for setting in args.settings:
                for method in args.methods:
                    for busy in (False, True):
                        got = one_run(args.model, engine, method, args.tokens,
                                      SETTINGS[setting], busy)
                        key = (engine, setting, method, "busy" if busy else "idle")
                        cells.setdefault(key, []).append(got["tps"])
                        tokens_of.setdefault(key[:3], got["tokens"])
                        print(f"round {r + 1}: {engine:9} {setting:10} {method:8} {key[3]:5} "
                              f"{got['tps']:7.2f} tok/s  ({got['method']}, "
                              f"OMP_WAIT_POLICY={got['policy']})", flush=True)
    print(f"\n{'engine':9} {'setting':10} {'method':8} {'idle tok/s':>10} {'busy tok/s':>10} "
          f"{'kept':>6}")
    rows = []
    for engine in args.engines:
        for setting in args.settings:
            for method in args.methods:
                idle = statistics.median(cells[(engine, setting, method, "idle")])
                busy = statistics.median(cells[(engine, setting, method, "busy")])
                rows.append({"engine": engine, "setting": setting, "env": SETTINGS[setting],
                             "method": method, "idle_tps": idle, "busy_tps": busy,
                             "kept": busy / idle,
                             "idle_runs": cells[(engine, setting, method, "idle")],
                             "busy_runs": cells[(engine, setting, method, "busy")]})
                print(f"{engine:9} {setting:10} {method:8} {idle:10.2f} {busy:10.2f} "
                      f"{busy / idle:6.0%}")
    same = len({json.dumps(t) for t in tokens_of.values()}) == 1
    print(f"\nevery setting and method gave the same tokens: {same}")
    if args.out:
        write_result(args.out, {"model": args.model, "tokens": args.tokens,
                                "rounds": args.rounds, "rows": rows, "same_tokens": same})


if __name__ == "__main__":
    main()
