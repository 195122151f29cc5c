"""How a new EAGLE-3 head's held-out agreement grows with its training
tokens, per source of data (issue 58's learning curve): so that the next
round of data can be sized and its source chosen.

    python benchmarks/experiments/eagle_learning_curve.py \\
        --source gpu-h200 --source documents --source gpu-h200+documents \\
        --tokens 40000 --at 10000,20000 --eval gpu-h200 --eval documents \\
        [--setting 512/512/1e-3[/SEED] ...] [--out curve.jsonl]

Each ``--source`` names manifests under ``training-data/qwen2.5-coder-1.5b/``
(``a+b``: their training records mixed by tokens, half of each).  A head is
trained from the target's own state (``forerun train eagle``'s start, its
defaults: features, a draft vocabulary chosen from that source's data,
pieces, batches, loss) on the source's first ``--tokens`` tokens of
training records (the manifests' own split: their held-out records are
never trained on), in one pass at a constant learning rate after the
warm-up, so that a point of the curve does not depend on where a schedule
would have ended.  Every token is seen once, so each point is a head
trained on that many tokens: a nested-subset curve from a single run per
source.  At 0, at each ``--at`` count and at the end the head is scored
on the held-out split of each ``--eval`` manifest: top-1 agreement with
the target per chain step and the simulated tokens per verification.
Each ``--setting PIECE/BATCH/LR[/SEED]`` trains every source again with those
piece tokens, tokens a step and learning rate (how much a head learns per
token with longer pieces, which train faster); "train_seconds" is the
time in training steps alone.
Features come from the trainer's cache (computed if missing).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator, Sequence

import torch

from forerun.api import load
from forerun.corpus.token_manifest import Record, TokenManifest
from forerun.drafters.eagle import training as E
from forerun.drafters.eagle.features import as_records

DATA = "training-data/qwen2.5-coder-1.5b/"


def interleaved(streams: Sequence[Iterator[Record]]) -> Iterator[Record]:
    """The streams' records mixed by tokens: the next record comes from the
    stream that has given the fewest tokens so far (the first on a tie),
    until every one is used up."""
    given = [0] * len(streams)
    heads: list[Record | None] = [next(s, None) for s in streams]
    while any(h is not None for h in heads):
        i = min((n for n, h in enumerate(heads) if h is not None), key=lambda n: given[n])
        record = heads[i]
        assert record is not None
        yield record
        given[i] += len(record)
        heads[i] = next(streams[i], None)


def first_tokens(records: Iterator[Record], budget: int) -> list[Record]:
    out, tokens = [], 0
    for r in records:
        if tokens >= budget:
            break
        out.append(r)
        tokens += len(r)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", action="append", required=True,
                    help="manifest name(s) under training-data/qwen2.5-coder-1.5b, "
                         "'+'-joined to mix their records by tokens (repeatable)")
    ap.add_argument("--tokens", type=int, default=40000, help="training tokens per source")
    ap.add_argument("--at", default="10000,20000",
                    help="trained-token counts at which to score the head")
    ap.add_argument("--eval", action="append", required=True,
                    help="a manifest whose held-out split scores the heads (repeatable)")
    ap.add_argument("--out", default=None, help="also write each point as a JSON line here")
    ap.add_argument("--setting", action="append", default=None,
                    metavar="PIECE/BATCH/LR[/SEED]",
                    help="train each source once per setting: piece tokens, tokens a step, "
                         "learning rate and optionally the seed, e.g. 512/512/1e-3/1 "
                         "(repeatable; default the trainer's defaults)")
    args = ap.parse_args()
    settings = [parse_setting(x) for x in args.setting or ()] or [E.EagleSettings()]
    torch.set_num_threads(2)
    marks = sorted(int(x) for x in args.at.split(","))
    model = load("qwen2.5-coder-1.5b", progress=False)
    fp = model.tokenizer.fingerprint()
    manifests = {name: TokenManifest.open(DATA + name, fingerprint=fp)
                 for name in {n for s in args.source for n in s.split("+")} | set(args.eval)}
    evals = {name: as_records(manifests[name].records(split="held_out")) for name in args.eval}
    sink = open(args.out, "a") if args.out else None
    for source in args.source:
        streams = [manifests[n].records(split="train") for n in source.split("+")]
        records = first_tokens(interleaved(streams), args.tokens)
        for settings_ in settings:
            curve(model, source, records, evals, marks, sink, settings_)


def parse_setting(text: str) -> E.EagleSettings:
    """``PIECE/BATCH/LR[/SEED]`` as the trainer's settings (the rest its
    defaults)."""
    try:
        piece, batch, lr, *seed = text.split("/")
        if len(seed) > 1:
            raise ValueError(text)
        s = E.EagleSettings(piece_tokens=int(piece), batch_tokens=int(batch), lr=float(lr),
                            seed=int(seed[0]) if seed else E.EagleSettings.seed)
    except ValueError:
        raise SystemExit(f"--setting {text!r}: expected PIECE/BATCH/LR[/SEED], "
                         "e.g. 512/512/1e-3/1") from None
    s.validate()
    return s


def curve(model, source: str, records: list[Record], evals: dict[str, list], marks: list[int],
          sink, s: E.EagleSettings) -> None:
    """Train a new head with settings ``s`` on ``records`` in one pass,
    scoring it on each of ``evals`` at 0, at each of ``marks`` trained
    tokens and at the end."""
    tr = E.EagleTrainer(model.decoder, records, model_name=model.name, settings=s,
                        eos_ids=model.eos_token_ids, progress=False, log=print)
    tr.prepare_features()
    for held in evals.values():
        tr.store.prepare(held, progress=False)
    draft_ids = tr.choose_vocabulary()
    local = torch.full((tr.target_config.vocab_size,), -1, dtype=torch.long)
    local[draft_ids] = torch.arange(draft_ids.numel())
    torch.manual_seed(s.seed)
    head = tr.new_model(draft_ids)
    opt = E.make_optimizer(head, s)
    pieces = E.record_pieces(tr.train, s.piece_tokens)
    batches = E.epoch_batches(pieces, 0, s)
    warmup = max(1, int(s.warmup * len(batches)))

    def score(step: int, tokens: int, seconds: float) -> None:
        row = {"source": source, "piece_tokens": s.piece_tokens,
               "batch_tokens": s.batch_tokens, "lr": s.lr, "seed": s.seed,
               "trained_tokens": tokens, "step": step,
               "train_seconds": round(seconds, 1)}
        for name, held in evals.items():
            m = E.evaluate(head, (tr.features(r) for r in held), s.ttt_steps, draft_ids,
                           local)
            row[name] = m.to_json()
        print(json.dumps(row), flush=True)
        if sink is not None:
            sink.write(json.dumps(row) + "\n")
            sink.flush()

    print(json.dumps({"source": source, **tr.data_counts(),
                      "eval": {n: sum(len(r) for r in h) for n, h in evals.items()}}),
          flush=True)
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
