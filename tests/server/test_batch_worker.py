"""``forerun serve --parallel N`` (continuous batching) on a tiny random
model, in the quick subset: concurrent requests of different lengths,
sampling settings and drafters, joining and leaving a running batch, each
get exactly what ``Model.generate`` gives alone; a client that goes away
frees its slot; a request too long is refused alone; ``/metrics`` shows the
slots; bad ``--parallel`` values and combinations are refused at start."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from conftest import LiveServer, streamed, text_of

pytestmark = pytest.mark.xdist_group("batch_server")

KEY = "batch-key"
CONTEXT = 2048
SLOTS = 4
PROMPTS = ["the quick brown fox", "hello world hello world hello", "a b c d e f g",
           "lorem ipsum dolor", "one two three", "zz yy zz yy", "x", "fox dog cat bird"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("batch-server") / "tiny.gguf",
                           overrides={"qwen2.context_length": ("uint32", CONTEXT)})


@pytest.fixture(scope="module")
def batch_server(tiny_path):
    srv = LiveServer("-m", str(tiny_path), "--weights", "q8", "--context-length",
                     str(CONTEXT), "--api-key", KEY, "--parallel", str(SLOTS),
                     "--draft", "ngram")
    yield srv
    assert srv.stop() == 143, srv.read_stderr()[-3000:]
    assert "Traceback" not in srv.read_stderr()


@pytest.fixture(scope="module")
def reference(tiny_path):
    import forerun

    return forerun.load(str(tiny_path), weights="q8", context_length=CONTEXT, progress=False)


def _request(n: int) -> dict:
    """Request ``n``: its own prompt, length, sampling and drafter."""
    body = {"prompt": PROMPTS[n % len(PROMPTS)], "max_tokens": 3 + (n * 7) % 19,
            "ignore_eos": True}
    if n % 3 == 1:
        body.update(temperature=0.8, top_p=0.9, seed=1000 + n)
    else:
        body["temperature"] = 0
    if n % 2:
        body["speculative"] = {"draft": "none"}
    return body


def _alone(model, body: dict) -> str:
    draft = body.get("speculative", {}).get("draft", "ngram")
    return model.generate(body["prompt"], max_new_tokens=body["max_tokens"],
                          temperature=body["temperature"], top_p=body.get("top_p", 1.0),
                          seed=body.get("seed"), ignore_eos=True, draft=draft).text


def _send(srv: LiveServer, model_id: str, body: dict, stream: bool) -> str:
    client = srv.client(api_key=KEY, timeout=300)
    extra = {k: body[k] for k in ("ignore_eos", "speculative") if k in body}
    r = client.completions.create(model=model_id, prompt=body["prompt"],
                                  max_tokens=body["max_tokens"],
                                  temperature=body["temperature"], top_p=body.get("top_p", 1),
                                  seed=body.get("seed"), stream=stream, extra_body=extra)
    return streamed(r)[0] if stream else text_of(r)


def _model_id(srv) -> str:
    status, body = srv.request("GET", "/v1/models", key=KEY)
    assert status == 200
    return body["data"][0]["id"]


def test_concurrent_requests_each_get_their_answer_alone(batch_server, reference):
    model_id = _model_id(batch_server)
    bodies = [_request(n) for n in range(16)]
    want = [_alone(reference, b) for b in bodies]
    barrier = threading.Barrier(8)

    def client(i: int) -> list[str]:
        barrier.wait(60)
        return [_send(batch_server, model_id, bodies[n], stream=n % 4 == 0)
                for n in range(i, 16, 8)]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(client, range(8)))
    for i, answers in enumerate(got):
        assert answers == [want[n] for n in range(i, 16, 8)], i
    metrics = batch_server.metrics()
    assert metrics["forerun_slots"] == SLOTS
    assert batch_server.health()["in_flight"] == 0


def _open_stream(srv, model_id: str, max_tokens: int):
    """A raw streamed greedy completion, open after its first event."""
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=300)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"model": model_id, "prompt": "1 2 3", "max_tokens": max_tokens, "ignore_eos": True,
         "temperature": 0, "stream": True}),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    return conn, resp


def test_a_client_that_goes_away_frees_its_slot_and_a_long_prompt_is_refused_alone(
        batch_server, reference):
    model_id = _model_id(batch_server)
    before = batch_server.metrics()
    cancelled = 'forerun_generations_total{finish_reason="cancelled"}'
    conn, resp = _open_stream(batch_server, model_id, 2000)
    conn.sock.shutdown(2)               # the client goes away after its first event
    resp.close()
    conn.close()
    batch_server.wait_until(lambda: batch_server.health()["in_flight"] == 0, "a free slot")
    after = batch_server.metrics()
    assert after.get(cancelled, 0) == before.get(cancelled, 0) + 1
    assert (after["forerun_generated_tokens_total"]
            - before.get("forerun_generated_tokens_total", 0)) < 2000
    # A prompt longer than the context is a 400 for its own client, beside a
    # stream that goes on to the answer it gets alone.
    conn, resp = _open_stream(batch_server, model_id, 300)
    with pytest.raises(openai.BadRequestError):
        batch_server.client(api_key=KEY).completions.create(
            model=model_id, prompt="word " * 2100, max_tokens=4)
    events = [line for line in resp.read().decode().splitlines() if line.startswith("data: {")]
    conn.close()
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events
                   if json.loads(e[6:])["choices"])
    alone = reference.generate("1 2 3", max_new_tokens=300, ignore_eos=True, draft="ngram")
    # (the first event was read when the stream opened)
    assert len(text) > len(alone.text) / 2 and alone.text.endswith(text)
    body = _request(2)
    assert _send(batch_server, model_id, body, stream=False) == _alone(reference, body)


def test_a_request_for_a_drafter_a_batch_does_not_run_is_refused(tmp_path, tiny_path):
    # (the tiny model as its own draft model: not batched)
    cmd = [sys.executable, "-m", "forerun.cli.main", "serve", "-m", str(tiny_path),
           "--weights", "q8", "--context-length", str(CONTEXT), "--port", "0", "-q"]
    for extra, message in [
            (["--parallel", "0"], "--parallel: must be a positive integer"),
            (["--parallel", "-3"], "--parallel: must be a positive integer"),
            (["--parallel", "two"], "--parallel: must be a positive integer, got 'two'"),
            (["--parallel", "100000000"], "at most --parallel"),
            (["--parallel", "2", "--draft", str(tiny_path)],
             "plain decoding, prompt lookup or suffix drafting"),
            (["--parallel", "2", "--engine", "llama.cpp"], "one request at a time")]:
        if "llama.cpp" in extra:        # refused before the model (and its weights) load
            cmd = [c for c in cmd if c not in ("--weights", "q8")]
        run = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=600)
        assert run.returncode != 0, extra
        assert message in run.stderr, (extra, run.stderr[-2000:])
        assert "Traceback" not in run.stderr


def test_a_request_that_cant_start_or_a_failed_batch_ends_with_an_error_and_serving_goes_on(
        tiny_path, reference, monkeypatch):
    """Fault injection in the batch worker, in process: a request whose
    start fails is answered with the error and the next one is served; a
    batch whose step fails ends both requests in flight with an
    EngineError naming the fault (they never wait for ever), and the
    worker starts again: the next request gets its answer alone."""
    import asyncio

    import forerun
    from forerun.errors import EngineError
    from forerun.generation.batch import SharedForwards
    from forerun.server.batch_worker import BatchWorker
    from forerun.server.prefix_cache import PrefixCache
    from forerun.server.translate import GenerationSpec
    from forerun.server.worker import Job

    model = forerun.load(str(tiny_path), weights="q8", context_length=CONTEXT, progress=False)
    worker = BatchWorker(model, PrefixCache(model.decoder, limit_bytes=1 << 24), max_queue=8,
                         parallel=2)
    prompt = model.encode_prompt(PROMPTS[0])
    alone = reference.generate(prompt_ids=prompt, max_new_tokens=12, ignore_eos=True).tokens

    def spec(n: int) -> GenerationSpec:
        return GenerationSpec(prompt, {"max_new_tokens": n, "ignore_eos": True})

    async def outcome(n: int):
        job = Job(spec(n))
        worker.submit(job)
        while True:
            kind, payload = await asyncio.wait_for(job.events.get(), 60)
            if kind != "delta":
                return kind, payload

    prepare, starts = worker.prefix_cache.prepare, []

    def failing_prepare(*args, **kwargs):
        starts.append(1)
        if len(starts) == 1:
            raise RuntimeError("injected start fault")
        return prepare(*args, **kwargs)

    step, steps_failed = SharedForwards.step, []

    def failing_step(self, *args, **kwargs):
        if not steps_failed and self.members == 2:       # both requests in flight
            steps_failed.append(1)
            raise RuntimeError("injected batch fault")
        return step(self, *args, **kwargs)

    async def run() -> None:
        monkeypatch.setattr(worker.prefix_cache, "prepare", failing_prepare)
        kind, error = await outcome(12)
        assert kind == "error" and "injected start fault" in str(error)
        kind, done = await outcome(12)
        assert kind == "done" and list(done.result.tokens) == list(alone)
        monkeypatch.setattr(SharedForwards, "step", failing_step)
        both = await asyncio.gather(outcome(400), outcome(400))
        assert steps_failed
        for kind, error in both:
            assert kind == "error" and isinstance(error, EngineError), (kind, error)
            assert "injected batch fault" in str(error)
        kind, done = await outcome(12)
        assert kind == "done" and list(done.result.tokens) == list(alone)

    worker.start()
    try:
        asyncio.run(run())
    finally:
        worker.join(30)
    assert not worker._thread.is_alive()
