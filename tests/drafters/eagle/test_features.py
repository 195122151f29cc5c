"""The teacher features an EAGLE-3 head trains on: the target's states at
the aux layers as a prefill computes them, its top-k over the whole
vocabulary, cached per record, recomputed (with a warning) when a cache
file is damaged; the draft vocabulary cut from the target's argmax."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from forerun.corpus.token_manifest import Record
from forerun.decoding.prefill import prefill
from forerun.drafters.eagle.features import (
    FeatureStore,
    TokenRecord,
    as_records,
    draft_vocabulary,
)
from forerun.errors import ConfigError
from tiny_models import VOCAB, forerun_decoder, hf_model

AUX = (0, 1, 2)


@pytest.fixture(scope="module")
def decoder():
    return forerun_decoder(hf_model("qwen2", seed=3), context_length=512)


def record(n=300, seed=0, loss_start=0) -> TokenRecord:
    g = torch.Generator().manual_seed(seed)
    return TokenRecord(torch.randint(0, VOCAB, (n,), generator=g).numpy(), loss_start)


def test_features_are_the_targets_states_and_predictions(decoder, tmp_path):
    store = FeatureStore(decoder, "tiny", AUX, root=tmp_path)
    r = record(300)                       # three prefill blocks, the last partial
    f = store.compute(r)
    h = decoder.model.config.hidden_size
    assert f.aux.shape == (300, 3 * h) and f.aux.dtype == torch.bfloat16
    assert f.top_ids.shape == (300, 10) and f.top_ids.dtype == torch.int32
    assert f.top_logp.dtype == torch.float16
    want = prefill(decoder, r.tokens.tolist(), hidden_layers=AUX).layers
    decoder.reset()
    assert torch.equal(f.aux, want.to(torch.bfloat16))
    # the whole vocabulary's distribution at every position
    logp = torch.log_softmax(decoder.feed(r.tokens.tolist()).logits.float(), dim=-1)
    decoder.reset()
    top = torch.topk(logp, 10, dim=-1)
    assert (f.top_ids[:, 0].long() == top.indices[:, 0]).float().mean() > 0.99
    assert (f.top_logp.float() - top.values).abs().max() < 1e-2
    assert decoder.length == 0


def test_the_cache_is_read_not_recomputed(decoder, tmp_path, monkeypatch):
    records = [record(40, seed=i) for i in range(3)]
    store = FeatureStore(decoder, "tiny", AUX, root=tmp_path)
    report = store.prepare(records, progress=False)
    assert report.computed_tokens == 120 and report.cached_tokens == 0
    first = [store.load(r) for r in records]
    again = FeatureStore(decoder, "tiny", AUX, root=tmp_path)
    monkeypatch.setattr(again, "compute", lambda r: pytest.fail("features recomputed"))
    assert again.prepare(records, progress=False).computed_tokens == 0
    for r, f in zip(records, first):
        g = again.load(r)
        assert all(torch.equal(a, b) for a, b in zip(f.tensors().values(),
                                                     g.tensors().values()))
    assert torch.equal(again.argmax(records[0]), first[0].top_ids[:, 0].long())


def _truncate(path, other):
    path.write_bytes(path.read_bytes()[:-100])


def _flip(path, other):
    data = bytearray(path.read_bytes())
    data[-5000] ^= 0x40                  # inside the tensors' data
    path.write_bytes(bytes(data))


def _swap(path, other):
    shutil.copy(other, path)             # another record's (valid) file


@pytest.mark.parametrize("damage", [_truncate, _flip, _swap])
def test_a_damaged_cache_file_is_recomputed_with_a_warning(decoder, tmp_path, damage):
    records = [record(60, seed=1), record(60, seed=2)]
    store = FeatureStore(decoder, "tiny", AUX, root=tmp_path)
    store.prepare(records, progress=False)
    good = store.load(records[0])
    damage(store.path(records[0]), store.path(records[1]))
    fresh = FeatureStore(decoder, "tiny", AUX, root=tmp_path)   # verifies on first read
    with pytest.warns(UserWarning, match="damaged"):
        again = fresh.load(records[0])
    assert all(torch.equal(a, b) for a, b in zip(good.tensors().values(),
                                                 again.tensors().values()))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FeatureStore(decoder, "tiny", AUX, root=tmp_path).load(records[0])


def test_the_cache_is_keyed_by_target_and_aux_layers(decoder, tmp_path, monkeypatch):
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path))
    a = FeatureStore(decoder, "tiny", AUX)
    assert a.root.is_relative_to(tmp_path / "eagle-features")
    assert FeatureStore(decoder, "tiny", (0, 1, 2)).root == a.root
    assert FeatureStore(decoder, "tiny", (1, 0, 2)).root != a.root
    assert FeatureStore(decoder, "other", AUX).root != a.root
    other = forerun_decoder(hf_model("qwen2", seed=4))
    assert FeatureStore(other, "tiny", AUX).root != a.root


def test_a_record_longer_than_the_context_is_refused(tmp_path):
    small = forerun_decoder(hf_model("qwen2", seed=3), context_length=32)
    with pytest.raises(ConfigError, match="context-length"):
        FeatureStore(small, "tiny", AUX, root=tmp_path).compute(record(40))


def test_records_from_a_manifest_pairs_or_lists():
    tokens = np.array([5, 6, 7, 8], dtype=np.int32)
    manifest_record = Record(tokens, "conversation", 2)
    got = as_records([manifest_record, ([5, 6, 7, 8], 2), [5, 6, 7, 8]])
    assert [r.loss_start for r in got] == [2, 2, 0]
    assert {r.digest for r in got} == {manifest_record.digest}
    with pytest.raises(ConfigError):
        TokenRecord(tokens, 4)


def test_the_draft_vocabulary_is_the_most_frequent_argmax_with_eos():
    counts = np.array([0, 5, 3, 3, 9, 0, 1, 0])
    assert draft_vocabulary(counts, 3).tolist() == [1, 2, 4]         # 2 before 3: by id
    assert draft_vocabulary(counts, 3, eos_ids=[7]).tolist() == [1, 4, 7]
    assert draft_vocabulary(counts, 5, eos_ids=[7]).tolist() == [1, 2, 3, 4, 7]
    assert draft_vocabulary(counts, 100).tolist() == list(range(8))  # clamped
    with pytest.raises(ConfigError):
        draft_vocabulary(counts, 1, eos_ids=[7])


def test_a_stop_between_records_keeps_the_features_made(decoder, tmp_path):
    import threading

    from forerun.drafters.eagle.features import FeaturesStopped

    records = [record(30, seed=i) for i in range(3)]
    store = FeatureStore(decoder, "tiny", AUX, root=tmp_path)
    stop = threading.Event()
    compute = store.compute

    def once(r):
        stop.set()
        return compute(r)

    store.compute = once
    with pytest.raises(FeaturesStopped, match="after 1 of 3"):
        store.prepare(records, progress=False, stop=stop)
    store.compute = compute
    report = store.prepare(records, progress=False)
    assert (report.cached_tokens, report.computed_tokens) == (30, 60)
