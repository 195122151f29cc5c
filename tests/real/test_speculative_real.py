"""Speculative decoding on the real models is lossless: greedy output is
token-identical to plain greedy decoding."""

import pytest

pytestmark = pytest.mark.real_model

CHAT_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash table is in three sentences.",
    "Translate into German: The weather is nice today and we are going to the park.",
    "What is 17 * 23? Show your steps.",
    "Summarise: The city council met on Tuesday to discuss the new bike lanes. After two "
    "hours of debate, members voted 7 to 2 to approve the plan, which adds 12 km of "
    "protected lanes by next summer.",
]

REPEAT_PROMPTS = [
    # Long verbatim repeats: the answer copies the input.
    "Rename the variable `total` to `running_sum` in this code and return the whole code:\n"
    "def add_all(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total\n\ndef mean(values):\n    total = add_all(values)\n"
    "    return total / len(values)\n",
    "Repeat the following sentence exactly twice: the quick brown fox jumps over the lazy dog.",
    # No repeats to exploit.
    "Name a colour.",
]


def messages(text):
    return [{"role": "user", "content": text}]


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def assert_identical(model, prompt_ids, plain, other, label):
    if other.tokens == plain.tokens:
        return
    i = first_difference(plain.tokens, other.tokens)
    model.decoder.reset()
    logits = model.decoder.feed(prompt_ids + plain.tokens[:i]).logits[-1]
    top = logits.topk(2).values
    pytest.fail(f"{label}: first difference at token {i}; top-2 logit gap of plain decoding "
                f"there is {float(top[0] - top[1]):.2e}")


@pytest.fixture(scope="module")
def pair(preset_model):
    """The real pair in q4, the format users run (float32's own
    speculation is checked on the tiny models and by the format tests)."""
    return (preset_model("qwen2.5-coder-1.5b", weights="q4"),
            preset_model("qwen2.5-coder-0.5b", weights="q4"))


@pytest.mark.slow
def test_draft_model_greedy_is_lossless(pair):
    target, draft = pair
    for text in CHAT_PROMPTS[::2]:     # code, translation, a summary (CI time)
        ids = target.encode_prompt(messages=messages(text))
        plain = target.generate(prompt_ids=ids, max_new_tokens=64)
        for k in (2, 8, None):
            out = target.generate(prompt_ids=ids, max_new_tokens=64, draft=draft, draft_k=k)
            assert_identical(target, ids, plain, out, f"k={k} on {text[:30]!r}")
            assert out.finish_reason == plain.finish_reason
            stats = out.stats
            assert stats.accepted <= stats.drafted
            assert sum(stats.accepted_histogram.values()) <= stats.rounds


@pytest.mark.slow
def test_asynchronous_draft_model_greedy_is_lossless(pair):
    """The draft drafting in its own thread: plain decoding's tokens."""
    import threading

    target, draft = pair
    for text in CHAT_PROMPTS[:2]:
        ids = target.encode_prompt(messages=messages(text))
        plain = target.generate(prompt_ids=ids, max_new_tokens=32)
        for k in (3, None):
            out = target.generate(prompt_ids=ids, max_new_tokens=32, draft=draft, draft_k=k,
                                  draft_async=True)
            assert_identical(target, ids, plain, out, f"async k={k} on {text[:30]!r}")
            assert out.stats.asynchronous and out.stats.accepted <= out.stats.drafted
    assert not [t for t in threading.enumerate() if t.name == "forerun-drafter"]


@pytest.mark.slow
def test_draft_model_trees_greedy_are_lossless(pair):
    """The draft model drafting trees (EAGLE-2 style): plain decoding's
    tokens for several node budgets, and side branches really verified."""
    target, draft = pair
    for text in CHAT_PROMPTS[:2]:
        ids = target.encode_prompt(messages=messages(text))
        plain = target.generate(prompt_ids=ids, max_new_tokens=48)
        for nodes in (2, 8, None):
            out = target.generate(prompt_ids=ids, max_new_tokens=48, draft=draft,
                                  draft_tree=True, tree_nodes=nodes)
            assert_identical(target, ids, plain, out, f"tree nodes={nodes} on {text[:30]!r}")
            assert out.stats.accepted <= out.stats.drafted


@pytest.mark.slow
def test_draft_model_agrees_often_on_code(pair):
    """Not a speed claim: the pair really is a draft/target pair."""
    target, draft = pair
    out = target.generate(messages=messages(CHAT_PROMPTS[0]), max_new_tokens=64, draft=draft,
                          draft_k=4)
    assert out.stats.acceptance_rate > 0.5


@pytest.mark.parametrize("preset", ["smollm2-135m", "gemma3-270m",
                                    pytest.param("qwen2.5-coder-1.5b", marks=pytest.mark.slow)])
def test_ngram_greedy_is_lossless(preset_model, preset):
    model = preset_model(preset, weights="q4")
    for text in REPEAT_PROMPTS:
        ids = model.encode_prompt(messages=messages(text))
        plain = model.generate(prompt_ids=ids, max_new_tokens=64)
        for k in (3, None):
            out = model.generate(prompt_ids=ids, max_new_tokens=64, draft="ngram", draft_k=k)
            assert_identical(model, ids, plain, out, f"ngram k={k} on {text[:30]!r}")
            if text == REPEAT_PROMPTS[0] and k == 3:
                # The verbatim-repeat prompt does get its drafts accepted.
                assert out.stats.accepted > 0


@pytest.mark.parametrize("preset", ["smollm2-135m",
                                    pytest.param("qwen2.5-coder-1.5b", marks=pytest.mark.slow)])
def test_suffix_drafting_is_plain_decoding_greedy_and_seeded(preset_model, preset):
    """Greedy, and sampled with a seed (drafts of fixed tokens draw each
    token as plain decoding does): plain decoding's tokens, also when the
    store holds the same request's earlier answer, which it then drafts."""
    model = preset_model(preset, weights="q4")
    model.suffix_store().clear()
    for text in REPEAT_PROMPTS:
        ids = model.encode_prompt(messages=messages(text))
        plain = model.generate(prompt_ids=ids, max_new_tokens=64)
        sampled = model.generate(prompt_ids=ids, max_new_tokens=64, temperature=0.8, seed=3)
        for ask in ("first", "again"):
            out = model.generate(prompt_ids=ids, max_new_tokens=64, draft="suffix")
            assert_identical(model, ids, plain, out, f"suffix, {ask} ask, on {text[:30]!r}")
            if ask == "again":      # its first answer drafted
                assert out.stats.drafted >= 0.6 * (len(out.tokens) - 1)
                assert out.stats.accepted >= 0.8 * out.stats.drafted
        for ask in ("first", "again"):
            out = model.generate(prompt_ids=ids, max_new_tokens=64, draft="suffix",
                                 temperature=0.8, seed=3)
            assert out.tokens == sampled.tokens, f"suffix sampled, {ask} ask, on {text[:30]!r}"
    model.suffix_store().clear()
