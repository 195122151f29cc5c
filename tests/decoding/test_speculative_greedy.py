"""Greedy speculative decoding is token-identical to plain greedy decoding,
on tiny random Qwen2 and Llama models run by forerun's engine, for every
draft length and for drafts of high, medium and low acceptance.  Also the
counters, the cache state after settle, and the context limit."""

from __future__ import annotations

import pytest
import torch

from forerun.decoding.plain import PlainDecoding
from forerun.decoding.sampling import SamplingParams, TokenSampler
from forerun.decoding.speculative import SpeculativeDecoding
from forerun.decoding.stats import GenerationStats
from forerun.drafters.draft_model import DraftModelDrafter
from forerun.errors import ContextLengthError
from method_runs import FeedLog
from table_decoders import single_thread  # noqa: F401 (autouse fixture)
from tiny_models import VOCAB, forerun_decoder, hf_model  # noqa: E402

ARCHS = ["qwen2", "llama"]
N_NEW = 64
PROMPTS = [
    [7],                                             # a single token: no prefill
    [5, 17, 99, 3, 250, 8, 41],
    [int(t) for t in torch.randint(3, VOCAB, (23,), generator=torch.Generator().manual_seed(2))],
]
# Larger weights than transformers' default init: greedy outputs of the
# random models then vary instead of repeating one token.
INIT = dict(initializer_range=0.2)
PERTURBATION = 0.02            # relative noise: acceptance about 0.5


def build_hf(arch: str, draft: str):
    if draft == "self":
        return hf_model(arch, 0, **INIT)
    if draft == "other":
        return hf_model(arch, 1, **INIT)
    model = hf_model(arch, 0, **INIT)          # "perturbed"
    gen = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * PERTURBATION * float(p.std()))
    return model


_DECODERS: dict = {}


def decoder(arch: str, which: str, context_length: int = 256):
    """A fresh-cache TorchDecoder; models are built once per session."""
    key = (arch, which)
    if key not in _DECODERS:
        _DECODERS[key] = build_hf(arch, which)
    return forerun_decoder(_DECODERS[key], context_length)


def generate(method, prompt: list[int], n: int, stats: GenerationStats | None = None,
             settle: bool = True) -> list[int]:
    stats = stats if stats is not None else GenerationStats()
    rounds = method.run(prompt, TokenSampler(SamplingParams(), 0, "cpu"), stats)
    out: list[int] = []
    for tokens in rounds:
        assert tokens, "every round commits at least one token"
        out += tokens
        if len(out) >= n:
            break
    rounds.close()
    if settle:
        method.settle(len(prompt) + n)
    return out[:n]


_REFERENCE: dict = {}


def reference(arch: str, prompt: list[int]) -> list[int]:
    key = (arch, tuple(prompt))
    if key not in _REFERENCE:
        _REFERENCE[key] = generate(PlainDecoding(decoder(arch, "self")), prompt, N_NEW)
    return _REFERENCE[key]


def fresh_next_logits(arch: str, tokens: list[int]) -> torch.Tensor:
    d = decoder(arch, "self")
    return d.feed(tokens, last_only=True).logits[-1]


def check_settled_target(arch: str, target, sequence: list[int]) -> None:
    """The target holds a valid prefix of ``sequence``: feeding the rest gives
    the logits of a fresh prefill."""
    assert target.length <= len(sequence)
    if target.length == len(sequence):
        target.rollback(target.length - 1)
    logits = target.feed(sequence[target.length:], last_only=True).logits[-1]
    # (torch's float32 products round by the rows fed, and a float16 cache
    # turns a last-bit difference of a key into one of its 11 significant
    # bits: 1e-4 apart over a float32 cache, up to about 1e-3 over float16)
    tol = 2e-3 if target.cache.keys.dtype == torch.float16 else 1e-4
    torch.testing.assert_close(logits, fresh_next_logits(arch, sequence), atol=tol, rtol=tol)


