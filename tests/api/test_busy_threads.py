"""A long-running process's thread count follows the machine's load: all of
the model's threads while the machine is idle, fewer while other processes
hold cores, and only counts the grouping probe found exact, so an answer
never depends on the load."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch

import forerun.api.busy_threads as busy_threads
from forerun.api.busy_threads import ThreadsForLoad
from forerun.machine.machine_load import Conditions
from forerun.protocol.grouping_probe import GroupingResult


def fake_model(own: int, exact: dict[int, int], verify_group: int = 4):
    """A model of ``own`` threads whose probe finds ``exact[n]`` the exact
    group on ``n`` threads; it counts the probes asked."""
    asked: list[int] = []

    def measured_grouping(n):
        asked.append(n)
        group = exact.get(n, 0)
        return GroupingResult(group, 16, None if group else 1, 0.0 if group else 0.5, (32,))

    decoder = SimpleNamespace(threads=own)
    own_group = GroupingResult(verify_group, 16, verify_group + 1, 0.5, (32,))
    return SimpleNamespace(decoder=decoder, measured_grouping=measured_grouping, asked=asked,
                           verification_grouping=lambda: own_group)


def test_fewer_threads_only_while_busy_and_only_counts_found_exact():
    model = fake_model(4, {3: 16, 2: 0, 1: 8})
    threads = ThreadsForLoad(model)
    assert threads.prepare() == [3, 1]
    assert threads.choose(0.0) == threads.choose(0.5) == 4      # idle, or a client: all
    assert threads.choose(1.0) == 3                             # one core taken
    assert threads.choose(2.0) == 1                             # 2 would differ: 1
    assert threads.choose(9.0) == 1                             # at least one
    assert sorted(model.asked) == [1, 2, 3]                     # each probed once


def test_a_count_exact_only_for_shorter_groups_than_the_engine_verifies_is_not_used():
    threads = ThreadsForLoad(fake_model(2, {1: 2}, verify_group=4))
    assert threads.prepare() == []
    assert threads.choose(1.0) == 2            # keeps its own: 1 thread is not exact enough
    enough = ThreadsForLoad(fake_model(2, {1: 4}, verify_group=4))
    assert enough.choose(1.0) == 2             # not probed: never used
    assert enough.prepare() == [1] and enough.choose(1.0) == 1


def test_the_sampler_follows_the_machine_and_the_switch_turns_it_off(monkeypatch):
    seen = iter([])

    def conditions(self):
        return Conditions(next(seen), 0.01, None, 2)

    monkeypatch.setattr(busy_threads.LoadMeter, "conditions", conditions)
    monkeypatch.setattr(busy_threads, "SAMPLE_EVERY", 0.01)
    threads = ThreadsForLoad(fake_model(2, {1: 16}))
    threads.prepare()
    assert threads.threads_now() == 2                  # nothing sampled yet
    seen = iter([None, 1.0, 0.1, 1.0] + [1.0] * 30 + [0.0] * 1000)

    def reaches(count: int) -> bool:
        for _ in range(5000):
            if threads.threads_now() == count:
                return True
            time.sleep(0.001)
        return False

    threads.start()
    try:
        assert reaches(1)                              # another process took a core
        assert threads._other == 1.0                   # (two samples running: not 1.0, 0.1)
        assert reaches(2)                              # idle again
    finally:
        threads.close()
    monkeypatch.setenv("FORERUN_THREADS_FOLLOW_LOAD", "0")
    off = ThreadsForLoad(fake_model(2, {1: 16}))
    assert off.prepare() == [] and off.choose(1.0) == 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import forerun
    from tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path_factory.mktemp("busy") / "tiny.gguf")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield forerun.load(str(path), weights="q8", context_length=256, progress=False)
    finally:
        torch.set_num_threads(before)


class Alternating:
    """A ThreadsForLoad stand-in whose load flips every call: busy, idle, ..."""

    def __init__(self, counts):
        self.counts, self.calls = counts, 0

    def threads_now(self) -> int:
        self.calls += 1
        return self.counts[self.calls % len(self.counts)]

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass


def _serve(worker, specs) -> list[list[int]]:
    from forerun.server.worker import Job

    async def run() -> list[list[int]]:
        jobs = [Job(spec) for spec in specs]
        for job in jobs:
            worker.submit(job)
        answers = []
        for job in jobs:
            while True:
                kind, payload = await asyncio.wait_for(job.events.get(), 120)
                if kind == "done":
                    answers.append(list(payload.result.tokens))
                    break
                assert kind == "delta", payload
        return answers

    worker.start()
    try:
        return asyncio.run(run())
    finally:
        worker.shutdown()
        worker.join(30)


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_server_worker_follows_the_load_and_its_answers_do_not_change(tiny, parallel):
    """The engine worker (one request at a time, and a batch) runs each
    generation or step on the count the load gives, where the probe found
    fewer threads exact; every answer is the one the model gives alone."""
    from forerun.server.batch_worker import BatchWorker
    from forerun.server.prefix_cache import PrefixCache
    from forerun.server.translate import GenerationSpec
    from forerun.server.worker import EngineWorker

    own = tiny.decoder.threads
    usable = ThreadsForLoad(tiny).prepare()
    counts = [usable[-1], own] if usable else [own]
    prompts = [tiny.encode_prompt(p) for p in ("the quick brown fox", "a b c d", "zz yy")]
    options = {"max_new_tokens": 12, "ignore_eos": True, "draft": "none"}
    want = [tiny.generate(prompt_ids=p, **options).tokens for p in prompts]
    flips = Alternating(counts)
    ran_on: list[int] = []
    set_threads = tiny.decoder.set_threads

    def spy(n: int) -> None:
        ran_on.append(n)
        set_threads(n)

    tiny.decoder.set_threads = spy
    cache = PrefixCache(tiny.decoder, limit_bytes=2**24, enabled=True)
    if parallel == 1:
        worker = EngineWorker(tiny, cache, max_queue=8, threads=flips)
    else:
        worker = BatchWorker(tiny, cache, max_queue=8, parallel=parallel, threads=flips)
    try:
        got = _serve(worker, [GenerationSpec(p, dict(options)) for p in prompts])
    finally:
        del tiny.decoder.set_threads
        torch.set_num_threads(own)
    assert got == [list(w) for w in want]
    assert flips.calls >= len(prompts)
    if parallel == 1 and len(counts) == 2:       # each generation on the count it was given
        assert ran_on[:2] == [own, counts[0]] or ran_on[:1] == [counts[0]]
