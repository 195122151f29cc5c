"""One engine, many clients: concurrent requests are served one at a time,
none lost or mixed; a client that disconnects cancels its generation; a
full queue answers 503; a signal stops the server cleanly."""

import http.client
import json
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from conftest import API_KEY, MODEL, LiveServer, greedy, streamed, text_of

pytestmark = pytest.mark.real_model

CLIENTS = 8
REQUESTS = 4
TOPICS = ["apples", "rivers", "trains", "music", "the moon", "bread", "chess", "rain"]


def _request(client, i: int, j: int) -> str:
    """Client ``i``'s ``j``-th request: chat or completion, streamed or not
    (the same text either way)."""
    topic = TOPICS[i]
    stream = (i + j) % 2 == 1
    if i % 2 == 0:
        r = greedy(client, [{"role": "user", "content": f"Write one line about {topic}."}],
                   max_tokens=6, stream=stream)
    else:
        r = greedy(client, prompt=f"A short note on {topic}:", max_tokens=6, stream=stream)
    return streamed(r)[0] if stream else text_of(r)


def test_concurrent_clients_each_get_their_own_complete_answer(server):
    client = server.client()
    alone = {i: _request(client, i, 0) for i in range(CLIENTS)}
    assert len(set(alone.values())) == CLIENTS       # eight different answers
    before = server.metrics()
    barrier = threading.Barrier(CLIENTS)

    def run_client(i):
        c = server.client()
        barrier.wait(60)
        return [_request(c, i, j) for j in range(REQUESTS)]

    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(run_client, range(CLIENTS)))
    for i, answers in enumerate(results):
        assert answers == [alone[i]] * REQUESTS, i
    after = server.metrics()
    served = sum(after.get(f'forerun_requests_total{{endpoint="{e}",status="200"}}', 0)
                 - before.get(f'forerun_requests_total{{endpoint="{e}",status="200"}}', 0)
                 for e in ("chat", "completions"))
    assert served == CLIENTS * REQUESTS
    assert server.health()["queue_depth"] == 0


def _open_stream(srv: LiveServer, max_tokens: int = 400):
    """A raw streamed completion that generates long; returns the open
    connection and its response after the first event arrived."""
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=300)
    body = {"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Authorization": f"Bearer {API_KEY}",
                          "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")
    return conn, resp


def _drop(conn, resp) -> None:
    conn.sock.shutdown(socket.SHUT_RDWR)
    resp.close()
    conn.close()


def _cancelled(srv) -> float:
    return srv.metrics().get('forerun_generations_total{finish_reason="cancelled"}', 0)


def test_a_client_that_disconnects_cancels_its_generation(server):
    client = server.client()
    reference = text_of(greedy(client, prompt="The capital of Italy is", max_tokens=12))
    cancelled = _cancelled(server)
    generated = server.metrics().get("forerun_generated_tokens_total", 0)
    conn, resp = _open_stream(server, max_tokens=900)
    for _ in range(3):
        resp.readline()
    _drop(conn, resp)                   # the client goes away mid-stream
    server.wait_until(lambda: _cancelled(server) > cancelled, "the cancellation")
    assert server.metrics()["forerun_generated_tokens_total"] - generated < 900
    assert server.health()["in_flight"] == 0
    again = greedy(client, prompt="The capital of Italy is", max_tokens=12)
    assert text_of(again) == reference


def test_a_full_queue_answers_503(cold_server):
    """``cold_server`` queues one request: with one running and one waiting,
    the next gets 503, and the waiting one is then served."""
    srv = cold_server
    client = srv.client()
    reference = text_of(greedy(client, prompt="Once upon a time", max_tokens=6))
    conn, resp = _open_stream(srv)      # in flight
    waiting = {}
    thread = threading.Thread(target=lambda: waiting.setdefault(
        "r", greedy(srv.client(), prompt="Once upon a time", max_tokens=6)))
    thread.start()
    srv.wait_until(lambda: srv.health()["queue_depth"] == 1, "the queued request")
    with pytest.raises(openai.APIStatusError) as err:
        greedy(client, prompt="Once upon a time", max_tokens=6)
    assert err.value.status_code == 503
    assert err.value.body["code"] == "queue_full"
    assert err.value.body["type"] == "server_error"
    _drop(conn, resp)
    thread.join(300)
    assert text_of(waiting["r"]) == reference


@pytest.mark.exclusive_cpu           # a server on the llama.cpp engine
def test_sigterm_cancels_the_request_in_flight_and_exits(preset_gguf):
    """A signal: the streamed request in flight ends with an error event
    after its text so far, a waiting one gets 503, and the process exits
    with the status of a terminated command (143) and no traceback."""
    preset_gguf(MODEL)
    srv = LiveServer("-m", MODEL, "--engine", "llama.cpp", "--context-length", "1024",
                     "--draft", "none")
    try:
        client = srv.client(api_key="unused")
        stream = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=900,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = iter(stream)
        first = next(chunks)
        assert first.choices[0].text is not None
        waiting = {}

        def wait_in_queue():
            try:
                greedy(srv.client(api_key="unused"), prompt="Hello", max_tokens=4)
            except openai.APIStatusError as exc:
                waiting["status"] = exc.status_code

        thread = threading.Thread(target=wait_in_queue)
        thread.start()
        srv.wait_until(lambda: srv.health()["queue_depth"] == 1, "the queued request")
        srv.proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError) as err:
            for _ in chunks:
                pass
        assert "shutting down" in str(err.value)
        thread.join(120)
        assert waiting == {"status": 503}
        assert srv.proc.wait(120) == 143
    finally:
        srv.stop(signal.SIGKILL)
    assert "Traceback" not in srv.read_stderr()
