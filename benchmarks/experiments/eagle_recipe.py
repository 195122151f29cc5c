"""How a new EAGLE-3 head learns fastest from the few tokens a CPU affords:
its initial weights, learning rate and batch size, each variant trained for
the same wall time on the same cached features and scored on the same
held-out records (issue 39).

    python benchmarks/experiments/eagle_recipe.py --variants warm,small,small-pre \\
        [--seconds 360] [--eval-every 85] [--k 1] [--vocab 16384]

It reads the committed training data (``training-data/qwen2.5-coder-1.5b``),
computes or reuses the target's features through ``forerun train eagle``'s
own trainer (its 10% held-out split), and trains each variant with the
trainer's loss on records cut into pieces.  Variants: ``small`` (the old
initialisation: every matrix random), ``small-pre`` (the same, with the
features scaled to unit RMS per channel), ``warm`` (what
``TrainableEagle3.initialise(carry=True)`` does now), ``warm-frozen`` (the
LM head frozen), ``warm3`` (lr 3e-3), ``warm-b64`` (64-token batches),
``base`` (the first head's settings).  Result:
``benchmarks/results/2026-11-27-eagle-training-recipe.md``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time

import torch

from forerun.api import load
from forerun.corpus.token_manifest import TokenManifest
from forerun.training import eagle as E

DATA = "training-data/qwen2.5-coder-1.5b/"
H = 1536

#: name -> (lr, batch tokens, piece tokens, scale features, init, LM head frozen)
VARIANTS = {
    "base": (4e-4, 1536, 2048, False, "noise", False),
    "small": (1e-3, 256, 256, False, "noise", False),
    "small-pre": (1e-3, 256, 256, True, "noise", False),
    "warm": (1e-3, 256, 256, False, "carry", False),
    "warm-frozen": (1e-3, 256, 256, False, "carry", True),
    "warm3": (3e-3, 256, 256, False, "carry", False),
    "warm-b64": (1e-3, 64, 64, False, "carry", False),
}


def pieces(records, size):
    return [r.piece(a, min(len(r), a + size + 1)) for r in records
            for a in range(0, len(r) - 1, size) if min(len(r), a + size + 1) - a >= 8]


def scaled(records, inv):
    return [E._Record(r.embeds, r.aux * inv, r.argmax, r.top_ids, r.top_logp, r.loss_start)
            for r in records]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="warm")
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--eval-every", type=float, default=60)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--features-only", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model = load("qwen2.5-coder-1.5b", progress=False)
    manifests = [TokenManifest.open(DATA + d, fingerprint=model.tokenizer.fingerprint())
                 for d in ("conversations", "text")]
    records = list(itertools.chain.from_iterable(m.records() for m in manifests))
    settings = E.EagleSettings(ttt_steps=args.k, draft_vocab=args.vocab, held_out=0.1)
    tr = E.EagleTrainer(model.decoder, records, model_name=model.name, settings=settings,
                        eos_ids=model.eos_token_ids, progress=False, log=print)
    print("train", len(tr.train), sum(len(r) for r in tr.train), "held out",
          len(tr.held_out), sum(len(r) for r in tr.held_out), flush=True)
    tr.prepare_features()
    if args.features_only:
        sys.exit(0)
    draft_ids = tr.choose_vocabulary()
    local = torch.full((tr.target_config.vocab_size,), -1, dtype=torch.long)
    local[draft_ids] = torch.arange(draft_ids.numel())
    train = [tr.features(r) for r in tr.train]
    held = [tr.features(r) for r in tr.held_out]
    rms = torch.cat([r.aux for r in train[:40]]).pow(2).mean(0).sqrt()
    print("aux RMS per block:", [round(float(rms[i * H:(i + 1) * H].mean()), 3)
                                 for i in range(3)], "largest channel", float(rms.max()))
    for name in args.variants.split(","):
        lr, batch, size, precondition, init, frozen = VARIANTS[name]
        torch.manual_seed(0)
        m = tr.new_model(draft_ids)
        if init == "noise":
            m.initialise(lm_head_rows=m.lm_head.weight.detach().clone(),
                         final_norm=m.norm.weight.detach().clone(), seed=0, carry=False)
        if frozen:
            m.lm_head.weight.requires_grad_(False)
        data, hdata = pieces(train, size), held
        if precondition:
            with torch.no_grad():
                m.fc.weight.copy_(torch.randn(m.fc.weight.shape,
                                              generator=torch.Generator().manual_seed(0))
                                  / math.sqrt(3 * H))
            inv = 1.0 / rms.clamp_min(1e-3)
            data, hdata = scaled(data, inv), scaled(held, inv)
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr,
                                betas=(0.9, 0.95), weight_decay=0.0)
        g = torch.Generator().manual_seed(1)
        order: list[int] = []
        start = last = time.perf_counter()
        step = tokens = 0
        while time.perf_counter() - start < args.seconds:
            if not order:
                order = torch.randperm(len(data), generator=g).tolist()
            group, size_now = [], 0
            while order and size_now < batch:
                group.append(data[order.pop()])
                size_now += len(group[-1])
            counts = [sum(int(E._rows(r, j, local, in_vocab=True).numel()) for r in group)
                      for j in range(args.k)]
            scales = [0.8 ** j / c if c else 0.0 for j, c in enumerate(counts)]
            for pg in opt.param_groups:
                pg["lr"] = lr * min(1.0, (step + 1) / 20)
            opt.zero_grad(set_to_none=True)
            loss = sum(E._record_backward(m, r, args.k, scales, local) for r in group)
            for p in m.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            opt.step()
            step, tokens = step + 1, tokens + size_now
            if time.perf_counter() - last > args.eval_every:
                last = time.perf_counter()
                met = E.evaluate(m, hdata, args.k, draft_ids, local)
                print(f"{name} t={last - start:.0f}s step={step} tok={tokens} "
                      f"loss={loss:.3f} heldout top1={[round(x, 3) for x in met.top1]} "
                      f"ce={[round(x, 2) for x in met.loss]} tpv={met.tokens_per_round:.3f}",
                      flush=True)


if __name__ == "__main__":
    main()
