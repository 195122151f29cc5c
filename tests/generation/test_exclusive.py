"""One generation at a time per model (forerun.generation.exclusive, through
forerun.Model): threads sharing a model get exactly their serial outputs,
a second open stream in one thread is refused with ModelBusyError, and an
abandoned stream never touches a cache that another generation uses.

Each test fails on a Model without the lock: generations interleave on one
KV cache and produce other tokens, or fail with "cannot roll back"."""

from __future__ import annotations

import gc
import inspect
import threading

import pytest

import forerun
from forerun.errors import ForerunError, ModelBusyError
from forerun.generation.exclusive import GenerationLock, Holds
from tiny_models import hf_folders

PROMPTS = ["hello world", "the quick brown fox", "jumps over the lazy dog", "hello fox"]
METHODS = [None, "ngram", "draft"]


# A fixed weight format where load() offers a choice ("auto" measures them).
FLOAT32 = ({"weights": "float32"} if "weights" in inspect.signature(forerun.load).parameters
           else {})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny target and a tiny draft model sharing its tokenizer."""
    loaded = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FORERUN_CACHE", str(tmp_path_factory.mktemp("cache")))
        for folder in hf_folders(tmp_path_factory, (3, 4)):
            loaded.append(forerun.load(folder, context_length=128, device="cpu", **FLOAT32))
    return loaded


@pytest.fixture(autouse=True)
def no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))


def request(models, i: int, method, n: int = 8) -> dict:
    target, draft = models
    kwargs = dict(prompt=PROMPTS[i % len(PROMPTS)], max_new_tokens=n, ignore_eos=True)
    if method == "draft":
        kwargs.update(draft=draft, draft_k=3)
    elif method is not None:
        # A fixed draft length: sampled outputs depend on it.
        kwargs.update(draft=method, draft_k=2)
    if i % 2:
        kwargs.update(temperature=0.8, seed=i)
    return kwargs


def test_threads_get_their_serial_outputs(models):
    """N threads x M generations (plain, prompt lookup, a draft model;
    greedy and sampled) on one model, while the draft model also generates
    on its own: each output is the serial one."""
    target, draft = models
    jobs = [(i, m) for i in range(2) for m in METHODS]
    serial = {job: target.generate(**request(models, *job)).tokens for job in jobs}
    serial_draft = {i: draft.generate(**request(models, i, None)).tokens for i in range(2)}
    got: list = []
    errors: list = []

    def worker(w: int) -> None:
        try:
            for k in range(len(jobs)):
                job = jobs[(k + w) % len(jobs)]
                got.append((serial[job], target.generate(**request(models, *job)).tokens))
                if k % 3 == w % 3:
                    got.append((serial_draft[w % 2],
                                draft.generate(**request(models, w % 2, None)).tokens))
        except BaseException as exc:   # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(got) == 3 * len(jobs) + 6
    assert all(expected == output for expected, output in got)


def test_streams_consumed_in_two_threads(models):
    """Two threads consuming streams delta by delta: the second waits for
    the first instead of sharing its cache."""
    target, _ = models
    expected = [target.generate(**request(models, i, "ngram")).tokens for i in range(2)]
    results: list = [None, None]

    def consume(i: int) -> None:
        stream = target.stream(**request(models, i, "ngram"))
        for _ in stream:
            pass
        results[i] = stream.result.tokens

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == expected


def test_second_open_stream_in_one_thread_is_refused(models):
    target, _ = models
    expected = target.generate(**request(models, 0, "ngram")).text
    first = target.stream(**request(models, 0, "ngram"))
    second = target.stream(**request(models, 1, "ngram"))   # nothing runs yet
    text = next(first)
    with pytest.raises(ModelBusyError, match="still open"):
        next(second)
    text += "".join(first)     # the first stream is undisturbed
    assert text == expected
    # Once the first stream ended, the model is free again.
    assert target.generate(**request(models, 1, "ngram")).tokens


def test_closed_stream_frees_the_model(models):
    target, _ = models
    expected = target.generate(**request(models, 2, None)).tokens
    with target.stream(**request(models, 1, None)) as stream:
        next(stream)
    assert stream.result is None
    assert target.generate(**request(models, 2, None)).tokens == expected


def test_abandoned_stream_never_touches_the_next_generation(models):
    """A stream left unfinished in a reference cycle is collected while
    another generation runs: its clean-up must not roll back the cache the
    other generation now uses."""
    target, _ = models
    expected = target.generate(**request(models, 3, "ngram", n=24)).tokens
    gc.disable()                   # collect exactly when the test says
    try:
        assert_untouched_by_abandoned_stream(models, expected)
    finally:
        gc.enable()


def assert_untouched_by_abandoned_stream(models, expected) -> None:
    target, _ = models
    cycle: list = []
    cycle.append(cycle)
    # The same prompt: its clean-up would roll back to a length above the
    # next generation's committed floor, so nothing would stop it.
    cycle.append(target.stream(**request(models, 3, "ngram", n=24)))
    next(cycle[1])
    del cycle                      # unreachable, but not collected yet
    stream = target.stream(**request(models, 3, "ngram", n=24))
    for k, _ in enumerate(stream):
        if k == 2:                 # a few positions past the abandoned one's
            held = target.decoder.length
            gc.collect()           # its clean-up runs here
            assert target.decoder.length == held
    assert stream.result.tokens == expected


def test_busy_error_is_a_forerun_error():
    assert issubclass(ModelBusyError, ForerunError)


def test_stale_token_releases_nothing():
    lock = GenerationLock("m")
    first = lock.acquire()
    lock.release(first)
    second = lock.acquire()
    lock.release(first)            # late clean-up of the first hold
    assert lock.held and lock.holds(second)
    lock.release(second)
    assert not lock.held


def test_holds_take_locks_in_one_order():
    """Two generations sharing two models in opposite roles can't deadlock:
    both take the locks in creation order."""
    a, b = GenerationLock("a"), GenerationLock("b")
    done = []

    def run(locks) -> None:
        for _ in range(200):
            with Holds(locks):
                pass
        done.append(True)

    threads = [threading.Thread(target=run, args=([a, b],)),
               threading.Thread(target=run, args=([b, a],))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert done == [True, True]