@pytest.mark.parametrize("k", [1, 2, 4, 8, None], ids=lambda k: f"k={k}")
@pytest.mark.parametrize("draft", ["self", "perturbed", "other"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_speculative_equals_plain(arch, draft, k):
    target = decoder(arch, "self")
    drafter = DraftModelDrafter(decoder(arch, draft))
    method = SpeculativeDecoding(target, drafter, k=k)
    rates = []
    for prompt in PROMPTS:
        stats = GenerationStats()
        out = generate(method, prompt, N_NEW, stats)
        assert out == reference(arch, prompt), f"prompt {prompt[:5]}..."

        # counters
        assert stats.rounds >= 1
        assert 0 <= stats.accepted <= stats.drafted
        drafting_rounds = sum(stats.accepted_histogram.values())
        assert drafting_rounds <= stats.rounds
        assert sum(n * c for n, c in stats.accepted_histogram.items()) == stats.accepted
        if k is not None:
            assert drafting_rounds == stats.rounds       # room for k drafts every round
            assert stats.drafted == k * stats.rounds
            assert max(stats.accepted_histogram) <= k
        # tokens committed = the prefill's token + accepted drafts + one
        # target token per round, and the last round may overshoot N_NEW
        committed = 1 + stats.accepted + stats.rounds
        assert N_NEW <= committed <= N_NEW + (k or 8)
        rates.append(stats.acceptance_rate if stats.drafted else None)

        # cache state after settle
        sequence = prompt + out
        assert target.length <= len(sequence)
        assert drafter.decoder.length <= len(sequence)
        check_settled_target(arch, target, sequence)

    measured = [r for r in rates if r is not None]
    if draft == "self":
        # (adaptive: a draft as dear as the model, timed before its first
        # step, may never pay, and then never drafts)
        assert (measured or k is None) and min(measured, default=1.0) > 0.98
    elif draft == "perturbed" and k is not None:
        assert 0.2 < sum(measured) / len(measured) < 0.9
    elif draft == "other" and k is not None:
        assert sum(measured) / len(measured) < 0.2


def test_self_draft_accepts_everything_with_fixed_k():
    target = decoder("qwen2", "self")
    method = SpeculativeDecoding(target, DraftModelDrafter(decoder("qwen2", "self")), k=4)
    stats = GenerationStats()
    out = generate(method, PROMPTS[1], N_NEW, stats)
    assert out == reference("qwen2", PROMPTS[1])
    assert stats.acceptance_rate == 1.0
    assert stats.accepted_histogram == {4: stats.rounds}
    assert stats.rounds == -(-N_NEW // 5)          # 5 tokens per round
    assert stats.mean_accepted_tokens == 5.0


@pytest.mark.parametrize("k", [8, None], ids=lambda k: f"k={k}")
@pytest.mark.parametrize("draft", ["self", "perturbed"])
@pytest.mark.parametrize("arch", ARCHS)
def test_context_limit(arch, draft, k):
    """A small context: SD never raises while the prompt and the tokens fit
    (drafts shrink near the end), and matches plain decoding up to the last
    token that fits, after which both raise ContextLengthError."""
    context, prompt = 40, PROMPTS[1]
    most = context - len(prompt) + 1       # the last token's logits fill the context
    plain = PlainDecoding(decoder(arch, "self", context))
    expected = generate(plain, prompt, most, settle=False)
    target = decoder(arch, "self", context)
    drafter = DraftModelDrafter(decoder(arch, draft, context))
    method = SpeculativeDecoding(target, drafter, k=k)
    stats = GenerationStats()
    rounds = method.run(prompt, TokenSampler(SamplingParams(), 0, "cpu"), stats)
    out: list[int] = []
    drafted_per_round = []
    while len(out) < most:
        before = stats.drafted
        room = context - (len(prompt) + len(out))   # positions left after the head token
        out += next(rounds)
        drafted = stats.drafted - before
        drafted_per_round.append(drafted)
        assert drafted <= max(0, min(k or 8, room))
        assert target.length <= context and drafter.decoder.length <= context
    assert out == expected
    assert len(out) == most
    if k is not None and draft == "self":
        assert drafted_per_round[-1] < k          # the draft shrank at the end
    with pytest.raises(ContextLengthError):
        next(rounds)
    rounds.close()


def test_context_limit_with_prompt_plus_max_tokens_exactly_fitting():
    """The runner's rule: prompt + max_new_tokens <= context_length."""
    context, prompt = 32, PROMPTS[2]
    n = context - len(prompt)
    expected = generate(PlainDecoding(decoder("llama", "self", context)), prompt, n)
    for k in (1, 4, 8, None):
        method = SpeculativeDecoding(decoder("llama", "self", context),
                                     DraftModelDrafter(decoder("llama", "other", context)), k=k)
        assert generate(method, prompt, n) == expected


def test_prefill_is_plain_decodings():
    """The Decoder protocol lets an engine compute a ``last_only`` feed with
    other kernels than a verification (llama.cpp does), so speculative
    decoding must prefill exactly as plain decoding does, and verify only
    what plain decoding feeds one token at a time."""
    prompt = PROMPTS[2]
    plain_target = FeedLog(decoder("qwen2", "self"))
    generate(PlainDecoding(plain_target), prompt, 8)
    sd_target = FeedLog(decoder("qwen2", "self"))
    generate(SpeculativeDecoding(sd_target, DraftModelDrafter(decoder("qwen2", "other")), k=3),
             prompt, 8)
    assert plain_target.feeds[0] == sd_target.feeds[0] == (len(prompt), True)
    assert all(not last_only for _, last_only in sd_target.feeds[1:])
