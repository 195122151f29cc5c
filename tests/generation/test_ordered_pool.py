"""forerun.generation.ordered_pool: numbered items made by a batch that
stays full (a new item starts in every slot that frees), taken in order,
each what its generation gives alone; a failing item's error reaches the
caller; closing cancels what runs."""

from __future__ import annotations

import pytest

import forerun
from forerun.generation.batch import SharedForwards, run_pool
from forerun.generation.ordered_pool import OrderedPool
from tiny_models import hf_folders

PROMPTS = ["a b c a b c a b", "hello there", "x", "one two three four five six seven"]
# One long item among short ones: windows of items would run it nearly alone.
LENGTHS = [30, 2, 3, 2, 4, 2, 3, 2, 2, 5, 2, 3]
PARALLEL = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder, = hf_folders(tmp_path_factory, (5,))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FORERUN_CACHE", str(tmp_path_factory.mktemp("cache")))
        m = forerun.load(folder, context_length=128, device="cpu", weights="q8")
        m.verification_grouping()
        yield m


def _request(n: int) -> dict:
    return dict(prompt=PROMPTS[n % len(PROMPTS)], max_new_tokens=LENGTHS[n % len(LENGTHS)],
                ignore_eos=True, temperature=0.8, seed=n)


def _pool(model, forwards: SharedForwards, make=None, room=lambda: None):
    pool: OrderedPool[list[int]]

    def generate(member, n: int) -> list[int]:
        stream = model.stream_in_batch(member, cancel=lambda: pool.closed, **_request(n))
        for _ in stream:
            pass
        return list(stream.result.tokens)

    def run(next_job, on_end) -> None:
        run_pool(model.decoder, next_job, PARALLEL, forwards=forwards, on_end=on_end)

    pool = OrderedPool(run, make or generate, 0, room)
    return pool


def test_items_come_in_order_from_a_batch_that_stays_full(model):
    alone = [model.generate(**_request(n)).tokens for n in range(len(LENGTHS))]
    forwards = SharedForwards(model.decoder)
    pool = _pool(model, forwards)
    pool.start()
    try:
        taken, seconds = zip(*(pool.take(n) for n in range(len(LENGTHS))))
        steps = list(forwards.steps)
    finally:
        pool.close()
    assert list(taken) == alone
    assert all(s >= 0 for s in seconds) and sum(seconds) > 0
    # Every forward while items were taken had all three slots waiting in it
    # (shared feeds and prefills): the long item never ran alone.
    assert steps and all(shared + apart == PARALLEL for shared, apart in steps)
    assert sum(shared for shared, _ in steps) > len(steps)     # decoding steps shared


def test_an_items_error_reaches_the_caller_and_close_cancels_the_rest(model):

    def make(member, n: int):
        if n == 2:
            raise ValueError("item 2 broke")
        stream = model.stream_in_batch(member, cancel=lambda: pool.closed,
                                       **dict(_request(n), max_new_tokens=100))
        for _ in stream:
            pass
        return stream.result

    forwards = SharedForwards(model.decoder)
    pool = _pool(model, forwards, make)
    pool.start()
    with pytest.raises(ValueError, match="item 2 broke"):
        pool.take(2)
    pool.close()                   # returns: the running items cancelled
    assert pool.closed and forwards.members == 0
    assert pool._next_job() is None          # no item starts once closed


def test_an_item_taken_after_the_pool_ended_without_it_is_an_error(model):
    def make(member, n: int):
        return n

    def run(next_job, on_end) -> None:      # a runner that makes items 0 and 1 only
        for _ in range(2):
            key, job = next_job()
            on_end(key, job(None), None)

    pool = OrderedPool(run, make, 0)
    pool.start()
    assert pool.take(0)[0] == 0 and pool.take(1)[0] == 1
    with pytest.raises(RuntimeError, match="without item 2"):
        pool.take(2)
    pool.close()


def test_room_bounds_how_far_ahead_items_start(model):
    """With room for 2 items past the first one not taken, a pool of 3
    starts items 0 and 1 only, and one more for each item taken."""
    alone = [model.generate(**_request(n)).tokens for n in range(3)]
    forwards = SharedForwards(model.decoder)
    pool = _pool(model, forwards, room=lambda: 2)
    pool.start()
    try:
        first = pool.take(0)[0]
        assert pool._next <= 3                   # 1 and 2 may start once 0 is taken
        assert [first, pool.take(1)[0], pool.take(2)[0]] == alone
        assert pool._next <= 5
        assert max(shared + apart for shared, apart in forwards.steps) <= 2
    finally:
        pool.close()
