"""Would a draft model in fewer bits than 4 pay: how often does it still agree
with the target, and how many bytes would a step read?

    python benchmarks/experiments/draft_low_bit.py --continuations FILE.json \\
        [--bits 4,3,2] [--group 32] [--limit 3]

The draft (the 0.5B Qwen, its GGUF dequantized to float32) is quantized to
``b``-bit groups of ``--group`` weights with a scale and a minimum each (the
shape of forerun's q4, at fewer levels) in every matrix: the layers' and the
tied LM head.  Each matrix is rounded to those levels and run in float32
("fake quantization"), so the agreement is what a kernel for the format would
reach; forerun has no kernel below 4 bits, so the step's cost is not measured
here, only the weight bytes it would read (a draft step is mostly reading
weights: the q4-all draft's step is 24.6 ms for about 310 MB on this machine).

Agreement is measured as in ``benchmarks/draft_acceptance.py``: teacher-forced
on the target's greedy answers to the bench's prompts (``--continuations``,
which that script writes), the draft reading its default window (512) of each
prompt; the share of positions where the draft's argmax is the target's token,
and the mean drafted tokens a 4-token chain gets accepted.  It times nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from draft_acceptance import (  # noqa: E402
    accepted_per_round,
    continuations,
    draft_predictions,
    window_view,
)
from harness import DRAFT, bench_prompts, load_model, model_options, parser  # noqa: E402

from forerun.drafters.draft_window import DEFAULT_DRAFT_WINDOW  # noqa: E402


def fake_quantize(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """``w`` rounded to ``2**bits`` levels per group of ``group`` values along
    its rows, each group ``scale * q + min`` with its own scale and minimum."""
    rows, cols = w.shape
    pad = (-cols) % group
    g = torch.nn.functional.pad(w, (0, pad)).reshape(rows, -1, group)
    lo = g.amin(-1, keepdim=True)
    hi = g.amax(-1, keepdim=True)
    scale = (hi - lo) / (2 ** bits - 1)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round((g - lo) / scale), 0, 2 ** bits - 1)
    return (q * scale + lo).reshape(rows, -1)[:, :cols].contiguous()


def matrices(model) -> list:
    """Every float32 matrix layer of ``model``'s network (layers, LM head)."""
    net = model.decoder.model
    found = []
    for layer in net.layers:
        found += [layer.qkv, layer.o, layer.gate_up, layer.down]
    found.append(net.lm_head)
    for m in found:
        if not hasattr(m, "weight") or m.weight.dtype != torch.float32:
            raise SystemExit(f"expected float32 matrices, found {type(m).__name__}")
    return found


def agreement(draft, turns) -> tuple[float, float]:
    hits_all, accepted = [], []
    for t in turns:
        view = window_view(t["prompt"], DEFAULT_DRAFT_WINDOW)
        pred = draft_predictions(draft, view, t["output"])[None]
        hits = [a == b for a, b in zip(pred, t["output"])]
        hits_all += hits
        accepted.append(accepted_per_round(hits, 4))
    return sum(hits_all) / len(hits_all), sum(accepted) / len(accepted)


def main() -> None:
    p = model_options(parser(__doc__), draft=DRAFT)
    p.add_argument("--limit", type=int, default=3, help="prompts per category")
    p.add_argument("-n", type=int, default=128, help="new tokens per turn")
    p.add_argument("--continuations", type=Path, required=True)
    p.add_argument("--bits", default="4,3,2")
    p.add_argument("--group", type=int, default=32)
    args = p.parse_args()

    prompts = bench_prompts(args.limit, None)
    target = load_model(args)
    turns = continuations(target, prompts, args.n, args.continuations)
    del target

    print("| draft weights | bits a weight | agreement | accepted a 4-token chain |")
    print("|---|---:|---:|---:|")
    draft = load_model(args, model=args.draft, weights="q4-all")
    a, acc = agreement(draft, turns)
    print(f"| q4-all (forerun's kernel) | 5.0 | {a:.3f} | {acc:.2f} |", flush=True)
    del draft
    draft = load_model(args, model=args.draft, weights="float32")
    layers = matrices(draft)
    original = [m.weight.clone() for m in layers]
    a, acc = agreement(draft, turns)
    print(f"| float32 (the GGUF dequantized) | 32 | {a:.3f} | {acc:.2f} |", flush=True)
    for bits in (int(b) for b in args.bits.split(",")):
        for m, w in zip(layers, original):
            m.weight.copy_(fake_quantize(w, bits, args.group))
        a, acc = agreement(draft, turns)
        per_weight = bits + 32 / args.group        # a half-float scale and minimum a group
        print(f"| {bits}-bit, groups of {args.group} | {per_weight:.2f} | {a:.3f} | "
              f"{acc:.2f} |", flush=True)


if __name__ == "__main__":
    main()
