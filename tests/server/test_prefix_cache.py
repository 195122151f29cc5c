"""The server's prefix cache: which prefix a request reuses, the memory
bound of saved prefixes, and, on a live server, multi-turn chats that give
the same tokens with and without the cache."""

import time

import pytest
import torch

from conftest import PREFIX_CACHE_MB, greedy, text_of
from forerun.api.busy_threads import SAMPLE_EVERY
from forerun.decoding.prefill import prefill
from forerun.server.prefix_cache import PrefixCache, Reuse
from tiny_models import forerun_decoder, hf_model

BLOCK = 8


@pytest.fixture(scope="module")
def hf():
    return hf_model("llama", seed=5)


def decoder_of(hf):
    d = forerun_decoder(hf, context_length=128)
    d.prefill_block = BLOCK
    return d


def conversation(seed, n=20):
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def serve(cache, decoder, prompt):
    """What the worker does: prepare, prefill, decode a few tokens."""
    reuse = cache.prepare(prompt)
    logits = prefill(decoder, prompt).logits
    decoder.feed([5, 6, 7])
    return reuse, logits


def block_bytes(decoder):
    c = decoder.cache
    return 2 * c.n_layers * c.n_kv_heads * c.head_dim * BLOCK * c.keys.element_size()


def test_the_next_turn_reuses_the_live_cache(hf):
    decoder = decoder_of(hf)
    assert not decoder.reuse_prefixes
    cache = PrefixCache(decoder, limit_bytes=10 ** 9)
    assert decoder.reuse_prefixes         # the server turns reuse on
    a = conversation(1)
    assert serve(cache, decoder, a)[0] == Reuse(None, 0)
    assert serve(cache, decoder, a + [9] * 6)[0] == Reuse("live", 16)
    assert (cache.hits, cache.misses, cache.reused_tokens) == ({"live": 1, "saved": 0}, 1, 16)
    assert cache.entries == 0             # nothing was dropped, nothing saved


def test_a_dropped_prefix_is_saved_and_restored_exactly(hf):
    decoder = decoder_of(hf)
    cache = PrefixCache(decoder, limit_bytes=10 ** 9)
    a, b = conversation(1), conversation(2)
    serve(cache, decoder, a)
    serve(cache, decoder, b)              # drops a's blocks from the live cache: saved
    assert cache.entries == 1 and cache.bytes == 2 * block_bytes(decoder)
    a2 = a + [11, 12, 13, 14, 15]
    reuse, warm = serve(cache, decoder, a2)
    assert reuse == Reuse("saved", 16)
    assert cache.entries == 1             # b's prefix saved; a's is the live cache now
    assert list(cache._saved) == [tuple(b[:16])]
    cold = prefill(decoder_of(hf), a2).logits
    assert torch.equal(warm, cold)


def test_a_prefix_saved_on_another_thread_count_is_passed_over(hf):
    """A server following the machine's load changes its thread count
    between requests: a prefix saved on the other count (float32 products
    round by it) is not restored (restoring it would be refused), and the
    request is served from a cold prefill, exactly."""
    decoder = decoder_of(hf)
    cache = PrefixCache(decoder, limit_bytes=10 ** 9)
    a, b = conversation(1), conversation(2)
    own = decoder.threads
    serve(cache, decoder, a)
    serve(cache, decoder, b)                       # a's blocks saved, on `own` threads
    try:
        decoder.set_threads(1 if own > 1 else 2)
        a2 = a + [11, 12, 13]
        reuse, warm = serve(cache, decoder, a2)
        assert reuse == Reuse(None, 0)
        assert torch.equal(warm, prefill(decoder_of(hf), a2).logits)
    finally:
        decoder.set_threads(own)
    assert serve(cache, decoder, a + [21, 22])[0] == Reuse("saved", 16)   # its count again


def test_saved_prefixes_stay_within_the_bound(hf):
    decoder = decoder_of(hf)
    one = 2 * block_bytes(decoder)                 # each conversation: two whole blocks
    cache = PrefixCache(decoder, limit_bytes=int(2.5 * one))
    for seed in range(1, 7):
        serve(cache, decoder, conversation(seed))
        assert cache.bytes <= cache.limit_bytes
        assert cache.entries <= 2
    # The least recently used went first: the two before the live one remain.
    kept = [key for key in cache._saved]
    assert kept == [tuple(conversation(s)[:16]) for s in (4, 5)]
    # A payload larger than the bound is not kept at all.
    small = PrefixCache(decoder, limit_bytes=one - 1)
    serve(small, decoder, conversation(8))
    serve(small, decoder, conversation(9))
    assert small.entries == 0 and small.bytes == 0


