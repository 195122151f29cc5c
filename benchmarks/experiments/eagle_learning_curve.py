"""How a new EAGLE-3 head's held-out acceptance grows with its training
tokens (issue 39's learning curve), so that the next round of data can be
sized.

    python benchmarks/experiments/eagle_learning_curve.py \\
        [--at 6000,12500,25000,50000] [--out curve.jsonl]

One pass over the committed training data
(``training-data/qwen2.5-coder-1.5b/*``) with ``forerun train eagle``'s
own trainer and defaults (its features, draft vocabulary, pieces, batches
and loss), but a constant learning rate after the warm-up, so that a point
of the curve does not depend on where a schedule would have ended.  The
head is scored on one fixed held-out set (the manifest records
``is_held_out`` puts in a 10% split) before training, at each ``--at``
count of trained tokens and at the end.  Every token is seen once, so each
point is a head trained on that many tokens: a nested-subset curve from a
single run.  Features come from the trainer's cache (computed if missing).
Result: ``benchmarks/results/2026-11-27-eagle-learning-curve.md``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from forerun.api import load
from forerun.corpus.token_manifest import TokenManifest
from forerun.training import eagle as E

DATA = "training-data/qwen2.5-coder-1.5b/"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--at", default="6000,12500,25000,50000",
                    help="trained-token counts at which to score the head")
    ap.add_argument("--held-out", type=float, default=0.1)
    ap.add_argument("--out", default=None, help="also write each point as a JSON line here")
    args = ap.parse_args()
    torch.set_num_threads(2)
    marks = sorted(int(x) for x in args.at.split(","))
    model = load("qwen2.5-coder-1.5b", progress=False)
    fp = model.tokenizer.fingerprint()
    manifests = [TokenManifest.open(DATA + d, fingerprint=fp)
                 for d in ("conversations", "text", "topics")]
    records = list(itertools.chain.from_iterable(m.records() for m in manifests))
    s = E.EagleSettings(held_out=args.held_out)
    tr = E.EagleTrainer(model.decoder, records, model_name=model.name, settings=s,
                        eos_ids=model.eos_token_ids, progress=False, log=print)
    print(json.dumps(tr.data_counts()), flush=True)
    tr.prepare_features()
    draft_ids = tr.choose_vocabulary()
    local = torch.full((tr.target_config.vocab_size,), -1, dtype=torch.long)
    local[draft_ids] = torch.arange(draft_ids.numel())
    torch.manual_seed(s.seed)
    head = tr.new_model(draft_ids)
    opt = torch.optim.AdamW(head.parameters(), lr=s.lr, betas=s.betas,
                            weight_decay=s.weight_decay)
    pieces = E.record_pieces(tr.train, s.piece_tokens)
    batches = E.epoch_batches(pieces, 0, s)
    warmup = max(1, int(s.warmup * len(batches)))
    sink = open(args.out, "a") if args.out else None

    def score(step: int, tokens: int, seconds: float) -> None:
        t0 = time.perf_counter()
        m = E.evaluate(head, (tr.features(r) for r in tr.held_out), s.ttt_steps,
                       draft_ids, local)
        row = {"trained_tokens": tokens, "step": step, "train_seconds": round(seconds, 1),
               "eval_seconds": round(time.perf_counter() - t0, 1), **m.to_json()}
        print(json.dumps(row), flush=True)
        if sink is not None:
            sink.write(json.dumps(row) + "\n")
            sink.flush()

    score(0, 0, 0.0)
    tokens, seconds = 0, 0.0
    for step, batch in enumerate(batches):
        t0 = time.perf_counter()
        lr = s.lr * min(1.0, (step + 1) / warmup)
        tr._step(head, opt, [pieces[i] for i in batch], local, lr)
        seconds += time.perf_counter() - t0
        before, tokens = tokens, tokens + sum(len(pieces[i]) for i in batch)
        if any(before < mark <= tokens for mark in marks):
            score(step + 1, tokens, seconds)
    score(len(batches), tokens, seconds)


if __name__ == "__main__":
    main()
