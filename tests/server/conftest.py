"""Live servers for the server tests: ``forerun serve`` started as a real
process on 127.0.0.1 (a free port), reached with the official ``openai``
client and with raw HTTP.

The servers run the real preset ``smollm2-135m`` and are shared by the
whole session: ``server`` (torch, prompt lookup by default, an API key, the
prefix cache with a small bound, as many requests at a time as the machine
measures), ``cold_server`` (the same one request at a time, without any
prefix reuse and with a queue of one) and ``draft_server`` (the model as
its own draft model, drafting trees by default).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

# The test extra installs these: a missing one is an error, not a skip.
import openai  # noqa: E402
import prometheus_client  # noqa: E402,F401
import pytest
import starlette  # noqa: E402,F401
import uvicorn  # noqa: E402,F401

API_KEY = "test-key"
MODEL = "smollm2-135m"
CONTEXT = 1024
# Bytes of one cached position of smollm2-135m on the torch engine (30
# layers, 3 KV heads of 64, float32 keys and values), and the prefix-cache
# bound of `server`: room for one saved prefix of two 128-position blocks.
POSITION_BYTES = 30 * 3 * 64 * 2 * 4
PREFIX_CACHE_MB = 13
START_TIMEOUT = 600
# A fixed weight format: "auto" would measure every format on a fresh cache.
WEIGHTS = "float32"


class LiveServer:
    """A ``forerun serve`` process; ``url`` is its ``/v1`` base URL once it
    has printed it (which it does when it accepts connections)."""

    def __init__(self, *args: str) -> None:
        self.args = list(args)
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "forerun.cli.main", "serve", "--port", "0", "-q",
             *self.args], stdout=subprocess.PIPE, stderr=self.stderr, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.url = self._wait_for_url()
        match = re.match(r"http://([^:/]+):(\d+)/v1", self.url)
        self.host, self.port = match.group(1), int(match.group(2))
        # Keep reading stdout, so the pipe never fills.
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    def _wait_for_url(self) -> str:
        found: list[str] = []

        def read() -> None:
            for line in self.proc.stdout:
                m = re.search(r"serving .* at (http://\S+)", line)
                if m:
                    found.append(m.group(1))
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(START_TIMEOUT)
        if not found:
            self.proc.kill()
            self.proc.wait(30)
            pytest.fail(f"forerun serve did not start: {self.read_stderr()[-3000:]}")
        return found[0]

    def read_stderr(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()

    # -- clients -----------------------------------------------------------
    def client(self, api_key: str = API_KEY, **kwargs):
        return openai.OpenAI(base_url=self.url, api_key=api_key, max_retries=0,
                             timeout=kwargs.pop("timeout", 300), **kwargs)

    def request(self, method: str, path: str, body=None, headers=None,
                key: str | None = API_KEY) -> tuple[int, dict | str]:
        """Raw HTTP: the status and the decoded JSON body (or text)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=300)
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        if key is not None:
            hdrs["Authorization"] = f"Bearer {key}"
        if body is not None and not isinstance(body, (bytes, str)):
            body = json.dumps(body)
        try:
            conn.request(method, path, body=body, headers=hdrs)
            resp = conn.getresponse()
            data = resp.read().decode("utf-8")
        finally:
            conn.close()
        try:
            return resp.status, json.loads(data)
        except ValueError:
            return resp.status, data

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``{'name{labels}': value}``."""
        status, text = self.request("GET", "/metrics", key=None)
        assert status == 200
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def health(self) -> dict:
        status, body = self.request("GET", "/health", key=None)
        assert status == 200
        return body

    def wait_until(self, predicate, what: str, tries: int = 240, pause: float = 0.25):
        """Poll ``predicate()`` until it is true, a bounded number of times."""
        for _ in range(tries):
            value = predicate()
            if value:
                return value
            time.sleep(pause)
        pytest.fail(f"timed out waiting for {what}")

    def stop(self, sig=signal.SIGTERM, timeout: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        return self.proc.returncode


def _start(preset_gguf, *args: str) -> LiveServer:
    preset_gguf(MODEL)   # skip (or fail in CI) without the preset
    return LiveServer("-m", MODEL, "--weights", WEIGHTS, "--context-length", str(CONTEXT),
                      "--api-key", API_KEY, *args)


@pytest.fixture(scope="session")
def server(preset_gguf):
    srv = _start(preset_gguf, "--draft", "ngram", "--max-queue", "40",
                 "--prefix-cache-mb", str(PREFIX_CACHE_MB))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def draft_server(preset_gguf):
    """The model drafting for itself (a second copy loaded as its draft
    model), with a draft-model tree as the server's default shape."""
    srv = _start(preset_gguf, "--draft", MODEL, "--draft-tree", "--max-queue", "4")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def cold_server(preset_gguf):
    srv = _start(preset_gguf, "--draft", "ngram", "--no-prefix-cache", "--max-queue", "1",
                 "--parallel", "1")
    yield srv
    srv.stop()


def greedy(client, messages=None, prompt=None, max_tokens=12, **extra):
    """A greedy chat (``messages``) or completion (``prompt``) request."""
    if messages is not None:
        return client.chat.completions.create(model=MODEL, messages=messages,
                                              max_tokens=max_tokens, temperature=0, **extra)
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, **extra)


def text_of(response) -> str:
    choice = response.choices[0]
    return choice.message.content if hasattr(choice, "message") else choice.text


def streamed(stream) -> tuple[str, list, list]:
    """The text, the chunks with choices, and all chunks of a stream."""
    chunks = list(stream)
    pieces = []
    for c in chunks:
        if c.choices:
            choice = c.choices[0]
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            pieces.append(piece or "")
    return "".join(pieces), [c for c in chunks if c.choices], chunks
