"""Generations decoded together (``Model.generate_batch``,
:mod:`forerun.generation.batch`): each result is what ``generate`` gives
for that request alone, token for token, greedy and sampled with a seed,
plain, with prompt lookup and with suffix drafting, whatever joins or leaves beside it; a
kernel whose rounding depends on the row count, unmeasured, makes that
comparison fail; one request's error is its own."""

from __future__ import annotations

import threading

import pytest
import torch

import forerun
from forerun.errors import ConfigError, ContextLengthError, GenerationConfigError
from forerun.generation.batch import SHARED_LAST_ONLY, SharedForwards, run_batch
from tiny_models import VOCAB, hf_folders

PROMPTS = ["a b c a b c a b", "hello there", "x", "one two three four five six seven",
           "the the the the", "zz y zz y zz", "q", "lorem ipsum dolor sit amet"]
# Lengths that end generations at different steps: joins and leaves mid-way.
LENGTHS = [12, 3, 20, 7, 16, 1, 9, 14]
# A prompt's feed too long to join a step's shared forward (SHARED_LAST_ONLY)
LONG_PREFILL = list(range(1, SHARED_LAST_ONLY + 3))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder, = hf_folders(tmp_path_factory, (5,))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FORERUN_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield forerun.load(folder, context_length=128, device="cpu", weights="q8")


@pytest.fixture()
def native_model(tmp_path_factory, monkeypatch):
    """The same model on forerun's native kernels, whatever a timing here
    judges: what needs their exact positions (a prompt's last tokens in the
    shared forward, prefixes reused) must not be left to that timing, which
    the suite takes beside the other worker's tests (in one CI run, under
    load, it gave torch's products and these tests failed).  The kernels'
    loaded state is put back after, for the module's other tests."""
    from forerun.kernels import native

    kept = dict(native._state)
    monkeypatch.setenv(native.SWITCH, "1")
    native.reset()
    try:
        if native.native_kernels() is None:
            pytest.skip(f"forerun's native kernels don't run here: {native.unavailable_reason()}")
        folder, = hf_folders(tmp_path_factory, (5,))
        monkeypatch.setenv("FORERUN_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield forerun.load(folder, context_length=128, device="cpu", weights="q8")
    finally:
        native.reset()
        native._state.update(kept)


def _requests(**extra) -> list[dict]:
    return [{"prompt": p, "max_new_tokens": n, "ignore_eos": True, **extra}
            for p, n in zip(PROMPTS, LENGTHS)]


def _alone(model, requests, **common) -> list[list[int]]:
    out = []
    for request in requests:
        arguments = {**common, **request}
        prompt = arguments.pop("prompt")
        out.append(model.generate(prompt, **arguments).tokens)
    return out


@pytest.mark.parametrize("draft", [None, "ngram", "suffix"])
@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("parallel", [3, 8])
def test_each_result_is_the_requests_own(model, draft, sampled, parallel):
    sampling = {"temperature": 0.9, "top_p": 0.95} if sampled else {}
    requests = [dict(r, seed=100 + n) for n, r in enumerate(_requests(**sampling))]
    want = _alone(model, requests, draft=draft)
    got = model.generate_batch(requests, draft=draft, parallel=parallel)
    assert [r.tokens for r in got] == want
    if draft is not None:     # (drafts of a point mass: plain decoding's very draws)
        assert want == _alone(model, requests)
    assert [len(r.tokens) for r in got] == LENGTHS
    assert all(r.finish_reason == "length" for r in got)


def test_suffix_drafting_remembers_requests_alone_and_in_batches(model):
    """One store per model: a request answered alone is drafted from when
    it comes again in a batch, and the answers stay plain decoding's."""
    model.suffix_store().clear()
    request = dict(prompt="lorem ipsum dolor sit amet", max_new_tokens=30, ignore_eos=True)
    plain = model.generate(**request).tokens
    first = model.generate(**request, draft="suffix")
    again = model.generate_batch([request, dict(request, prompt="x y")], draft="suffix",
                                 parallel=2)
    assert first.tokens == again[0].tokens == plain
    s = again[0].stats
    assert s.drafted >= 20 and s.accepted == s.drafted
    assert s.rounds < first.stats.rounds or first.stats.accepted == first.stats.drafted
    model.suffix_store().clear()
    assert model.generate(**request, draft="suffix").tokens == plain


def test_requests_in_every_form_keep_their_order(model):
    chat = [{"role": "user", "content": "hi"}]
    got = model.generate_batch(["a b", chat, {"prompt_ids": [5, 6, 7]}],
                               max_new_tokens=4, ignore_eos=True)
    assert [r.tokens for r in got] == [model.generate("a b", max_new_tokens=4,
                                                      ignore_eos=True).tokens,
                                       model.generate(messages=chat, max_new_tokens=4,
                                                      ignore_eos=True).tokens,
                                       model.generate(prompt_ids=[5, 6, 7], max_new_tokens=4,
                                                      ignore_eos=True).tokens]
    assert model.generate_batch([]) == []


def test_a_row_count_dependent_kernel_unmeasured_changes_the_results(model, monkeypatch):
    """The broken twin: with every sequence in one forward regardless of
    what the probe measured, a kernel whose rounding depends on the row
    count makes the batch's tokens differ from the requests alone."""
    network = model.decoder.model
    requests = _requests(temperature=0.9, seed=7)
    saved = [layer.down for layer in network.layers]

    class RowCount:
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, x):
            return self.inner(x) + 0.5 * (x.shape[0] - 1)

    try:
        for layer in network.layers:
            layer.down = RowCount(layer.down)
        model.decoder.verify_group = 1
        want = _alone(model, requests)
        monkeypatch.setattr(type(model), "verification_grouping", lambda self: None)
        model.decoder.verify_group = None
        got = model.generate_batch(requests, parallel=8)
        assert [r.tokens for r in got] != want
    finally:
        for layer, down in zip(network.layers, saved):
            layer.down = down
        model._grouping = None
        monkeypatch.undo()
        model.verification_grouping()