def test_no_reuse_when_disabled(hf):
    decoder = decoder_of(hf)
    cache = PrefixCache(decoder, limit_bytes=10 ** 9, enabled=False)
    a = conversation(1)
    serve(cache, decoder, a)
    assert serve(cache, decoder, a + [1, 2])[0] == Reuse(None, 0)
    assert cache.hits == {"live": 0, "saved": 0} and cache.misses == 2


# -- a live server --------------------------------------------------------------------

SYSTEM = "You are a patient assistant who answers briefly and clearly. " * 25


def _chat(srv, system, questions):
    """A multi-turn greedy chat; the texts and the reused prompt tokens."""
    client = srv.client()
    messages = [{"role": "system", "content": system}]
    texts, reused = [], []
    for q in questions:
        messages.append({"role": "user", "content": q})
        r = greedy(client, messages, max_tokens=12)
        texts.append(text_of(r))
        reused.append(r.model_extra["forerun"]["prefix_cache_tokens"])
        messages.append({"role": "assistant", "content": texts[-1]})
    return texts, reused


def _hits(srv, source):
    return srv.metrics().get(f'forerun_prefix_cache_hits_total{{source="{source}"}}', 0)


@pytest.fixture(scope="module")
def settled(server, cold_server):
    """The two servers, after the machine's load meter has forgotten their
    start: a server follows the load of the last two samples
    (:mod:`forerun.api.busy_threads`), so a turn asked just after the other
    server started may run on fewer threads than the next, whose prefill
    then can't take float32 blocks computed on another count."""
    time.sleep(3 * SAMPLE_EVERY)
    return server, cold_server


@pytest.mark.real_model
def test_multi_turn_chat_is_the_same_with_and_without_the_cache(settled):
    server, cold_server = settled
    questions = ["What is a prime number?", "Give an example.", "And another one?"]
    live_hits = _hits(server, "live")
    warm, reused = _chat(server, SYSTEM, questions)
    cold, cold_reused = _chat(cold_server, SYSTEM, questions)
    assert warm == cold
    assert reused[1] >= 256 and reused[2] >= reused[1]
    assert cold_reused == [0, 0, 0]
    assert _hits(server, "live") >= live_hits + 2
    assert _hits(cold_server, "live") == _hits(cold_server, "saved") == 0


@pytest.mark.real_model
def test_saved_prefixes_serve_interleaved_conversations(settled):
    """Two conversations in turns: each one's prefix is saved while the
    other runs, and restored (a saved hit) with the same answers as cold;
    the saved prefixes never exceed --prefix-cache-mb."""
    server, cold_server = settled
    limit = PREFIX_CACHE_MB * 2 ** 20
    saved = _hits(server, "saved")
    questions = ("What is rain?", "Why is the sky blue?")
    names = ("north", "south")
    # The cold answers first, so that the warm server's requests don't run
    # beside the other server's (it would follow that load to fewer threads).
    cold = {name: [{"role": "system", "content": f"Conversation {name}. " + SYSTEM}]
            for name in names}
    for question in questions:
        for name in names:
            cold[name].append({"role": "user", "content": question})
            answer = greedy(cold_server.client(), cold[name], max_tokens=8)
            cold[name].append({"role": "assistant", "content": text_of(answer)})
    time.sleep(3 * SAMPLE_EVERY)
    for turn in range(len(questions)):
        for name in names:
            asked = cold[name][:2 + 2 * turn]
            warm = greedy(server.client(), asked, max_tokens=8)
            assert text_of(warm) == cold[name][2 + 2 * turn]["content"]
            metrics = server.metrics()
            assert metrics["forerun_prefix_cache_bytes"] <= limit
            assert metrics["forerun_prefix_cache_limit_bytes"] == limit
    assert _hits(server, "saved") >= saved + 2
    assert server.metrics()["forerun_prefix_cache_entries"] >= 1
