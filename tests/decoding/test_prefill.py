"""The shared prefill and exact prefix reuse: a warm prefill (one that keeps
whole prefill blocks of an earlier prompt) computes bit for bit what a cold
one computes, on both engines and for every decoding method."""

import pytest
import torch

import forerun
from decoding.test_rank_tree_planner import OracleTreeDrafter
from forerun.decoding.plain import PlainDecoding
from forerun.decoding.prefill import prefill
from forerun.decoding.rank_tree_planner import TreeShape
from forerun.decoding.sampling import SamplingParams, TokenSampler
from forerun.decoding.speculative import SpeculativeDecoding
from forerun.decoding.stats import GenerationStats
from forerun.decoding.tree_speculative import TreeSpeculativeDecoding
from forerun.drafters.ngram import NgramDrafter
from forerun.errors import CacheStateError
from forerun.protocol.prefix_reuse import PrefixReuse, reusable_length
from method_runs import FeedLog, run_method
from tiny_models import forerun_decoder, hf_model

BLOCK = 8


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def hf(request):
    return hf_model(request.param, seed=5)


def target_of(hf, context_length=160, reuse=True, weights="float32"):
    decoder = forerun_decoder(hf, context_length=context_length, weights=weights)
    decoder.prefill_block = BLOCK
    decoder.reuse_prefixes = reuse
    return decoder


def prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (n,), generator=g).tolist()


def kv(decoder):
    n = decoder.length
    return decoder.cache.keys[:, :, :n].clone(), decoder.cache.values[:, :, :n].clone()


def test_engines_provide_prefix_reuse(hf):
    assert isinstance(target_of(hf), PrefixReuse)


def test_prefill_feeds_aligned_blocks_and_records_whole_ones(hf):
    target = FeedLog(target_of(hf))
    a = prompt(21)
    out = prefill(target, a)
    assert target.feeds == [(8, True), (8, True), (5, True)]
    assert out.logits.shape[0] == 1
    assert target.prefilled_tokens == tuple(a[:16])
    assert target.length == target.committed_length == 21
    # A prompt sharing 19 tokens keeps the 16 of whole blocks, and goes on
    # from position 16 in aligned blocks.
    target.feeds.clear()
    b = a[:19] + prompt(11, seed=1)
    prefill(target, b)
    assert target.feeds == [(8, True), (6, True)]
    assert target.prefilled_tokens == tuple(b[:24])
    assert target.length == target.committed_length == 30


def test_reuse_is_off_unless_asked(hf):
    """By default every prompt is prefilled whole (benchmarks time whole
    prefills), in the same blocks, with the same logits."""
    target = FeedLog(target_of(hf, reuse=False))
    a = prompt(21)
    first = prefill(target, a).logits
    target.feeds.clear()
    again = prefill(target, a).logits
    assert target.feeds == [(8, True), (8, True), (5, True)]
    assert torch.equal(first, again)


def test_the_last_prompt_token_is_always_computed(hf):
    target = FeedLog(target_of(hf))
    a = prompt(16)
    prefill(target, a)
    assert target.prefilled_tokens == tuple(a)
    target.feeds.clear()
    prefill(target, a)              # everything cached: the last block is fed again
    assert target.feeds == [(8, True)]


@pytest.mark.parametrize("shared", [0, 5, 8, 9, 16, 23, 24, 30])
def test_warm_prefill_is_bit_identical_to_cold(hf, shared):
    first = prompt(30)
    second = first[:shared] + prompt(40 - shared, seed=2)
    warm = target_of(hf)
    prefill(warm, first)
    warm.feed(prompt(6, seed=3))                     # decoding steps after the prompt
    warm.feed(prompt(3, seed=4), last_only=False)
    warm_logits = prefill(warm, second).logits
    cold = target_of(hf)
    cold_logits = prefill(cold, second).logits
    assert torch.equal(warm_logits, cold_logits)
    for w, c in zip(kv(warm), kv(cold)):
        assert torch.equal(w, c)
    assert warm.prefilled_tokens == cold.prefilled_tokens == tuple(second[:40 - 40 % BLOCK])


