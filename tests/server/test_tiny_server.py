"""``forerun serve`` over HTTP on a tiny random model, in the quick subset:
the endpoints, greedy answers equal to :meth:`forerun.Model.generate` of the
same prompt, streaming, the per-request drafter, errors and the API key.

The server is a real ``forerun serve`` process (:class:`conftest.LiveServer`)
on a tiny GGUF (:mod:`tiny_gguf`), started once for the module; the tests
that need the real preset are in the other modules of this folder."""

from __future__ import annotations

import json

import openai
import pytest

from conftest import LiveServer, streamed, text_of

# One worker starts the server and runs every test of this module
# (pytest -n 2 --dist loadgroup).
pytestmark = pytest.mark.xdist_group("tiny_server")

KEY = "tiny-key"
CONTEXT = 256
CHAT = [{"role": "user", "content": "hello world, the quick brown fox"}]
PROMPT = "the quick brown fox jumps over the lazy dog, the quick brown"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-server") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny_server(tiny_path):
    srv = LiveServer("-m", str(tiny_path), "--weights", "float32", "--context-length",
                     str(CONTEXT), "--api-key", KEY, "--max-queue", "4")
    yield srv
    # SIGTERM: the status of a terminated command, and no traceback.
    assert srv.stop() == 143, srv.read_stderr()[-3000:]
    assert "Traceback" not in srv.read_stderr()


@pytest.fixture(scope="module")
def model_id(tiny_server):
    status, body = tiny_server.request("GET", "/v1/models", key=KEY)
    assert status == 200, body
    return body["data"][0]["id"]


@pytest.fixture(scope="module")
def reference(tiny_path):
    """The same model, loaded in this process the way the server loads it."""
    import forerun

    return forerun.load(str(tiny_path), weights="float32", context_length=CONTEXT,
                        progress=False)


@pytest.fixture()
def client(tiny_server):
    return tiny_server.client(api_key=KEY, timeout=120)


def greedy(client, model, messages=None, prompt=None, max_tokens=12, **extra):
    if messages is not None:
        return client.chat.completions.create(model=model, messages=messages,
                                              max_tokens=max_tokens, temperature=0, **extra)
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, **extra)


def test_models_and_health(tiny_server, client, model_id, tiny_path):
    assert [m.id for m in client.models.list().data] == [model_id]
    assert tiny_path.name.startswith(model_id.removesuffix(".gguf"))
    assert client.models.retrieve(model_id).id == model_id
    health = tiny_server.health()
    assert health["status"] == "ok" and health["model"] == model_id


def test_greedy_chat_is_model_generate(client, model_id, reference):
    expected = reference.generate(messages=CHAT, max_new_tokens=12, ignore_eos=True)
    got = greedy(client, model_id, CHAT, extra_body={"ignore_eos": True})
    assert got.object == "chat.completion" and got.model == model_id
    assert got.choices[0].message.role == "assistant"
    assert text_of(got) == expected.text
    assert got.usage.completion_tokens == len(expected.tokens) == 12
    assert got.choices[0].finish_reason == "length"


def test_greedy_completion_is_model_generate(client, model_id, reference):
    expected = reference.generate(PROMPT, max_new_tokens=10, ignore_eos=True)
    got = greedy(client, model_id, prompt=PROMPT, max_tokens=10, extra_body={"ignore_eos": True})
    assert got.object == "text_completion"
    assert text_of(got) == expected.text
    assert got.usage.completion_tokens == len(expected.tokens)
    assert got.usage.prompt_tokens == len(reference.encode_prompt(PROMPT))
    echoed = greedy(client, model_id, prompt=PROMPT, max_tokens=10, echo=True,
                    extra_body={"ignore_eos": True})
    assert text_of(echoed) == PROMPT + expected.text


