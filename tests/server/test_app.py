"""The OpenAI endpoints of a live ``forerun serve``, through the official
``openai`` client: chat and completions, streamed and not, usage, stop
strings, seeds, the per-request drafter, and every error case."""

import json
import subprocess
import sys

import openai
import pytest

from conftest import API_KEY, CONTEXT, MODEL, WEIGHTS, greedy, streamed, text_of

pytestmark = pytest.mark.real_model

CHAT = [{"role": "user", "content": "List three colours, one per line."}]


def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert server.client().models.retrieve(MODEL).id == MODEL
    health = server.health()
    assert health["status"] == "ok" and health["model"] == MODEL


def test_chat_streamed_and_not(server):
    client = server.client()
    whole = greedy(client, CHAT, max_tokens=16)
    assert whole.object == "chat.completion" and whole.model == MODEL
    assert whole.choices[0].message.role == "assistant"
    text, chunks, _ = streamed(greedy(client, CHAT, max_tokens=16, stream=True))
    assert text == text_of(whole) and text
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].model_extra["forerun"]["new_tokens"] == whole.usage.completion_tokens


def test_completion_streamed_and_not(server):
    client = server.client()
    whole = greedy(client, prompt="def fibonacci(n):", max_tokens=16)
    assert whole.object == "text_completion"
    text, chunks, _ = streamed(greedy(client, prompt="def fibonacci(n):", max_tokens=16,
                                      stream=True))
    assert text == whole.choices[0].text and text
    assert all(c.object == "text_completion" for c in chunks)
    echoed = greedy(client, prompt="def fibonacci(n):", max_tokens=16, echo=True)
    assert echoed.choices[0].text == "def fibonacci(n):" + text