def test_decoded_positions_are_never_reused(hf):
    """Positions a decoding step computed (and a prompt's partial last
    block) are not in the ledger, even when the next prompt repeats them."""
    target = target_of(hf)
    a = prompt(10)
    prefill(target, a)
    decoded = prompt(14, seed=5)
    for t in decoded:
        target.feed([t])
    assert target.prefilled_tokens == tuple(a[:8])
    b = a + decoded + [7, 8, 9]
    assert reusable_length(target.prefilled_tokens, b, BLOCK) == 8
    log = FeedLog(target)
    prefill(log, b)
    assert log.feeds == [(8, True), (8, True), (3, True)]


def test_the_ledger_follows_the_cache(hf):
    target = target_of(hf)
    a = prompt(20)
    prefill(target, a)
    assert len(target.prefilled_tokens) == 16
    target.keep_prefix(12)                        # rollback below the ledger shortens it
    assert target.prefilled_tokens == tuple(a[:12]) and target.committed_length == 0
    assert reusable_length(target.prefilled_tokens, a, BLOCK) == 8
    target.reset()
    assert target.prefilled_tokens == ()
    prefill(target, a)
    with pytest.raises(CacheStateError):           # not a whole block at the ledger's end
        target.mark_prefilled(a[16:])
    target.feed(prompt(8, seed=9), last_only=True)
    with pytest.raises(CacheStateError):           # starts at 20, not where the ledger ends
        target.mark_prefilled(prompt(8, seed=9))


def test_the_prefill_says_how_much_it_reused(hf):
    target = target_of(hf)
    a = prompt(21)
    stats = GenerationStats()
    prefill(target, a, stats=stats)
    assert stats.reused_prompt_tokens == 0
    prefill(target, a[:19] + prompt(11, seed=1), stats=stats)
    assert stats.reused_prompt_tokens == 16


def test_blocks_count_only_on_the_thread_count_that_computed_them(hf):
    """Blocks computed on another thread count may hold other numbers:
    the next prefill computes them again, and records them anew."""
    target = target_of(hf)
    a = prompt(20)
    own = target.threads
    prefill(target, a)
    try:
        target.set_threads(own + 1)
        assert target.prefilled_tokens == ()
        with pytest.raises(CacheStateError, match="other engine settings"):
            target.feed(a[16:], last_only=True)
            target.mark_prefilled(prompt(8, seed=3))
        stats = GenerationStats()
        prefill(target, a, stats=stats)
        assert stats.reused_prompt_tokens == 0
        assert target.prefilled_tokens == tuple(a[:16])
    finally:
        target.set_threads(own)
    assert target.prefilled_tokens == ()


def test_saved_prefix_restores_bit_identical(hf):
    a = prompt(27)
    b = a[:20] + prompt(9, seed=6)
    target = target_of(hf)
    prefill(target, a)
    target.feed(prompt(4, seed=7))
    payload = target.export_prefix()
    assert payload.tokens == tuple(a[:24]) and target.length == 24
    keys = target.cache.keys[:, :, :24]
    assert payload.nbytes == 2 * keys.numel() * keys.element_size()
    prefill(target, prompt(33, seed=8))             # another conversation overwrites it
    target.restore_prefix(payload)
    assert target.length == 24 and target.prefilled_tokens == tuple(a[:24])
    warm = prefill(target, b).logits
    cold = prefill(target_of(hf), b).logits
    assert torch.equal(warm, cold)


def test_a_saved_prefix_fits_only_its_own_engine(hf):
    target = target_of(hf)
    prefill(target, prompt(16))
    payload = target.export_prefix()
    other = forerun_decoder(hf_model("llama", seed=11), context_length=160)
    other.prefill_block = BLOCK
    with pytest.raises(CacheStateError, match="another model"):
        other.restore_prefix(payload)


def _methods(hf, weights="float32"):
    """Fresh (target, method) pairs: plain, prompt lookup and tree decoding."""
    target = target_of(hf, weights=weights)
    yield "plain", PlainDecoding(target)
    target = target_of(hf, weights=weights)
    yield "ngram", SpeculativeDecoding(target, NgramDrafter(), k=3)
    target = target_of(hf, weights=weights)
    drafter = OracleTreeDrafter(forerun_decoder(hf, context_length=256), depth=3)
    yield "tree", TreeSpeculativeDecoding(target, drafter, tree=TreeShape.from_counts([2, 2]))


