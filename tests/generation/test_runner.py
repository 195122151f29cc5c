"""Generation on a real small model: streaming, stops, limits, seeds and
cancellation behave the same for every caller."""

import pytest

pytestmark = pytest.mark.real_model

MESSAGES = [{"role": "user", "content": "Write a haiku about the sea, then explain it."}]


@pytest.fixture(scope="module")
def model(preset_model):
    return preset_model("smollm2-135m")


@pytest.fixture(scope="module")
def reference(model):
    """Greedy output with no stop condition but the token limit."""
    return model.generate(messages=MESSAGES, max_new_tokens=48, ignore_eos=True)


def test_stream_deltas_make_the_text(model, reference):
    stream = model.stream(messages=MESSAGES, max_new_tokens=48, ignore_eos=True)
    deltas = list(stream)
    assert "".join(deltas) == stream.result.text == reference.text
    assert stream.result.tokens == reference.tokens
    assert reference.text == model.tokenizer.decode(reference.tokens)
    assert reference.finish_reason == "length" and len(reference.tokens) == 48
    stats = reference.stats
    assert stats.new_tokens == 48 and stats.prompt_tokens > 0
    assert stats.prefill_seconds > 0 and stats.decode_seconds > 0
    assert stats.tokens_per_second > 0


def test_stop_string_cuts_text_exactly(model, reference):
    text = reference.text
    stop = text[len(text) // 2: len(text) // 2 + 4]
    at = text.index(stop)
    result = model.generate(messages=MESSAGES, max_new_tokens=48, ignore_eos=True, stop=[stop])
    assert result.finish_reason == "stop"
    assert result.text == text[:at]
    assert result.tokens == reference.tokens[:len(result.tokens)]
    # Streamed deltas never show a part of the stop string.
    deltas = list(model.stream(messages=MESSAGES, max_new_tokens=48, ignore_eos=True,
                               stop=[stop]))
    assert "".join(deltas) == text[:at]


def test_stop_token_id_ends_output_at_that_token(model, reference):
    stop_id = reference.tokens[10]
    first = reference.tokens.index(stop_id)
    result = model.generate(messages=MESSAGES, max_new_tokens=48, ignore_eos=True,
                            stop_token_ids=[stop_id])
    assert result.finish_reason == "stop"
    assert result.tokens == reference.tokens[:first + 1]
    assert result.text == model.tokenizer.decode(reference.tokens[:first])


def test_eos_stops_generation(model):
    result = model.generate(messages=[{"role": "user", "content": "Say OK."}],
                            max_new_tokens=64)
    assert result.finish_reason == "stop"
    assert result.tokens[-1] in model.eos_token_ids
    assert model.tokenizer.decode([result.tokens[-1]]) not in result.text


def test_seeded_sampling_repeats(model):
    kwargs = dict(messages=MESSAGES, max_new_tokens=24, temperature=0.9, top_p=0.95,
                  ignore_eos=True)
    a = model.generate(seed=7, **kwargs)
    b = model.generate(seed=7, **kwargs)
    c = model.generate(seed=8, **kwargs)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_cancel_stops_between_tokens_and_leaves_model_usable(model, reference):
    seen = []
    stream = model.stream(messages=MESSAGES, max_new_tokens=48, ignore_eos=True,
                          cancel=lambda: len(seen) >= 5)
    for delta in stream:
        seen.append(delta)
    result = stream.result
    assert result.finish_reason == "cancelled"
    assert 5 <= len(result.tokens) < 48
    assert result.tokens == reference.tokens[:len(result.tokens)]
    again = model.generate(messages=MESSAGES, max_new_tokens=48, ignore_eos=True)
    assert again.tokens == reference.tokens


def test_cancel_event(model):
    import threading

    event = threading.Event()
    event.set()
    result = model.generate(messages=MESSAGES, max_new_tokens=48, cancel=event)
    assert result.finish_reason == "cancelled" and len(result.tokens) == 1
