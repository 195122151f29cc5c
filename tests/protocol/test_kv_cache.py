"""forerun.protocol.kv_cache.KVCache: pointer arithmetic, in-place storage, tree
compaction and persistence."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from forerun.errors import CacheStateError, ContextLengthError, ModelNotFoundError
from forerun.protocol.kv_cache import KVCache

L, H, D, CAP = 2, 3, 4, 12


def fill(cache: KVCache, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Write ``n`` random positions at the end of ``cache`` in every layer and
    advance; return what was written, as ``[L, H, n, D]``."""
    k = torch.randn(cache.n_layers, cache.n_kv_heads, n, cache.head_dim, generator=gen)
    v = torch.randn(cache.n_layers, cache.n_kv_heads, n, cache.head_dim, generator=gen)
    start = cache.length
    for layer in range(cache.n_layers):
        cache.write(layer, start, k[layer], v[layer])
    cache.advance(n)
    return k, v


def state(cache: KVCache) -> tuple:
    n = cache.length
    return (n, cache.committed, cache.keys[:, :, :n].clone(), cache.values[:, :, :n].clone())


def assert_same_state(cache: KVCache, before: tuple) -> None:
    n, committed, keys, values = before
    assert cache.length == n
    assert cache.committed == committed
    assert torch.equal(cache.keys[:, :, :n], keys)
    assert torch.equal(cache.values[:, :, :n], values)


# -- the state machine --------------------------------------------------------
class KVCacheMachine(RuleBasedStateMachine):
    """Random appends, rollbacks, snapshots, commits and resets, checked
    against a list of per-position tensors and a committed count."""

    @initialize(seed=st.integers(0, 2**31 - 1))
    def setup(self, seed):
        self.gen = torch.Generator().manual_seed(seed)
        self.cache = KVCache(L, H, D, CAP)
        self.keys_obj, self.values_obj = self.cache.keys, self.cache.values
        self.ptrs = (self.cache.keys.data_ptr(), self.cache.values.data_ptr())
        self.ref_k: list[torch.Tensor] = []  # per position: [L, H, D]
        self.ref_v: list[torch.Tensor] = []
        self.committed = 0
        self.snapshots: list[int] = []

    # every rule that may fail must leave the cache exactly as it was
    def expect_error(self, exc, fn, *args):
        before = state(self.cache)
        with pytest.raises(exc):
            fn(*args)
        assert_same_state(self.cache, before)

    @rule(n=st.integers(1, 5))
    def append(self, n):
        if len(self.ref_k) + n > CAP:
            self.expect_error(ContextLengthError, self.cache.check_room, n)
            self.expect_error(ContextLengthError, self.cache.advance, n)
            return
        k, v = fill(self.cache, n, self.gen)
        for i in range(n):
            self.ref_k.append(k[:, :, i].clone())
            self.ref_v.append(v[:, :, i].clone())

    @rule(n=st.integers(-3, 0))
    def append_nothing(self, n):
        self.expect_error(CacheStateError, self.cache.advance, n)

    @rule(data=st.data())
    def rollback(self, data):
        target = data.draw(st.integers(-2, CAP + 2), label="rollback to")
        if self.committed <= target <= len(self.ref_k):
            self.cache.rollback(target)
            del self.ref_k[target:], self.ref_v[target:]
        else:
            self.expect_error(CacheStateError, self.cache.rollback, target)

    @rule()
    def snapshot(self):
        snap = self.cache.snapshot()
        assert snap == len(self.ref_k)
        self.snapshots.append(snap)

    @precondition(lambda self: self.snapshots)
    @rule(data=st.data())
    def rollback_to_snapshot(self, data):
        snap = data.draw(st.sampled_from(self.snapshots), label="snapshot")
        if self.committed <= snap <= len(self.ref_k):
            self.cache.rollback(snap)
            del self.ref_k[snap:], self.ref_v[snap:]
        else:
            self.expect_error(CacheStateError, self.cache.rollback, snap)

    @rule(data=st.data())
    def commit(self, data):
        target = data.draw(st.one_of(st.none(), st.integers(-2, CAP + 2)), label="commit")
        effective = len(self.ref_k) if target is None else target
        if self.committed <= effective <= len(self.ref_k):
            self.cache.commit(target)
            self.committed = effective
        else:
            self.expect_error(CacheStateError, self.cache.commit, target)

    @rule()
    def reset(self):
        self.cache.reset()
        self.ref_k.clear()
        self.ref_v.clear()
        self.committed = 0
        self.snapshots.clear()

    @invariant()
    def matches_reference(self):
        cache = self.cache
        n = len(self.ref_k)
        assert cache.length == n
        assert cache.snapshot() == n
        assert cache.committed == self.committed
        if n:
            assert torch.equal(cache.keys[:, :, :n], torch.stack(self.ref_k, dim=2))
            assert torch.equal(cache.values[:, :, :n], torch.stack(self.ref_v, dim=2))
        for layer in range(L):
            k, v = cache.layer(layer, n)
            assert k.shape == (H, n, D) and v.shape == (H, n, D)
            if n:
                assert k.data_ptr() == cache.keys[layer].data_ptr()  # a view, no copy
                assert v.data_ptr() == cache.values[layer].data_ptr()

    @invariant()
    def storage_never_reallocated(self):
        assert self.cache.keys is self.keys_obj
        assert self.cache.values is self.values_obj
        assert (self.cache.keys.data_ptr(), self.cache.values.data_ptr()) == self.ptrs
        assert self.cache.keys.shape == (L, H, CAP, D)


KVCacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                            deadline=None)
TestKVCacheStateMachine = KVCacheMachine.TestCase


# -- in-place storage ---------------------------------------------------------
def test_rollback_neither_reallocates_nor_copies_and_new_appends_overwrite_in_place():
    gen = torch.Generator().manual_seed(0)
    cache = KVCache(L, H, D, CAP)
    keys, values = cache.keys, cache.values
    ptrs = (keys.data_ptr(), values.data_ptr())

    k1, v1 = fill(cache, 5, gen)
    cache.rollback(2)
    assert cache.length == 2
    assert cache.keys is keys and cache.values is values
    assert (cache.keys.data_ptr(), cache.values.data_ptr()) == ptrs
    # rollback only moved the pointer: the forgotten slots still hold the old data
    assert torch.equal(cache.keys[:, :, :5], k1)
    assert torch.equal(cache.values[:, :, :5], v1)

    k2, v2 = fill(cache, 2, gen)
    assert cache.length == 4
    assert cache.keys is keys and cache.values is values
    assert (cache.keys.data_ptr(), cache.values.data_ptr()) == ptrs
    assert torch.equal(cache.keys[:, :, :2], k1[:, :, :2])
    assert torch.equal(cache.keys[:, :, 2:4], k2)            # overwritten in place
    assert torch.equal(cache.values[:, :, 2:4], v2)
    assert torch.equal(cache.keys[:, :, 4], k1[:, :, 4])     # scratch untouched
    k, v = cache.layer(1, cache.length)
    assert torch.equal(k, torch.cat([k1[1, :, :2], k2[1]], dim=1))
    assert torch.equal(v, torch.cat([v1[1, :, :2], v2[1]], dim=1))


def test_commit_is_a_rollback_floor_and_reset_clears_it():
    gen = torch.Generator().manual_seed(1)
    cache = KVCache(L, H, D, CAP)
    fill(cache, 6, gen)
    cache.commit(4)
    with pytest.raises(CacheStateError, match="committed length 4"):
        cache.rollback(3)
    cache.rollback(4)
    with pytest.raises(CacheStateError):
        cache.commit(3)  # the floor only rises
    with pytest.raises(CacheStateError):
        cache.commit(5)  # beyond the current length
    cache.commit()
    assert cache.committed == 4
    cache.reset()
    assert (cache.length, cache.committed) == (0, 0)


def test_bad_dimensions():
    for dims in [(0, H, D, CAP), (L, 0, D, CAP), (L, H, 0, CAP), (L, H, D, 0), (L, H, D, -1)]:
        with pytest.raises(CacheStateError):
            KVCache(*dims)


# -- capacity -----------------------------------------------------------------
def test_capacity_overflow_raises_context_length_error():
    gen = torch.Generator().manual_seed(2)
    cache = KVCache(L, H, D, 8)
    cache.check_room(8)
    with pytest.raises(ContextLengthError, match="8"):
        cache.check_room(9)
    fill(cache, 6, gen)
    cache.check_room(2)
    for call in (cache.check_room, cache.advance):
        with pytest.raises(ContextLengthError):
            call(3)
        assert cache.length == 6
    fill(cache, 2, gen)
    assert cache.length == 8
    with pytest.raises(ContextLengthError):
        cache.advance(1)
    assert cache.length == 8
    with pytest.raises(CacheStateError):
        cache.check_room(0)