@pytest.mark.parametrize("weights", ["float32", "q4"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_method_gives_the_same_tokens_warm_and_cold(hf, temperature, weights, request):
    """A three-turn chat: each turn's prompt is the previous prompt, its
    answer and a new message.  Served warm (the cache kept between turns)
    and cold (reset before each turn), every method gives the same tokens,
    greedy and sampled with a seed.  On the native kernels (q4) a turn
    keeps the previous turn's prompt and answer, except where a tree's
    positions ended the ledger."""
    if weights == "q4":
        request.getfixturevalue("kernels")

    def sampler():
        return TokenSampler(SamplingParams(temperature=temperature), seed=11)

    for (name, warm), (_, cold) in zip(_methods(hf, weights), _methods(hf, weights)):
        history = prompt(13, seed=12)
        reused, before = [], []
        for turn in range(3):
            stats = GenerationStats()
            out_warm = run_method(warm, history, 12, sampler(), stats)
            reused.append(stats.reused_prompt_tokens)
            cold.target.reset()
            out_cold = run_method(cold, history, 12, sampler(), GenerationStats())
            assert out_warm == out_cold, (name, turn)
            before.append(len(history))
            history = history + out_warm + prompt(5, seed=20 + turn)
        assert reused[1] > 0 and reused[2] > reused[1], name
        if weights == "q4" and name != "tree":
            # The previous prompt and all of its answer that was fed (its
            # last token never is).
            assert reused[1] >= before[0] + 11 and reused[2] >= before[1] + 11, (name, reused)


# -- exact positions: forerun's engine on its native kernels ------------------------

def exact_target(hf, context_length=200):
    """A q4 target on forerun's native kernels (the test asks for the
    ``kernels`` fixture: the products forced on, not left to a timing)."""
    target = target_of(hf, context_length=context_length, weights="q4")
    assert target.exact_positions and target.reuse_unit == 1
    return target


def test_only_native_products_make_positions_exact(hf, kernels):
    float_target = target_of(hf)
    assert not float_target.exact_positions and float_target.reuse_unit == BLOCK
    exact_target(hf)


def test_every_position_fed_in_order_joins_the_ledger(hf, kernels):
    """Prompt blocks of any length, decoding steps and a verification's
    rows join it; a rollback shortens it; a tree's positions end it until
    a rollback goes below them."""
    target = exact_target(hf)
    a = prompt(13)
    prefill(target, a)
    assert target.prefilled_tokens == tuple(a)          # the partial block too
    target.feed([5])
    target.feed([6, 7, 8])                              # a verification's rows
    assert target.prefilled_tokens == tuple(a + [5, 6, 7, 8])
    target.rollback(15)
    assert target.prefilled_tokens == tuple(a + [5, 6])
    mask = torch.ones(2, 17, dtype=torch.bool)
    mask[1, 15] = False                                 # two siblings of a tree
    target.forward([9, 10], [15, 15], mask)
    target.keep_slots(torch.tensor([16]), 15)
    target.feed([11])
    assert target.length == 17 and target.prefilled_tokens == tuple(a + [5, 6])
    target.rollback(15)
    target.feed([10, 11])
    assert target.prefilled_tokens == tuple(a + [5, 6, 10, 11])
    with pytest.raises(CacheStateError, match="not the end of the recorded prefix"):
        target.mark_prefilled([1, 2])


@pytest.mark.parametrize("shared", [0, 5, 13, 16, 21, 24])
def test_a_prompt_keeps_any_prefix_of_an_answer_bit_identical(hf, shared, kernels):
    """The next prompt keeps every position it shares with the cache, the
    previous answer's included (decoding steps, a verification's accepted
    rows), not only whole blocks: its logits and cache are a cold
    prefill's, to the bit."""
    target = exact_target(hf)
    first = prompt(13)
    prefill(target, first)
    answer = prompt(11, seed=3)
    for t in answer[:4]:
        target.feed([t])
    target.feed(answer[4:11] + [1, 2])                  # 7 accepted, 2 rejected
    target.rollback(24)
    fed = first + answer
    second = fed[:shared] + prompt(9, seed=4)
    stats = GenerationStats()
    warm = prefill(target, second, stats=stats).logits
    assert stats.reused_prompt_tokens == shared
    cold_target = exact_target(hf)
    cold = prefill(cold_target, second).logits
    assert torch.equal(warm, cold)
    for w, c in zip(kv(target), kv(cold_target)):
        assert torch.equal(w, c)


def test_a_batch_rows_join_each_sequence_ledger(hf, kernels):
    target = exact_target(hf)
    other = target.fork()
    a, b = prompt(10), prompt(7, seed=1)
    prefill(target, a)
    prefill(other, b)
    target.feed_batch([(target, [3, 4]), (other, [5])])
    assert target.prefilled_tokens == tuple(a + [3, 4])
    assert other.prefilled_tokens == tuple(b + [5])
    second = a + [3, 4] + prompt(6, seed=2)
    warm = prefill(target, second).logits
    assert torch.equal(warm, prefill(exact_target(hf), second).logits)


def test_exact_positions_keep_their_ledger_on_another_thread_count(hf, kernels):
    """The native kernels compute each output on one thread in one order:
    a cache computed on one thread is a cache computed on two, so the
    ledger outlives a change of count (a server following the load)."""
    a = prompt(30)
    target = exact_target(hf)
    own = target.threads
    other = 1 if own > 1 else 2
    prefill(target, a)
    try:
        target.set_threads(other)
        assert target.prefilled_tokens == tuple(a)
        elsewhere = exact_target(hf)
        prefill(elsewhere, a)
        target.feed([4, 5])
        elsewhere.feed([4, 5])
        assert target.prefilled_tokens == tuple(a + [4, 5])
    finally:
        target.set_threads(own)
    for x, y in zip(kv(target), kv(elsewhere)):
        assert torch.equal(x, y)


# -- llama.cpp ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm_llama(preset_gguf):
    preset_gguf("smollm2-135m")
    model = forerun.load("smollm2-135m", engine="llama.cpp", context_length=1024,
                         progress=False, engine_options={"n_batch": 16})
    model.decoder.reuse_prefixes = True
    return model


@pytest.mark.real_model
def test_llama_cpp_warm_prefill_is_bit_identical(smollm_llama):
    decoder = smollm_llama.decoder
    assert isinstance(decoder, PrefixReuse) and decoder.prefill_block == 16
    first = smollm_llama.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)
    second = first[:50] + smollm_llama.tokenizer.encode(" And then it slept.")
    decoder.reset()
    cold = prefill(decoder, second).logits
    prefill(decoder, first)
    decoder.feed(first[:5])
    payload = decoder.export_prefix()
    assert len(payload.tokens) == len(first) - len(first) % 16
    warm = prefill(decoder, second).logits
    assert torch.equal(warm, cold)
    prefill(decoder, first[30:] + first)             # another prompt overwrites the cache
    decoder.restore_prefix(payload)
    assert decoder.prefilled_tokens == payload.tokens
    restored = prefill(decoder, second).logits
    assert torch.equal(restored, cold)


@pytest.mark.real_model
def test_llama_cpp_multi_turn_greedy_is_the_same_warm_and_cold(smollm_llama):
    model = smollm_llama
    messages = [{"role": "system", "content": "You are a helpful assistant. " * 8},
                {"role": "user", "content": "Name three fruits."}]
    for _turn in range(2):
        model.decoder.reset()
        cold = model.generate(messages=messages, max_new_tokens=16, temperature=0)
        model.decoder.reset()
        model.generate(messages=messages[:-1] + [{"role": "user", "content": "Hi"}],
                       max_new_tokens=4)
        warm = model.generate(messages=messages, max_new_tokens=16, temperature=0,
                              draft="ngram")
        assert warm.tokens == cold.tokens
        messages += [{"role": "assistant", "content": warm.text},
                     {"role": "user", "content": "And three more?"}]