def test_bad_requests_are_refused_before_any_runs(model):
    with pytest.raises(GenerationConfigError, match="request 1"):
        model.generate_batch(["a", {"prompt": "b", "max_new_tokens": -1}], max_new_tokens=4)
    with pytest.raises(GenerationConfigError, match="request 0.*'ngram'|not draft"):
        model.generate_batch(["a"], draft="medusa", max_new_tokens=4)
    with pytest.raises(GenerationConfigError, match="unknown argument 'max_tokens'"):
        model.generate_batch([{"prompt": "a", "max_tokens": 3}], max_new_tokens=4)
    for name in ("unknown", "self"):       # stream's own parameter names are not arguments
        with pytest.raises(GenerationConfigError, match=f"unknown argument '{name}'"):
            model.generate_batch([{"prompt": "a", name: 1}], max_new_tokens=4)
    member = SharedForwards(model.decoder).member()
    with pytest.raises(GenerationConfigError, match="unknown argument 'unknown'"):
        model.stream_in_batch(member, "a", unknown=1, max_new_tokens=2)
    with pytest.raises(ContextLengthError, match="request 0"):
        model.generate_batch(["a"], max_new_tokens=500)
    for parallel in (0, -1, 1.5, True, "2"):
        with pytest.raises(GenerationConfigError, match="parallel"):
            model.generate_batch(["a"], parallel=parallel, max_new_tokens=4)
    for requests in ("a", {"prompt": "a"}, [3]):
        with pytest.raises(GenerationConfigError):
            model.generate_batch(requests, max_new_tokens=4)


def test_a_failing_generation_leaves_the_others_running(model):
    decoder = model.decoder
    calls = []

    def good(member):
        member.feed([1, 2, 3], last_only=True)
        return [int(member.feed([4]).logits.argmax()) for _ in range(5)]

    def bad(member):
        member.feed([1], last_only=True)
        member.feed([VOCAB])        # not a token: this job's own error
        return None

    jobs = [good, bad, good, good]
    with pytest.raises(Exception, match="token ids must lie"):
        run_batch(decoder, [lambda m, j=j: calls.append(j(m)) or j.__name__ for j in jobs], 2)
    assert len(calls) == 3 and calls[0] == calls[1] == calls[2]


def test_members_share_forwards_and_wait_for_each_other(model):
    forwards = SharedForwards(model.decoder)
    seen = []

    def job(member):
        member.feed(LONG_PREFILL, last_only=True)
        for _ in range(4):
            member.feed([3])
        seen.append(threading.current_thread().name)
        return member.length

    assert run_batch(model.decoder, [job] * 4, 4, forwards=forwards) == [len(LONG_PREFILL) + 4] * 4
    # Four prefills alone, then four steps of four sequences in one feed.
    assert sorted(forwards.steps[-4:]) == [(4, 0)] * 4
    assert sum(alone for _, alone in forwards.steps) == 4
    assert len(set(seen)) == 4
    with pytest.raises(Exception, match="threads"):
        forwards.member().set_threads(1)
    with pytest.raises(ConfigError, match="not running"):
        forwards.member().feed([1])            # never joined: nothing would compute it
    torch.set_num_threads(torch.get_num_threads())


