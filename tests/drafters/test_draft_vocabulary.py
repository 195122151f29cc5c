"""A draft vocabulary cut to the most frequent tokens: the ids it holds,
their map back to target ids (EAGLE-3's d2t and t2d), the order file, and
a cut-head draft that stays lossless."""

from __future__ import annotations

import pytest
import torch

from forerun.drafters.draft_vocabulary import (
    DraftVocabulary,
    read_order,
    vocabulary_from_order,
    write_order,
)
from forerun.errors import ConfigError, ModelFormatError


def test_the_most_frequent_ids_and_the_ones_it_must_hold():
    order = [7, 3, 9, 1, 5, 2]
    v = vocabulary_from_order(order, 3, target_size=10, always=[8])
    # 8 always, then the two most frequent: sorted, so index i is ids[i].
    assert v.ids.tolist() == [3, 7, 8] and v.size == 3
    # An id the target lacks is skipped, not counted.
    assert vocabulary_from_order([12, 4, 6], 2, target_size=10).ids.tolist() == [4, 6]


def test_draft_indices_map_back_to_target_ids():
    v = vocabulary_from_order([40, 2, 17, 33, 5], 5, target_size=50)
    index = torch.arange(v.size)
    # EAGLE-3's offsets: target id = draft index + d2t[index].
    assert torch.equal(index + v.d2t, v.ids)
    assert (index + v.d2t).tolist() == [2, 5, 17, 33, 40]
    mask = v.t2d()
    assert mask.shape == (50,) and mask.sum() == 5 and mask[v.ids].all()
    # A draft distribution over the cut vocabulary scattered to target ids.
    probs = torch.softmax(torch.randn(v.size), dim=0)
    full = torch.zeros(50).index_copy(0, v.ids, probs)
    assert torch.equal(full[v.ids], probs) and full[~mask].sum() == 0


@pytest.mark.parametrize("ids, words", [
    (torch.tensor([], dtype=torch.long), "non-empty"),
    (torch.tensor([3, 3]), "sorted and distinct"),
    (torch.tensor([5, 2]), "sorted and distinct"),
    (torch.tensor([1, 10]), "outside the target's vocabulary"),
    (torch.tensor([1.0, 2.0]), "int64"),
])
def test_a_bad_vocabulary_is_refused(ids, words):
    with pytest.raises(ConfigError, match=words):
        DraftVocabulary(ids, target_size=10)


def test_an_order_file_round_trips_and_a_damaged_one_is_refused(tmp_path):
    path = tmp_path / "order.safetensors"
    write_order(path, [5, 1, 9], {"counted_on": "test"})
    order, meta = read_order(path)
    assert order == [5, 1, 9] and meta["counted_on"] == "test"
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(ModelFormatError, match="not a draft vocabulary order file"):
        read_order(path)


def test_a_draft_with_a_cut_head_is_lossless():
    """A draft whose decoder computes only its vocabulary's logits (the
    torch engine's restrict_output) proposes only those ids, and the output
    is still plain decoding's."""
    from forerun.decoding.plain import PlainDecoding
    from forerun.decoding.speculative import SpeculativeDecoding
    from forerun.decoding.stats import GenerationStats
    from forerun.drafters.draft_model import DraftModelDrafter
    from method_runs import greedy_tokens
    from tiny_models import VOCAB, forerun_decoder, hf_model

    target = hf_model("qwen2", seed=1)
    draft = forerun_decoder(target)
    order = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2)).tolist()
    vocabulary = vocabulary_from_order(order, 150, VOCAB)
    draft.restrict_output(vocabulary.ids)
    prompt = [5, 17, 42, 7, 99, 3]
    plain = greedy_tokens(PlainDecoding(forerun_decoder(target)), prompt, 24)
    stats = GenerationStats()
    method = SpeculativeDecoding(forerun_decoder(target), DraftModelDrafter(draft), k=3)
    assert greedy_tokens(method, prompt, 24, stats) == plain
    # The draft is the target itself, cut: right exactly where the target's
    # token is one of its ids.
    inside = sum(t in set(vocabulary.ids.tolist()) for t in plain)
    assert 0 < stats.accepted and (inside < len(plain)) == (stats.accepted < stats.drafted)