def test_streamed_chunks_join_to_the_whole_answer(client, model_id):
    for kind in ("chat", "completion"):
        source = {"messages": CHAT} if kind == "chat" else {"prompt": PROMPT}
        whole = greedy(client, model_id, **source, max_tokens=12,
                       extra_body={"ignore_eos": True})
        text, chunks, every = streamed(greedy(client, model_id, **source, max_tokens=12,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
        assert text == text_of(whole) and text, kind
        assert len(chunks) > 1, kind
        assert len({c.id for c in chunks}) == 1, kind
        assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
        assert every[-1].usage.completion_tokens == whole.usage.completion_tokens == 12


def test_raw_sse_stream_ends_with_done(tiny_server, model_id):
    """The wire format: ``data: {json}`` events, then ``data: [DONE]``."""
    import http.client

    conn = http.client.HTTPConnection(tiny_server.host, tiny_server.port, timeout=120)
    body = json.dumps({"model": model_id, "prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                       "stream": True})
    conn.request("POST", "/v1/completions", body=body,
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.getheader("Content-Type").startswith("text/event-stream")
    events = [line for line in resp.read().decode().splitlines() if line]
    conn.close()
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-1])


@pytest.mark.parametrize("speculative, method", [
    ({"draft": "ngram"}, "ngram"),
    ({"draft": "ngram", "draft_k": 3}, "ngram"),
    ({"draft": "none"}, "plain"),
])
def test_the_requests_drafter_gives_the_same_tokens(client, model_id, speculative, method):
    plain = greedy(client, model_id, prompt=PROMPT, max_tokens=16,
                   extra_body={"ignore_eos": True})
    got = greedy(client, model_id, prompt=PROMPT, max_tokens=16,
                 extra_body={"ignore_eos": True, "speculative": speculative})
    assert text_of(got) == text_of(plain)
    assert got.usage.completion_tokens == plain.usage.completion_tokens == 16
    stats = got.model_extra["forerun"]
    assert stats["method"] == method
    assert plain.model_extra["forerun"]["method"] == "plain"
    if "draft_k" in speculative:
        # A fixed draft length drafts every round it finds a match in the prompt.
        assert 0 <= stats["accepted"] <= stats["drafted"]


def _error(tiny_server, path, body, status, key=KEY):
    got, payload = tiny_server.request("POST", path, body, key=key)
    assert got == status, payload
    assert set(payload) == {"error"}
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["message"]
    return payload["error"]


def test_bad_requests_get_400_naming_the_field(tiny_server, model_id):
    chat = {"model": model_id, "messages": CHAT, "max_tokens": 4}
    assert _error(tiny_server, "/v1/chat/completions", "{", 400)["param"] is None
    for field, value in [("temperature", "hot"), ("temperature", 2.5), ("max_tokens", 0),
                         ("top_p", 0), ("n", 2), ("stop", [""])]:
        err = _error(tiny_server, "/v1/chat/completions", {**chat, field: value}, 400)
        assert err["type"] == "invalid_request_error" and err["param"] == field, (field, err)
    err = _error(tiny_server, "/v1/chat/completions",
                 {**chat, "speculative": {"draft": "none", "draft_k": 3}}, 400)
    assert err["param"] == "speculative.draft_k"
    err = _error(tiny_server, "/v1/completions",
                 {"model": model_id, "prompt": "word " * (CONTEXT + 10)}, 400)
    assert err["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        tiny_server.client(api_key=KEY).chat.completions.create(
            model=model_id, messages=CHAT, temperature=-1)


def test_unknown_model_and_route_get_404(tiny_server, client, model_id):
    err = _error(tiny_server, "/v1/chat/completions",
                 {"model": "gpt-4", "messages": CHAT, "max_tokens": 4}, 404)
    assert err["param"] == "model" and err["code"] == "model_not_found"
    assert model_id in err["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    status, body = tiny_server.request("GET", "/v1/models/gpt-4", key=KEY)
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body = tiny_server.request("GET", "/v1/nothing-here", key=KEY)
    assert status == 404 and "error" in body


def test_the_api_key_is_required_on_v1(tiny_server, model_id):
    chat = {"model": model_id, "messages": CHAT, "max_tokens": 2}
    for key in (None, "wrong-key", KEY + "x"):
        err = _error(tiny_server, "/v1/chat/completions", chat, 401, key=key)
        assert err["code"] == "invalid_api_key"
        assert tiny_server.request("GET", "/v1/models", key=key)[0] == 401
    with pytest.raises(openai.AuthenticationError):
        tiny_server.client(api_key="wrong-key").models.list()
    assert tiny_server.request("GET", "/health", key=None)[0] == 200
    assert tiny_server.request("GET", "/metrics", key=None)[0] == 200
    assert tiny_server.request("POST", "/v1/chat/completions", chat, key=KEY)[0] == 200


def test_the_server_survives_bad_requests(tiny_server, client, model_id):
    for body in ("{", "null", '"text"', "[1, 2]"):
        status, _ = tiny_server.request("POST", "/v1/chat/completions", body, key=KEY)
        assert status == 400
    assert text_of(greedy(client, model_id, CHAT, max_tokens=3))
    assert tiny_server.proc.poll() is None
    assert "Traceback" not in tiny_server.read_stderr()
