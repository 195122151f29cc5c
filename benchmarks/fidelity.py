"""How far each weight format's logits are from the float32 reference, and
from llama.cpp's, over real text.

The shipped prompt set (forerun/bench/prompts) is tokenized and cut into
sequences of ``--length`` tokens until ``--positions`` positions are
covered; every position's logits are computed by the float32 reference
(the GGUF dequantized), by each format of the PyTorch engine and by
llama.cpp on the same GGUF.  For each, against the reference and against
llama.cpp: top-1 agreement (over all positions, and over those where the
reference's top two logits are at least 0.1 apart, since a near-tie in the
reference is flipped by any rounding), mean KL divergence KL(reference ||
format) in nats, and the largest logit difference, with each sequence's
first position (which starts without a BOS token) apart.

    python benchmarks/fidelity.py [--model qwen2.5-coder-1.5b] [--positions 2048]
        [--formats q4,q4:float32,q8,bfloat16] [--no-llama-cpp] [--json out.json]

A format runs with the KV cache it runs with by default (float16 where
forerun's native layer operations run), or with the one after a colon
(``q4:float32``); the reference keeps a float32 cache.

Not a timing: it can run beside other work, but it holds the float32 model
(about 4 bytes per parameter) in memory.
"""

from __future__ import annotations

import torch
from harness import load_model, machine_line, model_options, parser, release, write_result

from forerun.bench.prompts import load_prompts
from forerun.machine.calibration import cpu_name

# Logits: a reference top-1 ahead of its runner-up by less than this is a near-tie.
MARGIN = 0.1


def sequences(model, positions: int, length: int) -> list[list[int]]:
    """Token sequences of ``length`` cut from the prompt set's text."""
    text = "\n\n".join(turn for p in load_prompts() for turn in p.turns)
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    need = -(-positions // length) * length
    while len(ids) < need:
        ids = ids + ids
    return [ids[i:i + length] for i in range(0, need, length)]


def all_logits(model, seqs: list[list[int]], chunk: int = 16) -> torch.Tensor:
    """Every position's float32 logits, ``[positions, vocab]``, fed ``chunk``
    positions at a time: as a verification feeds them, so through the
    kernels that compute generated tokens' logits (a forward of 128 or
    more would take q8's prefill kernel, forerun.engines.prefill_kernel)."""
    d = model.decoder
    rows = []
    for seq in seqs:
        d.reset()
        for i in range(0, len(seq), chunk):
            rows.append(d.feed(seq[i:i + chunk]).logits.float().cpu())
    d.reset()
    return torch.cat(rows)


def compare(got: torch.Tensor, ref: torch.Tensor, starts: torch.Tensor,
            chunk: int = 128) -> dict:
    """Agreement of ``got`` with ``ref`` (both ``[positions, vocab]``).
    ``starts``: bool ``[positions]``, the first position of each sequence.

    Top-1 agreement is given over all positions and over those where the
    reference's top two logits differ by at least ``MARGIN`` (elsewhere the
    reference itself is a near-tie, which any rounding can flip).  The
    largest logit gap is given apart for the sequences' first positions: a
    sequence cut from running text starts without a BOS token, and the first
    position's huge activations (the attention sink) magnify any rounding
    of them."""
    agree = decisive = decisive_agree = 0
    kl_sum, gap, first_gap = 0.0, 0.0, 0.0
    for i in range(0, got.shape[0], chunk):
        g, r = got[i:i + chunk].double(), ref[i:i + chunk].double()
        same = g.argmax(-1) == r.argmax(-1)
        top2 = r.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) >= MARGIN
        agree += int(same.sum())
        decisive += int(clear.sum())
        decisive_agree += int((same & clear).sum())
        logp_ref, logp_got = torch.log_softmax(r, -1), torch.log_softmax(g, -1)
        kl_sum += float((logp_ref.exp() * (logp_ref - logp_got)).sum())
        row_gap = (g - r).abs().amax(-1)
        first = starts[i:i + chunk]
        gap = max([gap] + row_gap[~first].tolist())
        first_gap = max([first_gap] + row_gap[first].tolist())
    n = got.shape[0]
    return {"top1_agreement": round(agree / n, 4),
            "top1_agreement_decisive": round(decisive_agree / max(decisive, 1), 4),
            "decisive_share": round(decisive / n, 3),
            "mean_kl": float(f"{kl_sum / n:.3g}"), "max_logit_gap": round(gap, 3),
            "max_logit_gap_first_positions": round(first_gap, 3)}


def main() -> None:
    p = model_options(parser(__doc__))
    p.add_argument("--positions", type=int, default=2048)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--formats", default="q4,q8,bfloat16")
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--json")
    args = p.parse_args()

    context = args.length + 8
    reference = load_model(args, weights="float32", context_length=context,
                           kv_cache="float32")
    seqs = sequences(reference, args.positions, args.length)
    logits = {"float32": all_logits(reference, seqs)}
    del reference
    runs = [(f, {"weights": f.partition(":")[0],
                 **({"kv_cache": f.partition(":")[2]} if ":" in f else {})})
            for f in args.formats.split(",") if f]
    if not args.no_llama_cpp:
        runs.append(("llama.cpp", {"engine": "llama.cpp"}))
    for name, options in runs:
        model = load_model(args, context_length=context, **options)
        logits[name] = all_logits(model, seqs)
        release(model)
        del model
    positions = sum(len(s) for s in seqs)
    print(machine_line(f"{args.model}: {positions} positions of the prompt set"))
    starts = torch.zeros(positions, dtype=torch.bool)
    starts[torch.tensor([sum(len(s) for s in seqs[:i]) for i in range(len(seqs))])] = True
    print(f"top-1 agreement: over all positions, and (in brackets) over the share of "
          f"positions where the reference's top two logits differ by >= {MARGIN}")
    print("| logits of | vs | top-1 agreement | where decisive | mean KL (nats) | "
          "largest logit gap | at a sequence's first position |")
    print("|---|---|---:|---:|---:|---:|---:|")
    table = {}
    for name, got in logits.items():
        for base in ("float32", "llama.cpp"):
            if base == name or base not in logits:
                continue
            row = compare(got, logits[base], starts)
            table[f"{name} vs {base}"] = row
            print(f"| {name} | {base} | {row['top1_agreement']:.2%} | "
                  f"{row['top1_agreement_decisive']:.2%} ({row['decisive_share']:.0%}) | "
                  f"{row['mean_kl']:.3g} | {row['max_logit_gap']:.2f} | "
                  f"{row['max_logit_gap_first_positions']:.2f} |")
    if args.json:
        write_result(args.json, {"model": args.model, "positions": positions,
                                 "cpu": cpu_name(), "rows": table})


if __name__ == "__main__":
    main()
