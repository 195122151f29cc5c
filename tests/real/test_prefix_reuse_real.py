"""A chat on the real presets in q4, on forerun's native kernels: each turn
reuses the previous prompt and answer from the cache (every position the
new prompt shares with it), and answers with the tokens a cold prefill gives,
greedy and sampled with a seed, plain and with prompt lookup."""

import pytest

pytestmark = pytest.mark.real_model

SYSTEM = "You answer in one or two short sentences."
QUESTIONS = ["What does a compiler do?", "Give one example of one.", "Why is it fast?"]


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
@pytest.mark.parametrize("draft, temperature", [(None, 0.0), ("ngram", 0.0), (None, 0.8)])
def test_each_turn_reuses_the_previous_answer_and_answers_as_cold(preset_model, name, draft,
                                                                    temperature):
    model = preset_model(name, weights="q4")
    if not model.decoder.exact_positions:
        pytest.skip("forerun's native kernels don't run here")
    options = {"max_new_tokens": 20, "temperature": temperature, "seed": 7, "draft": draft}
    messages = [{"role": "system", "content": SYSTEM}]
    model.reset_cache()
    previous = 0
    try:
        for turn, question in enumerate(QUESTIONS):
            messages.append({"role": "user", "content": question})
            model.reuse_prompts = True
            warm = model.generate(messages=messages, **options)
            if turn:
                # The previous prompt and its answer, all but the answer's
                # last token (never fed) and what the chat template may
                # spell differently from the tokens generated.
                assert warm.stats.reused_prompt_tokens >= previous - 3, turn
            previous = warm.stats.prompt_tokens + warm.stats.new_tokens
            model.reuse_prompts = False
            cold = model.generate(messages=messages, **options)
            assert cold.stats.reused_prompt_tokens == 0
            assert warm.tokens == cold.tokens, turn
            # (The cold run's cache holds the same positions the warm run's did.)
            messages.append({"role": "assistant", "content": warm.text})
    finally:
        model.reuse_prompts = True
        model.reset_cache()