# -- move (tree compaction) ---------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_move_compacts_random_slots(data):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    cache = KVCache(L, H, D, CAP)
    length = data.draw(st.integers(1, CAP), label="length")
    fill(cache, length, gen)
    committed = data.draw(st.integers(0, length), label="committed")
    cache.commit(committed)
    dst = data.draw(st.integers(committed, length), label="dst_start")
    src = []
    if dst < length:
        src = sorted(data.draw(st.sets(st.integers(dst, length - 1), max_size=length - dst),
                               label="src"))
    keys_before, values_before = cache.keys.clone(), cache.values.clone()
    keys_obj, ptr = cache.keys, cache.keys.data_ptr()

    cache.move(torch.tensor(src, dtype=torch.long), dst)

    n = len(src)
    assert cache.length == dst + n
    assert cache.committed == committed
    assert cache.keys is keys_obj and cache.keys.data_ptr() == ptr
    assert torch.equal(cache.keys[:, :, :dst], keys_before[:, :, :dst])
    assert torch.equal(cache.values[:, :, :dst], values_before[:, :, :dst])
    for i, s in enumerate(src):
        assert torch.equal(cache.keys[:, :, dst + i], keys_before[:, :, s])
        assert torch.equal(cache.values[:, :, dst + i], values_before[:, :, s])


def test_move_accepts_int32_and_identity_paths():
    gen = torch.Generator().manual_seed(3)
    cache = KVCache(L, H, D, CAP)
    k, _ = fill(cache, 8, gen)
    cache.move(torch.tensor([3, 4, 5], dtype=torch.int32), 3)  # already in place
    assert cache.length == 6
    assert torch.equal(cache.keys[:, :, :6], k[:, :, :6])
    cache.move(torch.tensor([], dtype=torch.long), 2)  # keep nothing after slot 2
    assert cache.length == 2


@pytest.mark.parametrize("src,dst,commit", [
    ([3, 4], 1, 2),    # destination below the committed length
    ([5, 6], 6, 0),    # dst_start + n beyond the current length (6 + 2 > 7)
    ([9], 2, 0),       # a source slot at or beyond the length: scratch space
    ([-1], 2, 0),      # a negative source slot
    ([1, 4], 2, 0),    # a source slot below dst_start
    ([5, 3], 2, 0),    # not ascending
    ([4, 4], 2, 0),    # repeated
])
def test_move_rejects_bad_ranges(src, dst, commit):
    gen = torch.Generator().manual_seed(4)
    cache = KVCache(L, H, D, CAP)
    fill(cache, 7, gen)
    cache.commit(commit)
    before = state(cache)
    with pytest.raises(CacheStateError):
        cache.move(torch.tensor(src), dst)
    assert_same_state(cache, before)


# -- persistence --------------------------------------------------------------
def make_cache(length=7, committed=3, dtype=torch.float32, capacity=CAP, shape=(L, H, D)):
    gen = torch.Generator().manual_seed(5)
    cache = KVCache(*shape, capacity, dtype=dtype)
    if length:
        k = torch.randn(shape[0], shape[1], length, shape[2], generator=gen).to(dtype)
        v = torch.randn(shape[0], shape[1], length, shape[2], generator=gen).to(dtype)
        for layer in range(shape[0]):
            cache.write(layer, 0, k[layer], v[layer])
        cache.advance(length)
        cache.commit(committed)
    return cache


def assert_same_contents(a: KVCache, b: KVCache) -> None:
    assert (a.length, a.committed) == (b.length, b.committed)
    n = a.length
    assert torch.equal(a.keys[:, :, :n].float(), b.keys[:, :, :n].float())
    assert torch.equal(a.values[:, :, :n].float(), b.values[:, :, :n].float())


