"""Request validation: strict types and ranges, and errors that name the
offending field."""

import pytest

from forerun.server.errors import APIError
from forerun.server.schemas import ChatCompletionRequest, CompletionRequest, parse

CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]'


def chat(extra: bytes = b"") -> bytes:
    return CHAT + extra + b"}"


def test_a_valid_request_keeps_openai_and_forerun_fields():
    req = parse(ChatCompletionRequest, chat(
        b', "temperature": 0, "top_p": 0.9, "max_tokens": 5, "stop": "x", "seed": 3, '
        b'"top_k": 40, "min_p": 0.05, "ignore_eos": true, "user": "me", '
        b'"speculative": {"draft": "ngram", "draft_k": 3}, "stream": true, '
        b'"stream_options": {"include_usage": true}'))
    assert req.temperature == 0.0 and req.top_p == 0.9 and req.max_tokens == 5
    assert req.stop == "x" and req.seed == 3 and req.top_k == 40 and req.min_p == 0.05
    assert req.ignore_eos and req.stream and req.stream_options.include_usage
    assert req.speculative.draft == "ngram" and req.speculative.draft_k == 3
    prompt = parse(CompletionRequest, b'{"model": "m", "prompt": [1, 2, 3]}')
    assert prompt.prompt == [1, 2, 3]


@pytest.mark.parametrize("extra,param", [
    (b', "temperature": "0.5"', "temperature"),     # a string is not a number
    (b', "max_tokens": 2.5', "max_tokens"),
    (b', "stream": 1', "stream"),
    (b', "temperature": -0.1', "temperature"),
    (b', "top_p": 1.5', "top_p"),
    (b', "n": 0', "n"),
    (b', "speculative": {"draft": "ngram", "k": 2}', "speculative.k"),
    (b', "speculative": {"draft_k": 0}', "speculative.draft_k"),
    (b', "stop": [1]', "stop"),
])
def test_errors_name_the_field(extra, param):
    with pytest.raises(APIError) as err:
        parse(ChatCompletionRequest, chat(extra))
    assert err.value.status == 400 and err.value.param == param
    assert param.split(".")[-1] in err.value.message


def test_malformed_json_and_non_objects():
    for body in (b"{", b"", b"not json"):
        with pytest.raises(APIError, match="not valid JSON") as err:
            parse(ChatCompletionRequest, body)
        assert err.value.status == 400
    with pytest.raises(APIError, match="JSON object"):
        parse(ChatCompletionRequest, b"[1]")
