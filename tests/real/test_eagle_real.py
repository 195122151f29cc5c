"""An EAGLE-3 head on the real 1.5B target (q4, the format users run; the
head in int8): greedy output is token-identical to plain decoding for
chains, trees and chains beside prompt lookup, with the head forerun ships
where one ships and a random head of the published shape otherwise (which the target seldom accepts,
but whose every draft goes through the real target's states and the
verification loop all the same)."""

import pytest
import torch

from real.test_speculative_real import CHAT_PROMPTS, assert_identical, messages

pytestmark = pytest.mark.real_model


def head_for(target):
    """The shipped head, else a random one of the shipped head's shape."""
    from forerun.drafters.eagle.files import shipped_head_path
    from forerun.drafters.eagle.weights import Eagle3Config, Eagle3Weights, default_aux_layers

    if shipped_head_path(target.name) is not None:
        return "eagle"
    c = target.decoder.model.config
    config = Eagle3Config(
        hidden_size=c.hidden_size, intermediate_size=512, num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, rope_scaling=c.rope_scaling, vocab_size=c.vocab_size,
        draft_vocab_size=4096, aux_layers=default_aux_layers(c.num_layers))
    return Eagle3Weights.random(config, torch.arange(4096), seed=0)


@pytest.mark.slow
def test_eagle_greedy_is_lossless_on_the_real_target(preset_model):
    target = preset_model("qwen2.5-coder-1.5b", weights="q4")
    head = head_for(target)
    for text in CHAT_PROMPTS[:2]:
        ids = target.encode_prompt(messages=messages(text))
        plain = target.generate(prompt_ids=ids, max_new_tokens=40)
        for options in ({"draft_k": 3}, {"draft_tree": True, "tree_nodes": 6}, {},
                        {"draft_lookup": False}):
            out = target.generate(prompt_ids=ids, max_new_tokens=40, draft=head, **options)
            assert_identical(target, ids, plain, out, f"eagle {options} on {text[:30]!r}")
            assert out.finish_reason == plain.finish_reason
            assert out.stats.accepted <= out.stats.drafted