@pytest.mark.parametrize("length,committed", [(7, 3), (0, 0), (CAP, CAP)])
def test_export_restore_roundtrip(length, committed):
    src = make_cache(length, committed)
    payload = src.export()
    assert payload["keys"].shape == (L, H, length, D)
    # the payload is a copy: later writes to the cache don't change it
    keys_copy, original = payload["keys"].clone(), src.keys.clone()
    src.keys.add_(1.0)
    assert torch.equal(payload["keys"], keys_copy)
    src.keys.copy_(original)

    dst = make_cache(length=3, committed=1, capacity=CAP + 5)  # holds other data
    keys_obj = dst.keys
    dst.restore(payload)
    assert dst.keys is keys_obj
    assert_same_contents(src, dst)
    dst.rollback(committed)  # the committed floor came along
    with pytest.raises(CacheStateError):
        dst.rollback(committed - 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_save_load_roundtrip(tmp_path, dtype):
    src = make_cache(dtype=dtype)
    path = tmp_path / "cache.safetensors"
    src.save(path, extra={"model": "tiny", "tokens": "1,2,3"})
    payload, meta = KVCache.load_payload(path)
    assert meta["model"] == "tiny" and meta["tokens"] == "1,2,3"
    assert meta["dtype"] == str(dtype).removeprefix("torch.")
    dst = KVCache(L, H, D, CAP, dtype=dtype)
    dst.restore(payload)
    assert_same_contents(src, dst)
    # restoring into a cache of another dtype converts
    other = KVCache(L, H, D, CAP, dtype=torch.float64)
    other.restore(payload)
    assert torch.equal(other.keys[:, :, :7], src.keys[:, :, :7].double())


def test_save_load_empty_cache(tmp_path):
    src = make_cache(length=0, committed=0)
    path = tmp_path / "empty.safetensors"
    src.save(path)
    payload, _ = KVCache.load_payload(path)
    dst = make_cache(length=4, committed=2)
    dst.restore(payload)
    assert (dst.length, dst.committed) == (0, 0)


@pytest.mark.parametrize("field,shape", [
    ("n_layers", (L + 1, H, D)),
    ("n_kv_heads", (L, H + 1, D)),
    ("head_dim", (L, H, D * 2)),
])
def test_restore_into_a_different_shape_names_the_field(field, shape, tmp_path):
    payload = make_cache().export()
    dst = make_cache(length=2, committed=1, shape=shape)
    before = state(dst)
    with pytest.raises(CacheStateError, match=field):
        dst.restore(payload)
    assert_same_state(dst, before)
    path = tmp_path / "c.safetensors"
    make_cache().save(path)
    with pytest.raises(CacheStateError, match=field):
        dst.restore(KVCache.load_payload(path)[0])


def test_restore_longer_than_capacity_is_a_context_length_error(tmp_path):
    payload = make_cache(length=10, committed=4).export()
    small = make_cache(length=2, committed=1, capacity=8)
    before = state(small)
    with pytest.raises(ContextLengthError, match="10"):
        small.restore(payload)
    assert_same_state(small, before)
    path = tmp_path / "long.safetensors"
    make_cache(length=10, committed=4).save(path)
    with pytest.raises(ContextLengthError):
        small.restore(KVCache.load_payload(path)[0])


def test_restore_rejects_bad_payloads():
    cache = make_cache()
    good = make_cache().export()
    bad_payloads = [
        "not a dict",
        {**good, "format": "something-else/1"},
        {**good, "keys": good["keys"][:, :, :3]},          # tensors don't match length
        {**good, "committed": good["length"] + 1},
        {**good, "committed": -1},
    ]
    for payload in bad_payloads:
        before = state(cache)
        with pytest.raises(CacheStateError):
            cache.restore(payload)
        assert_same_state(cache, before)


def test_load_corrupt_files(tmp_path):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"this is not a safetensors file at all" * 10)
    with pytest.raises(CacheStateError, match="not a readable KV cache file"):
        KVCache.load_payload(garbage)

    good = tmp_path / "good.safetensors"
    make_cache().save(good)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-40])
    with pytest.raises(CacheStateError):
        KVCache.load_payload(truncated)

    from safetensors.torch import save_file
    foreign = tmp_path / "foreign.safetensors"
    save_file({"weight": torch.zeros(2, 2)}, str(foreign))
    with pytest.raises(CacheStateError):
        KVCache.load_payload(foreign)

    no_meta = tmp_path / "no_meta.safetensors"
    save_file({"keys": torch.zeros(L, H, 1, D), "values": torch.zeros(L, H, 1, D)}, str(no_meta))
    with pytest.raises(CacheStateError, match="metadata"):
        KVCache.load_payload(no_meta)

    with pytest.raises(ModelNotFoundError):
        KVCache.load_payload(tmp_path / "missing.safetensors")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_cache_roundtrip_and_move(tmp_path):
    gen = torch.Generator().manual_seed(6)
    cache = KVCache(L, H, D, CAP, device="cuda")
    k = torch.randn(L, H, 6, D, generator=gen)
    for layer in range(L):
        cache.write(layer, 0, k[layer].cuda(), k[layer].cuda())
    cache.advance(6)
    cache.move(torch.tensor([3, 5]), 2)  # CPU slots, CUDA storage
    assert torch.equal(cache.keys[:, :, 2].cpu(), k[:, :, 3])
    assert torch.equal(cache.keys[:, :, 3].cpu(), k[:, :, 5])
    path = tmp_path / "gpu.safetensors"
    cache.save(path)
    other = KVCache(L, H, D, CAP, device="cuda")
    other.restore(KVCache.load_payload(path)[0])
    assert_same_contents(cache, other)
