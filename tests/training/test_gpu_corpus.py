"""The GPU machine's data script (training-data/gpu), run here on the CPU in
float32 on a tiny random Qwen2 GGUF: its batched forward gives forerun's own
engine's greedy tokens with sequences joining and leaving the slots, its
features are forerun's, and a whole run (generation, manifest, a head
trained on it) makes files forerun reads."""

from __future__ import annotations

import json
import lzma
import sys
import tarfile
from pathlib import Path

import pytest
import torch

GPU = Path(__file__).resolve().parents[2] / "training-data" / "gpu"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_gguf import write_tiny_gguf

    # 8 layers: the default aux layers (2, 4, 5) are distinct
    return write_tiny_gguf(tmp_path_factory.mktemp("gpu") / "tiny.gguf", num_layers=8,
                           pad_vocab=True)


@pytest.fixture(scope="module")
def gpu_modules():
    sys.path.insert(0, str(GPU))
    try:
        import batcher
        import target_on_gpu

        yield target_on_gpu, batcher
    finally:
        sys.path.remove(str(GPU))


def _forerun(path):
    import forerun

    return forerun.load(str(path), context_length=256, progress=False, weights="float32")


def test_batched_greedy_tokens_are_forerun_engine_tokens(tiny, gpu_modules):
    """Five prompts of different lengths through 2 slots (three wait and
    join as others leave; one slot idles at the end): each gets the tokens
    forerun's engine gives it alone."""
    target_on_gpu, batcher = gpu_modules
    model = _forerun(tiny)
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.decoder.vocab_size, (n,), generator=rng).tolist()
               for n in (3, 17, 8, 30, 1)]
    budgets = [12, 5, 20, 9, 14]
    want = [model.generate(prompt_ids=p, max_new_tokens=n, ignore_eos=True).tokens
            for p, n in zip(prompts, budgets)]
    target = target_on_gpu.Target(str(tiny), device="cpu", dtype=torch.float32, slots=2,
                                  max_len=64)
    b = batcher.Batcher(target, seed=0)
    got: dict[int, list[int]] = {}
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        assert b.submit(batcher.Job(p, n, done=lambda j, t, r, i=i: got.__setitem__(i, t)))
    assert b.run(float("inf")) == "done"
    assert [got[i] for i in range(5)] == want
    assert b.steps < sum(budgets)      # several sequences per step
    # a job whose prompt and budget exceed a slot is refused, not cut
    assert not b.submit(batcher.Job(list(range(60)), 5))


def test_features_are_forerun_states_and_teacher(tiny, gpu_modules):
    target_on_gpu, _ = gpu_modules
    model = _forerun(tiny)
    ids = torch.randint(0, model.decoder.vocab_size, (40,),
                        generator=torch.Generator().manual_seed(1)).tolist()
    model.decoder.reset()
    out = model.decoder.feed(ids, hidden_layers=(2, 4, 5))
    target = target_on_gpu.Target(str(tiny), device="cpu", dtype=torch.float32)
    short = ids[:25]
    (aux, top_ids, top_logp), (aux2, _, _) = target.features([ids, short], (2, 4, 5), 3)
    assert aux.shape == (40, 3 * model.decoder.model.config.hidden_size)
    assert torch.allclose(aux, out.layers.float(), atol=1e-4)
    assert torch.allclose(aux2, aux[:25], atol=1e-4)      # padding beside it changes nothing
    assert top_ids[:, 0].tolist() == out.logits.argmax(-1).tolist()
    assert torch.allclose(top_logp[:, 0], torch.log_softmax(out.logits, -1).max(-1).values,
                          atol=1e-4)


def test_a_whole_run_makes_a_manifest_and_a_head_forerun_reads(tiny, tmp_path, gpu_modules):
    sys.path.insert(0, str(GPU))
    import make_corpus

    from forerun.corpus.token_manifest import (
        ManifestError,
        ManifestWriter,
        Record,
        TokenManifest,
        is_held_out,
    )
    from forerun.drafters.eagle.files import load_eagle3
    from forerun.loading.gguf_file import GGUFFile
    from forerun.tokenizer.gguf_tokenizer import tokenizer_from_gguf_metadata

    fingerprint = tokenizer_from_gguf_metadata(GGUFFile(tiny).metadata).fingerprint()
    # a manifest trained on too (--train-also): random documents, two held out
    writer = ManifestWriter.create(tmp_path / "also", model="tiny", fingerprint=fingerprint,
                                   vocab_size=256, settings={})
    rng, held = torch.Generator().manual_seed(3), 0
    while held < 2:
        record = Record(torch.randint(0, 256, (80,), generator=rng).numpy(), "document", 5)
        writer.add(record)
        held += is_held_out(record.digest)
    writer.flush()
    foreign = ManifestWriter.create(tmp_path / "foreign", model="other", fingerprint="f" * 16,
                                    vocab_size=256, settings={})
    foreign.flush()
    out = tmp_path / "out"
    with pytest.raises(ManifestError, match="another tokenizer"):
        make_corpus.main(["--gguf", str(tiny), "--out", str(out), "--generate-seconds", "1",
                          "--device", "cpu", "--train-also", str(tmp_path / "foreign")])
    sources = tmp_path / "sources.jsonl.xz"
    with lzma.open(sources, "wt", encoding="utf-8") as f:
        for i in range(40):
            f.write(json.dumps({"kind": "document", "lang": "English", "source": f"doc{i}",
                                "text": f"Document {i} explains how the tool reads its "
                                        f"configuration file and writes a report."}) + "\n")
    assert make_corpus.main([
        "--gguf", str(tiny), "--model-name", "tiny", "--out", str(out),
        "--sources", str(sources),
        "--work", str(tmp_path / "work"), "--device", "cpu", "--dtype", "float32",
        "--slots", "8", "--max-len", "512", "--generate-seconds", "3",
        "--finish-seconds", "1", "--train-seconds", "8", "--smoke", "--epochs", "1",
        "--piece-tokens", "64", "--batch-tokens", "128",
        "--train-also", str(tmp_path / "also")]) == 0
    with tarfile.open(out / "manifest.tar.xz") as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    folder = next((tmp_path / "unpacked").iterdir())
    manifest = TokenManifest.open(folder, fingerprint=fingerprint)
    assert manifest.settings["made_by"] == "training-data/gpu/make_corpus.py"
    assert manifest.data["runs"][0]["generated_tokens"] > 0
    # a random model's requests never end: each document is asked plainly instead
    assert manifest.data["counters"]["counts"]["request_asked_instead"] > 0
    head = load_eagle3(out / "head", target_layers=8)
    assert head.config.aux_layers == (2, 4, 5)
    assert head.info["training"]["steps"] >= 1
    assert head.info["training"]["data"] == [folder.name, "also"]
    by_source = head.info["held_out"]["by_source"]
    assert by_source["also"]["records"] == 2
    assert head.info["data"]["train_tokens"] + head.info["data"]["held_out_tokens"] >= \
        writer.tokens + sum(c["tokens"] for c in manifest.counts.values())
