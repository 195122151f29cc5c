"""Training data for a draft head made on a GPU machine in one run, and
(optionally) a head trained on it there: the prepared script of
``docs/training-data.md`` ("On a GPU machine").  Never needed by forerun,
its tests or CI.

    python3 training-data/gpu/make_corpus.py --gguf model.gguf --out OUT \\
        --generate-seconds 240 --train-seconds 150 [--sources sources.jsonl.xz]

1. The target GGUF is dequantized (forerun's reader) into bfloat16 on the
   GPU (``target_on_gpu.py``), with a KV cache of ``--slots`` sequences.
2. Conversations (``conversations.py``: Magpie queries under topics,
   requests about local documents, translations of local text into
   English, follow-up turns) are generated with continuous batching
   (``batcher.py``) for ``--generate-seconds``, and kept with
   ``forerun train data``'s filters in a token manifest (its format, the
   tokenizer's fingerprint of the GGUF) whose ``settings`` say how it was
   made.  It is packed as ``OUT/manifest.tar.xz``.
3. With ``--train-seconds``, an EAGLE-3 head is trained on the kept
   records and on those of every ``--train-also`` manifest (the committed
   ones, say: ``training-data/qwen2.5-coder-1.5b/*``), with
   ``train_on_gpu.py``, and saved to ``OUT/head`` in pieces of at most 15
   MiB (``head/model.safetensors.part*``; joined by ``cat``).  Its info
   holds the held-out metrics of each manifest's records apart.
   ``--generate-seconds 0`` trains on the ``--train-also`` manifests alone.

The answers are the dequantized weights' greedy answers computed in
bfloat16 on the GPU, not token-identical to what forerun's CPU engine
answers (q4 weights, int8 activations); they are the same model's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import platform
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent.parent)]

import torch  # noqa: E402
from batcher import Batcher  # noqa: E402
from conversations import TOPICS, Conversations, Settings  # noqa: E402
from target_on_gpu import Target  # noqa: E402

from forerun.bench.prompts import DEFAULT_PROMPTS, load_prompts  # noqa: E402
from forerun.corpus.token_manifest import ManifestWriter, TokenManifest  # noqa: E402
from forerun.loading.gguf_file import GGUFFile  # noqa: E402
from forerun.tokenizer.gguf_tokenizer import tokenizer_from_gguf_metadata  # noqa: E402
from forerun.training.magpie import BenchOverlap, magpie_prefix  # noqa: E402

PART_BYTES = 16_000_000


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_sources(path: str | None) -> list[dict]:
    if not path:
        return []
    with lzma.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def pack(folder: Path, dest: Path) -> None:
    with tarfile.open(dest, "w:xz", preset=6) as tar:
        tar.add(folder, arcname=folder.name)


def split(path: Path, into: Path) -> list[str]:
    into.mkdir(parents=True, exist_ok=True)
    names = []
    with open(path, "rb") as f:
        for i, block in enumerate(iter(lambda: f.read(PART_BYTES), b"")):
            name = f"{path.name}.part{i:02d}"
            (into / name).write_bytes(block)
            names.append(name)
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--gguf-sha256", default=None, help="refuse a GGUF with another digest")
    ap.add_argument("--model-name", default="qwen2.5-coder-1.5b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/forerun-gpu-corpus")
    ap.add_argument("--sources", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--slots", type=int, default=768)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--generate-seconds", type=float, required=True)
    ap.add_argument("--finish-seconds", type=float, default=30.0,
                    help="of --generate-seconds, the last ones admit no new item")
    ap.add_argument("--max-items", type=int, default=None)
    ap.add_argument("--train-seconds", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--piece-tokens", type=int, default=512)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--train-also", nargs="+", default=[], metavar="MANIFEST",
                    help="token manifests (forerun train data) whose records are trained "
                         "on too; refused if made for another tokenizer")
    ap.add_argument("--smoke", action="store_true",
                    help="a check of the machine: train on random token records too "
                         "(a random tiny model's answers rarely end)")
    args = ap.parse_args(argv)

    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    run_start = time.monotonic()
    digest = sha256(Path(args.gguf))
    if args.gguf_sha256 and digest != args.gguf_sha256:
        raise SystemExit(f"{args.gguf}: SHA-256 {digest}, expected {args.gguf_sha256}")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    device_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else platform.processor() or "cpu")
    log(f"{args.gguf} ({digest[:16]}) on {device_name}, torch {torch.__version__}")

    gguf = GGUFFile(args.gguf)
    tok = tokenizer_from_gguf_metadata(gguf.metadata)
    also = {Path(d).name: TokenManifest.open(d, fingerprint=tok.fingerprint())
            for d in args.train_also}          # refused here, before the long work
    t0 = time.monotonic()
    target = Target(args.gguf, device=args.device, dtype=dtype, slots=args.slots,
                    max_len=args.max_len)
    log(f"weights on the device in {time.monotonic() - t0:.1f} s")
    turns = [t for p in load_prompts(DEFAULT_PROMPTS) for t in p.turns]
    bench = BenchOverlap(turns)
    sources = read_sources(args.sources)
    s = Settings()
    manifest_dir = work / f"gpu-{args.model_name}-seed{args.seed}"
    settings = {
        "made_by": "training-data/gpu/make_corpus.py", "seed": args.seed,
        "device": device_name, "dtype": args.dtype, "torch": torch.__version__,
        "weights": f"dequantized from the GGUF (SHA-256 {digest})",
        "answers": "greedy, in the dtype above; not token-identical to forerun's CPU engine",
        **s.to_json(), "keep_cut_answers": True, "topics": [t for t in TOPICS if t],
        "topic_none": "one query in len(TOPICS) is written under the default system prompt",
        "sources": (f"{Path(args.sources).name}: {len(sources)} local texts"
                    if args.sources else None),
        "bench_digest": bench.digest, "exclude_prompts": [],
        "model_name": args.model_name, "magpie_prefix": magpie_prefix(tok).text,
        "slots": args.slots, "max_len": args.max_len,
    }
    writer = ManifestWriter.create(manifest_dir, model=args.model_name,
                                   fingerprint=tok.fingerprint(),
                                   vocab_size=target.config.vocab_size, settings=settings)
    batcher = Batcher(target, seed=args.seed)
    conv = Conversations(tok, batcher, writer, bench, s, sources,
                         max_in_flight=2 * args.slots)
    gen_start = time.monotonic()
    stop_admitting = gen_start + args.generate_seconds - args.finish_seconds
    last_flush, last_log = gen_start, gen_start

    def idle() -> bool:
        nonlocal last_flush, last_log
        now = time.monotonic()
        if now >= stop_admitting or (args.max_items and conv.next_item >= args.max_items):
            conv.admitting = False
        if now - last_flush > 30:
            writer.flush()
            last_flush = now
        if now - last_log > 20:
            rate = batcher.generated / (now - gen_start)
            log(f"{writer.tokens:,} tokens kept; generated {batcher.generated:,} "
                f"({rate:,.0f}/s), steps {batcher.steps}, busy {batcher.busy}, "
                f"queued {batcher.queued}, items {conv.next_item}")
            last_log = now
        return conv.top_up()

    stopped = batcher.run(gen_start + args.generate_seconds, idle=idle)
    gen_seconds = time.monotonic() - gen_start
    counters = {"items": conv.next_item, "counts": dict(conv.counts),
                "tokens": dict(conv.tokens), "generated_tokens": batcher.generated,
                "prefilled_tokens": batcher.prefilled, "steps": batcher.steps,
                "unfinished": batcher.busy + batcher.queued}
    writer.counters = counters
    writer.state = {"complete": True, "next_item": conv.next_item}
    writer.note_run({"stopped": stopped, "seconds": round(gen_seconds, 1),
                     "records": sum(c["records"] for c in writer.counts.values()),
                     "generated_tokens": batcher.generated,
                     "generated_per_second": round(batcher.generated / gen_seconds, 1)})
    writer.flush()
    log(f"generation {stopped} after {gen_seconds:.0f} s: {writer.tokens:,} tokens kept in "
        f"{writer.counts['conversation']['records']:,} records; "
        f"{batcher.generated / gen_seconds:,.0f} generated tokens/s")
    log(json.dumps(counters))
    pack(manifest_dir, out / "manifest.tar.xz")
    log(f"manifest packed: {(out / 'manifest.tar.xz').stat().st_size:,} bytes")
    target.k_cache = target.v_cache = None
    torch.cuda.empty_cache() if device.type == "cuda" else None

    if args.train_seconds > 0:
        from train_on_gpu import train_head

        from forerun.drafters.eagle.features import as_records
        from forerun.drafters.eagle.training import EagleSettings

        records = list(writer.records())
        sources = {manifest_dir.name: records}
        for name, manifest in also.items():
            sources[name] = list(manifest.records())
            records += sources[name]
        log(f"training on {len(records):,} records: " + ", ".join(
            f"{name} {sum(len(r) for r in rs):,} tokens" for name, rs in sources.items()))
        if args.smoke:
            import numpy as np

            from forerun.corpus.token_manifest import Record

            rng = np.random.default_rng(args.seed)
            records += [Record(rng.integers(0, target.config.vocab_size, 300), "text", 10)
                        for _ in range(64)]
        settings_e = EagleSettings(piece_tokens=args.piece_tokens,
                                   batch_tokens=args.batch_tokens, epochs=args.epochs,
                                   lr=args.lr, seed=args.seed)
        head = work / "head"
        eos = [t for t in (tok.eos_token_id, *magpie_prefix(tok).stop_token_ids)
               if t is not None]
        info = train_head(target, records, seconds=args.train_seconds, out=str(head),
                          settings=settings_e, model_name=args.model_name,
                          fingerprint=tok.fingerprint(), eos_ids=sorted(set(eos)),
                          info={"device": device_name, "data": list(sources)},
                          groups={name: {r.key for r in as_records(rs)}
                                  for name, rs in sources.items()},
                          log=log)
        (out / "head").mkdir(exist_ok=True)
        for f in head.iterdir():
            if f.stat().st_size > PART_BYTES:
                split(f, out / "head")
            else:
                (out / "head" / f.name).write_bytes(f.read_bytes())
        (out / "head-info.json").write_text(json.dumps(info, indent=1))
    log(f"done in {time.monotonic() - run_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
