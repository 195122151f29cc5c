"""Batches on the real presets: every answer of ``Model.generate_batch`` is
the answer ``generate`` gives that request alone, token for token, greedy
and sampled with a seed, plain, with prompt lookup and with suffix drafting
(sampled: its drafts come from the answers before), with requests of
different lengths joining and leaving the batch."""

import pytest

pytestmark = pytest.mark.real_model

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash table is in three sentences.",
    "Translate into German: The weather is nice today.",
    "What is 17 * 23?",
    "Repeat exactly: the quick brown fox jumps over the lazy dog.",
    "Name a colour.",
]


def _requests(sampled: bool) -> list[dict]:
    requests = []
    for n, text in enumerate(PROMPTS):
        r = {"messages": [{"role": "user", "content": text}], "max_new_tokens": 6 + 5 * n}
        if sampled:
            r.update(temperature=0.8, top_p=0.95, seed=40 + n)
        requests.append(r)
    return requests


def _check(model, draft, sampled, parallel):
    requests = _requests(sampled)
    alone = [model.generate(draft=draft, **r).tokens for r in requests]
    batch = model.generate_batch(requests, draft=draft, parallel=parallel)
    assert [r.tokens for r in batch] == alone


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
@pytest.mark.parametrize("draft, sampled", [(None, False), ("ngram", False), (None, True),
                                           ("suffix", True)])
def test_a_batch_answers_each_request_as_alone(preset_model, name, draft, sampled):
    _check(preset_model(name, weights="q4"), draft, sampled, parallel=4)


@pytest.mark.slow
@pytest.mark.parametrize("draft, sampled", [("ngram", False), (None, True)])
def test_a_batch_of_the_1_5b_answers_each_request_as_alone(preset_model, draft, sampled):
    _check(preset_model("qwen2.5-coder-1.5b", weights="q4"), draft, sampled, parallel=6)