def test_a_prompts_last_few_tokens_join_the_shared_forward(native_model, monkeypatch):
    """A last_only feed of at most SHARED_LAST_ONLY tokens (what a warm
    prompt leaves to read) runs in the step's shared forward instead of
    alone while the others wait, where the engine computes positions alike
    however fed, and gives the logits and cache a feed alone gives, to the
    bit; on an engine that doesn't, it runs alone."""
    from forerun.engines.torch_engine import TorchDecoder

    model = native_model
    assert model.decoder.exact_positions      # (the native kernels)
    prompts = [[5, 6, 7], [8], list(range(9, 9 + SHARED_LAST_ONLY))]

    def job(member, prompt):
        return member.feed(prompt, last_only=True).logits, member.feed([3]).logits

    def run():
        forwards = SharedForwards(model.decoder)
        got = run_batch(model.decoder, [lambda m, p=p: job(m, p) for p in prompts], 3,
                        forwards=forwards)
        return got, forwards.steps

    got, steps = run()
    assert steps == [(3, 0), (3, 0)]
    for prompt, (first, step) in zip(prompts, got):
        alone = model.decoder.fork()
        want_first = alone.feed(prompt, last_only=True).logits
        assert first.shape == want_first.shape == (1, model.decoder.vocab_size)
        assert torch.equal(first, want_first) and torch.equal(step, alone.feed([3]).logits)
    monkeypatch.setattr(TorchDecoder, "exact_positions", property(lambda self: False))
    assert run()[1] == [(0, 3), (3, 0)]


def test_with_keep_caches_a_job_runs_on_an_ended_jobs_decoder(model):
    """keep_caches: a job runs on the member of a job that ended well, its
    cache as that job left it; a job that raised leaves its member behind
    (the next starts on a new, empty fork); without keep_caches every job
    starts on an empty one."""
    seen: list[tuple[object, int]] = []

    def job(member, fail=False):
        seen.append((member, member.length))
        member.feed([1, 2, 3], last_only=True)
        if fail:
            raise ValueError("this job's own error")
        return member.length

    jobs = [job, job, lambda m: job(m, fail=True), job]
    with pytest.raises(ValueError, match="own error"):
        run_batch(model.decoder, jobs, 1, keep_caches=True)
    assert [n for _, n in seen] == [0, 3, 6, 0]
    assert seen[0][0] is seen[1][0] is seen[2][0]
    seen.clear()
    assert run_batch(model.decoder, [job] * 3, 1) == [3] * 3
    assert [n for _, n in seen] == [0, 0, 0]


def test_a_batch_reads_a_shared_prompt_prefix_once_per_slot(native_model):
    """generate_batch's requests run on the slots of the ones that ended
    before them, so a prompt prefix they share (a system prompt) is read
    once per slot, and each result is still the request's own."""
    model = native_model
    common = "one two three four five six seven eight nine ten " * 2
    requests = [{"prompt": common + tail, "max_new_tokens": 4, "ignore_eos": True}
                for tail in ("a", "b c", "d", "e f", "g")]
    want = _alone(model, requests)
    got = model.generate_batch(requests, parallel=2)
    assert [r.tokens for r in got] == want
    reused = [r.stats.reused_prompt_tokens for r in got]
    assert reused[:2] == [0, 0] and min(reused[2:]) >= 20


def _batch_threads() -> set[threading.Thread]:
    """The batch members' threads alive now."""
    return {t for t in threading.enumerate() if t.name.startswith("forerun-batch")}


def _assert_ended(threads: set[threading.Thread]) -> None:
    """Every one of ``threads`` ends within 30 s: none waits for ever."""
    for t in threads:
        t.join(30)
        assert not t.is_alive(), t.name


def test_a_step_waits_for_the_slot_a_member_left_before_the_caller_saw_it(model):
    """A member that left after its caller last looked (``left``: the
    leaves it has seen) makes the step return so the slot is filled, where
    the step would otherwise run the others without it (a batch of 2 of 3
    slots under load, run_pool's race)."""
    forwards = SharedForwards(model.decoder)
    a, b = forwards.member(), forwards.member()
    forwards.join(a)
    forwards.join(b)
    seen = forwards.leaves
    forwards.leave(b)                       # ended between the caller's look and the step
    fed = []
    thread = threading.Thread(target=lambda: fed.append(a.feed([3])))
    thread.start()
    assert forwards.step(left=seen) is False and not fed
    assert forwards.step(left=seen + 1) is True        # its end taken: a computes alone
    thread.join()
    assert len(fed) == 1 and forwards.steps == [(1, 0)]
    forwards.leave(a)