def test_usage_and_finish_reasons(server):
    client = server.client()
    long = greedy(client, CHAT, max_tokens=7, extra_body={"ignore_eos": True})
    assert long.choices[0].finish_reason == "length"
    assert long.usage.completion_tokens == 7
    assert long.usage.total_tokens == long.usage.prompt_tokens + 7
    short = greedy(client, [{"role": "user", "content": "Say yes."}], max_tokens=200)
    assert short.choices[0].finish_reason == "stop"
    assert short.usage.completion_tokens < 200
    _, _, chunks = streamed(greedy(client, CHAT, max_tokens=7, stream=True,
                                   stream_options={"include_usage": True},
                                   extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == long.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    _, _, no_usage = streamed(greedy(client, CHAT, max_tokens=3, stream=True))
    assert all(c.usage is None for c in no_usage)


def test_stop_strings(server):
    client = server.client()
    reference = text_of(greedy(client, CHAT, max_tokens=24, extra_body={"ignore_eos": True}))
    words = reference.split()
    assert len(words) >= 3, reference
    stop = words[2]
    cut = reference[:reference.index(stop)]
    stopped = greedy(client, CHAT, max_tokens=24, stop=[stop, "never seen"])
    assert text_of(stopped) == cut and stopped.choices[0].finish_reason == "stop"
    text, chunks, _ = streamed(greedy(client, CHAT, max_tokens=24, stop=stop, stream=True))
    assert text == cut and chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats(server):
    client = server.client()

    open_ended = [{"role": "user", "content": "Tell me a story."}]

    def sample(seed, stream=False):
        r = client.chat.completions.create(
            model=MODEL, messages=open_ended, max_tokens=10, temperature=1.0, top_p=0.95,
            seed=seed, stream=stream, extra_body={"top_k": 50, "min_p": 0.01})
        return streamed(r)[0] if stream else text_of(r)

    first = sample(1234)
    assert sample(1234) == first
    assert sample(1234, stream=True) == first
    assert len({sample(seed) for seed in range(3)}) > 1


def test_per_request_drafter(server):
    client = server.client()
    messages = [{"role": "user", "content": "Repeat exactly: one two three four five six "
                                            "seven eight, one two three four five six"}]
    runs = {}
    for name, spec in [("default", None), ("none", {"draft": "none"}),
                       ("ngram", {"draft": "ngram"}), ("ngram-k2", {"draft": "ngram",
                                                                     "draft_k": 2})]:
        extra = {"speculative": spec} if spec else {}
        runs[name] = greedy(client, messages, max_tokens=20, extra_body=extra)
    texts = {name: text_of(r) for name, r in runs.items()}
    assert len(set(texts.values())) == 1, texts
    stats = {name: r.model_extra["forerun"] for name, r in runs.items()}
    assert stats["none"]["method"] == "plain" and "drafted" not in stats["none"]
    assert stats["default"]["method"] == stats["ngram"]["method"] == "ngram"
    fixed = stats["ngram-k2"]           # a fixed draft length drafts every round it can
    assert fixed["method"] == "ngram" and fixed["drafted"] > 0
    assert 0 <= fixed["accepted"] <= fixed["drafted"]
    assert 0 <= fixed["acceptance_rate"] <= 1
    assert fixed["mean_accepted_tokens"] >= 1
    with pytest.raises(openai.BadRequestError) as err:
        greedy(client, messages, extra_body={"speculative": {"draft": "qwen-9000"}})
    assert err.value.body["param"] == "speculative.draft"
    assert "'ngram'" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        greedy(client, messages, extra_body={"speculative": {"draft": "none", "draft_k": 3}})
    assert err.value.body["param"] == "speculative.draft_k"


def test_per_request_draft_trees_and_chains(draft_server):
    """A server whose default is a draft-model tree: the tree, a fixed node
    budget, a chain and plain decoding all give the same greedy text, each
    by the method the request asked for."""
    client = draft_server.client()
    runs = {name: greedy(client, CHAT, max_tokens=24, extra_body={"speculative": spec})
            for name, spec in [("default", {}), ("nodes", {"tree_nodes": 4}),
                               ("chain", {"draft_k": 2}), ("plain", {"draft": "none"})]}
    assert len({text_of(r) for r in runs.values()}) == 1, {n: text_of(r)
                                                          for n, r in runs.items()}
    stats = {name: r.model_extra["forerun"] for name, r in runs.items()}
    assert stats["default"]["method"] == stats["nodes"]["method"] == "draft-tree"
    assert stats["chain"]["method"] == "draft" and stats["plain"]["method"] == "plain"
    for name in ("nodes", "chain"):      # fixed shapes draft every round they can
        assert stats[name]["drafted"] > 0 and stats[name]["accepted"] > 0, name
    with pytest.raises(openai.BadRequestError) as err:
        greedy(client, CHAT, extra_body={"speculative": {"draft": "ngram", "tree_nodes": 4}})
    assert err.value.body["param"] == "speculative.tree_nodes"


def test_deltas_never_split_a_character(server):
    """The whole response's text is the generation's, decoded at once: a
    character split across deltas would make the streamed text differ."""
    client = server.client()
    for prompt in ("日本語 日本語 日本語 日本語 日本語", "café, café, café, café,",
                   "🎉 🎉 🎉 🎉 🎉 🎉", "Übersetzung: 日本語のテキスト、こんにちは世界 — "):
        whole = greedy(client, prompt=prompt, max_tokens=16).choices[0].text
        if any(ord(ch) > 127 for ch in whole):   # multi-byte characters were generated
            break
    else:
        pytest.fail("no prompt made the model generate a multi-byte character")
    text, chunks, _ = streamed(greedy(client, prompt=prompt, max_tokens=16, stream=True))
    assert text == whole
    assert len(chunks) > 1


def test_greedy_output_is_forerun_generates(server):
    """The same request through the API and through `forerun generate`
    gives the same text and token count."""
    prompt = "Write a haiku about the sea."
    cli = subprocess.run(
        [sys.executable, "-m", "forerun.cli.main", "generate", "-m", MODEL, "--draft", "ngram",
         "--weights", WEIGHTS, "-n", "20", "--context-length", str(CONTEXT), "--json", "-q",
         prompt],
        capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stderr
    expected = json.loads(cli.stdout)
    api = greedy(server.client(), [{"role": "user", "content": prompt}], max_tokens=20)
    assert text_of(api) == expected["text"]
    assert api.usage.completion_tokens == len(expected["tokens"])
    assert api.choices[0].finish_reason == expected["finish_reason"]


# -- errors -------------------------------------------------------------------------

def _error(server, path, body, status, key=API_KEY, **kw):
    got, payload = server.request("POST", path, body, key=key, **kw)
    assert got == status, payload
    assert set(payload) == {"error"}
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["message"]
    return payload["error"]


def chat_body(**fields):
    return {"model": MODEL, "messages": CHAT, "max_tokens": 4, **fields}


@pytest.mark.parametrize("body,param", [
    ('{"model": "smollm2-135m", "messages": [', None),                  # malformed JSON
    ("[1, 2]", None),                                                     # not an object
    (chat_body(temperature="hot"), "temperature"),                       # wrong types
    (chat_body(max_tokens="4"), "max_tokens"),
    (chat_body(messages="hello"), "messages"),
    (chat_body(messages=[{"role": "wizard", "content": "x"}]), "messages.0.role"),
    (chat_body(stream="yes"), "stream"),
    (chat_body(temperature=2.5), "temperature"),                         # out of range
    (chat_body(top_p=0), "top_p"),
    (chat_body(top_k=-1), "top_k"),
    (chat_body(min_p=1.5), "min_p"),
    (chat_body(max_tokens=0), "max_tokens"),
    (chat_body(seed=-1), "seed"),
    (chat_body(n=2), "n"),                                               # unsupported
    (chat_body(logprobs=True), "logprobs"),
    (chat_body(presence_penalty=0.5), "presence_penalty"),
    (chat_body(stop=[""]), "stop"),
    (chat_body(messages=[]), "messages"),
    (chat_body(messages=[{"role": "user", "content": [{"type": "image_url",
                                                       "image_url": {"url": "x"}}]}]),
     "messages.0.content"),
    ({"messages": CHAT}, "model"),                                       # missing field
])
def test_bad_chat_requests_get_400(server, body, param):
    err = _error(server, "/v1/chat/completions", body, 400)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param


def test_bad_completion_requests_get_400(server):
    base = {"model": MODEL, "max_tokens": 4}
    assert _error(server, "/v1/completions", {**base, "prompt": 5}, 400)["param"] == "prompt"
    assert _error(server, "/v1/completions", {**base, "prompt": ["a", "b"]},
                  400)["param"] == "prompt"
    assert _error(server, "/v1/completions", {**base, "prompt": "x", "best_of": 3},
                  400)["param"] == "best_of"
    assert _error(server, "/v1/completions", {**base, "prompt": [1, 10 ** 9]},
                  400)["param"] == "prompt"


def test_prompt_longer_than_the_context_names_the_lengths(server):
    long = "word " * (CONTEXT + 50)
    err = _error(server, "/v1/completions", {"model": MODEL, "prompt": long}, 400)
    assert err["code"] == "context_length_exceeded"
    assert f"holds {CONTEXT}" in err["message"] and "tokens" in err["message"]
    n = int(err["message"].split("prompt has ")[1].split()[0])
    assert n > CONTEXT
    err = _error(server, "/v1/chat/completions", chat_body(max_tokens=CONTEXT), 400)
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
    assert f"max_tokens is {CONTEXT}" in err["message"]
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=MODEL, prompt=long)


def test_unknown_model_and_route_get_404(server):
    err = _error(server, "/v1/chat/completions", chat_body(model="gpt-4"), 404)
    assert err["param"] == "model" and err["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="gpt-4", messages=CHAT)
    status, body = server.request("GET", "/v1/models/gpt-4")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body = server.request("GET", "/v1/nothing-here")
    assert status == 404 and "error" in body


def test_missing_or_wrong_key_gets_401(server):
    for key in (None, "wrong-key"):
        err = _error(server, "/v1/chat/completions", chat_body(), 401, key=key)
        assert err["code"] == "invalid_api_key"
        status, _ = server.request("GET", "/v1/models", key=key)
        assert status == 401
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong-key").models.list()
    # /health and /metrics need no key.
    assert server.request("GET", "/health", key=None)[0] == 200


def test_the_server_survives_every_bad_request(server):
    for body in ("{", "null", '"text"', chat_body(n=3), chat_body(model="nope")):
        status, _ = server.request("POST", "/v1/chat/completions", body)
        assert status in (400, 404)
    assert text_of(greedy(server.client(), CHAT, max_tokens=3))
    assert server.proc.poll() is None
    assert "Traceback" not in server.read_stderr()
