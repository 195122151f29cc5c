"""Drafting after a stall left the draft model's step estimate too high:
with the timed step of one-token rounds (``STALE_STEP`` committed tokens
without a timed step) and without it, side by side on one loaded model.

    python benchmarks/stalled_draft_estimate.py [--estimate-ms 120]
        [--categories code,math] [--limit 2] [--max-new-tokens 128]

Before each pass over the prompts the draft's step estimate is set to
``--estimate-ms`` (what one stalled step can leave it at), then the prompts
are generated with the draft model alone, greedy; the passes alternate
(with, without, with, without) so that the machine's drift does not favour
one.  Without the timed step the policy stops drafting and its one-token
explorations time only catch-ups, so the estimate never comes down.

Run it on an idle machine (nothing else running): every figure is a time.
"""

from __future__ import annotations

import time

from draft_ab_options import bench_prompts, draft_ab_parser, header, load_target
from forerun.drafters import draft_model


def main() -> None:
    ap = draft_ab_parser(__doc__)
    ap.add_argument("--estimate-ms", type=float, default=120.0)
    ap.add_argument("--categories", default="code,math")
    args = ap.parse_args()

    model = load_target(args)
    model.generate("hi", max_new_tokens=4, draft=args.draft, draft_lookup=False)
    method, _ = model._method(args.draft)      # the draft model alone, as generate built it
    drafter = method.planner.drafter
    prompts = bench_prompts(args, args.categories)
    print(header(args, f" alone, greedy, {len(prompts)} prompts of {args.max_new_tokens} "
                       f"tokens, the step estimate set to {args.estimate_ms:g} ms before each "
                       f"pass"))
    default = draft_model.STALE_STEP
    for timed in (True, False, True, False):
        draft_model.STALE_STEP = default if timed else 1 << 62
        drafter._step_ema = args.estimate_ms / 1e3
        seconds, drafted, accepted = 0.0, 0, 0
        for p in prompts:
            ids = model.encode_prompt(messages=[{"role": "user", "content": p.turns[0]}])
            start = time.perf_counter()
            out = model.generate(prompt_ids=ids, max_new_tokens=args.max_new_tokens,
                                 ignore_eos=True, draft=args.draft, draft_lookup=False)
            seconds += time.perf_counter() - start
            drafted += out.stats.drafted
            accepted += out.stats.accepted
        print(f"{'with' if timed else 'without'} the timed step: {seconds:.1f} s, drafted "
              f"{drafted}, accepted {accepted}, step estimate at the end "
              f"{drafter.step_seconds() * 1e3:.1f} ms", flush=True)
    draft_model.STALE_STEP = default


if __name__ == "__main__":
    main()
