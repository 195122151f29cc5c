"""Medusa on the real 1.5B preset with the heads forerun ships: greedy output
is token-identical to plain greedy decoding, and the heads do draft."""

import pytest

from forerun.drafters.medusa.heads import MedusaHeads, shipped_heads_path

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python class for a stack with push, pop and peek.",
    "Explain what a hash table is in three sentences.",
    "What is 17 * 23? Show your steps.",
    "Write a function that merges two sorted lists in Python.",
    "Translate into German: The weather is nice today.",
]


def messages(text):
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def model(preset_model):
    # q4: the format users run, which verifies a tree in exact groups.
    return preset_model("qwen2.5-coder-1.5b", weights="q4")


def test_shipped_heads_fit_the_preset(model):
    path = shipped_heads_path("qwen2.5-coder-1.5b")
    assert path is not None, "forerun/data/medusa/qwen2.5-coder-1.5b.safetensors is missing"
    heads = MedusaHeads.load(path)
    heads.check_base(model.config.hidden_size, model.config.vocab_size, model.name)
    assert heads.lm_heads is None                    # the model's LM head is not stored again
    assert path.stat().st_size < 32e6
    assert len(heads.info["accuracy"]["top1"]) == heads.num_heads


def test_medusa_greedy_is_lossless(model):
    drafted = accepted = 0
    for text in PROMPTS[::2]:     # two code prompts and an explanation (CI time)
        ids = model.encode_prompt(messages=messages(text))
        plain = model.generate(prompt_ids=ids, max_new_tokens=48)
        out = model.generate(prompt_ids=ids, max_new_tokens=48, draft="medusa")
        if out.tokens != plain.tokens:
            i = next((j for j, (a, b) in enumerate(zip(plain.tokens, out.tokens)) if a != b),
                     min(len(plain.tokens), len(out.tokens)))
            model.decoder.reset()
            logits = model.decoder.feed(ids + plain.tokens[:i]).logits[-1]
            top = logits.topk(2).values
            pytest.fail(f"{text[:30]!r}: first difference at token {i}; top-2 logit gap of "
                        f"plain decoding there is {float(top[0] - top[1]):.2e}")
        assert out.finish_reason == plain.finish_reason
        assert out.stats.accepted <= out.stats.drafted
        drafted += out.stats.drafted
        accepted += out.stats.accepted
    assert drafted > 0 and accepted > 0, "the shipped heads never drafted or never hit"


def test_medusa_fixed_tree_greedy_is_lossless(model):
    ids = model.encode_prompt(messages=messages(PROMPTS[0]))
    plain = model.generate(prompt_ids=ids, max_new_tokens=32)
    out = model.generate(prompt_ids=ids, max_new_tokens=32, draft="medusa", draft_k=6)
    assert out.tokens == plain.tokens
    assert out.stats.drafted > 0