def test_prefills_alone_run_shortest_first_and_wake_their_generation_at_once(model):
    """Prompts read in one step run the shortest first, and each generation
    is woken when its own prefill is done, not when the step's last is: the
    short prompt's generation takes its logits while the long one is read
    (its time to first token is its own prefill's)."""
    forwards = SharedForwards(model.decoder)
    woken = threading.Event()
    order: list[int] = []
    waited: list[bool] = []

    def job(member, length: int):
        feed = member.inner.feed

        def timed_feed(tokens, **kw):
            order.append(len(tokens))
            if len(tokens) == 24:       # the long prompt: the short one's generation runs
                waited.append(woken.wait(30))
            return feed(tokens, **kw)

        member.inner.feed = timed_feed
        member.feed(list(range(1, length + 1)), last_only=True)
        if length == 10:
            woken.set()
        return member.length

    jobs = [lambda m: job(m, 24), lambda m: job(m, 10)]
    assert run_batch(model.decoder, jobs, 2, forwards=forwards) == [24, 10]
    assert order == [10, 24] and waited == [True]
    assert forwards.steps == [(0, 2)]


def test_an_interrupt_inside_a_shared_forward_leaves_no_generation_waiting(
        model, monkeypatch):
    """Ctrl-C while the engine thread computes a step's shared forward: the
    members whose feeds that step took (no longer waiting to be taken)
    end too, with an EngineError, instead of waiting for ever."""
    from forerun.engines.torch_engine import TorchDecoder
    from forerun.errors import EngineError

    calls = []

    def interrupted(self, feeds):
        calls.append(len(feeds))
        raise KeyboardInterrupt

    monkeypatch.setattr(TorchDecoder, "feed_batch", interrupted)
    forwards = SharedForwards(model.decoder)
    ended: list[BaseException] = []

    def job(member):
        member.feed(LONG_PREFILL, last_only=True)
        try:
            member.feed([3])
        except EngineError as e:
            ended.append(e)
            raise
        return member.length

    before = _batch_threads()
    with pytest.raises(KeyboardInterrupt):
        run_batch(model.decoder, [job] * 3, 3, forwards=forwards)
    _assert_ended(_batch_threads() - before)
    assert calls == [3] and len(ended) == 3
    assert all("engine thread stopped" in str(e) for e in ended)


def test_prompt_lookup_in_a_batch_takes_the_costs_measured_alone(model, monkeypatch):
    """Its members never time forwards inside the batch (their timings hold
    the others' forwards) and never store what they refine: every measure
    and store happens on the engine thread, once."""
    from forerun.machine.calibration import CalibrationStore
    from forerun.speculation.config import resolve

    engine = threading.current_thread()
    saves, measures = [], []
    save, measuring = CalibrationStore.save, CalibrationStore.measuring
    monkeypatch.setattr(CalibrationStore, "save", lambda self, *a, **k: (
        saves.append(threading.current_thread()), save(self, *a, **k))[1])
    monkeypatch.setattr(CalibrationStore, "measuring", lambda self, *a, **k: (
        measures.append(threading.current_thread()), measuring(self, *a, **k))[1])
    from forerun.decoding.draft_length import VerifyCosts

    calibrate = VerifyCosts.calibrate
    monkeypatch.setattr(VerifyCosts, "calibrate", lambda self, *a, **k: (
        measures.append(threading.current_thread()), calibrate(self, *a, **k))[1])
    model._methods.pop(("batch-costs", resolve("ngram", draft_k=None).key), None)
    results = model.generate_batch(_requests(), draft="ngram", parallel=4)
    assert [len(r.tokens) for r in results] == LENGTHS
    assert all(t is engine for t in saves + measures)
    forwards = SharedForwards(model.decoder)
    member = forwards.member()
    with pytest.raises(ConfigError, match="batch_costs"):
        model.stream_in_batch(member, "a b", draft="ngram", draft_k=3, max_new_tokens=2)


def test_an_interrupted_batch_leaves_no_generation_waiting(model):
    """Ctrl-C on the engine thread (an on_result callback raising here):
    the call raises it, every member thread ends (its next feed raises an
    EngineError) instead of waiting for ever, and the model serves the
    next batch exactly."""
    from forerun.errors import EngineError

    before = _batch_threads()
    errors = []

    def interrupt(n, result):
        raise KeyboardInterrupt

    original = run_batch.__globals__["SharedForwards"].close

    def close(self, error):
        errors.append(error)
        original(self, error)

    import forerun.generation.batch as batch

    batch.SharedForwards.close = close
    try:
        with pytest.raises(KeyboardInterrupt):
            model.generate_batch(_requests(), parallel=4, on_result=interrupt)
    finally:
        batch.SharedForwards.close = original
    assert len(errors) == 1 and isinstance(errors[0], KeyboardInterrupt)
    _assert_ended(_batch_threads() - before)
    forwards = SharedForwards(model.decoder)
    forwards.close(RuntimeError("stopped"))
    member = forwards.member()
    forwards.join(member)
    with pytest.raises(EngineError, match="engine thread stopped"):
        member.feed([1])
    requests = _requests()
    assert [r.tokens for r in model.generate_batch(requests, parallel=3)] == _alone(model,
                                                                                   requests)
