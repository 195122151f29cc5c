"""Speculative decoding with asynchronous drafting is lossless and ends
cleanly.

* Greedy: token-identical to plain decoding on tiny random Qwen2 and Llama
  models, for fixed and adaptive draft lengths.
* Sampling: the 3-token joint chi-square test of
  :mod:`decoding.test_speculative_sampling`, and its broken twin that
  verifies a draft drafted from a stale (rejected) context.
* Through the API: 200 short generations with random stop tokens, lengths,
  cancellations, closed and dropped streams, and a draft model slowed by
  random delays: no hang, no drafter thread left behind, every output
  plain decoding's (greedy) or the same for the same seed (sampled).  And an
  error in the drafter thread reaches the caller, after which both models
  work.
"""

from __future__ import annotations

import gc
import random
import threading
from dataclasses import dataclass

import pytest
import torch

import forerun
from decoding.test_speculative_greedy import N_NEW, PROMPTS, decoder, generate, reference
from decoding.test_speculative_sampling import (
    DRAFTS,
    TARGET,
    TEMPERATURE,
    TOP_P,
    _partial_support_draft,
    assert_detected,
    assert_exact,
    check_stats,
    draw_counts,
)
from forerun.decoding.stats import GenerationStats
from forerun.drafters import async_draft as async_module
from forerun.drafters.async_draft import AsyncDraftModelDrafter
from forerun.drafters.async_speculative import AsyncSpeculativeDecoding
from forerun.errors import DrafterError
from quick import draws
from table_decoders import TableDecoder, single_thread  # noqa: F401 (autouse fixture)
from thread_decoders import DelayedDecoder, FailingDecoder

pytest.importorskip("transformers")

from tiny_models import hf_model, tiny_tokenizer_json  # noqa: E402

# The broken twin (verifying stale drafts) is caught at p = 0 (chi2 1,635 on
# 32 dof) with a quarter of N_TWIN draws: exactness tests of N_TWIN draws tell
# apart any rule as wrong, with a wide margin.
N_SAMPLED = draws(3_000, 1_500)   # per exactness test: a thread per generation costs ~1 ms
N_TWIN = 3_000          # power test only: not in the quick subset
N_STRESS = draws(200, 60)         # generations of the stress test
WAIT = 300.0            # seconds before the stress test counts as hung


def drafter_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "forerun-drafter"]


# -- greedy: token-identical to plain decoding ----------------------------------

@pytest.mark.parametrize("k", [1, 3, None], ids=lambda k: f"k={k}")
@pytest.mark.parametrize("draft", ["perturbed", "other"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_async_equals_plain(arch, draft, k):
    method = AsyncSpeculativeDecoding(decoder(arch, "self"),
                                      AsyncDraftModelDrafter(decoder(arch, draft)), k=k)
    for prompt in PROMPTS:
        stats = GenerationStats()
        assert generate(method, prompt, N_NEW, stats) == reference(arch, prompt)
        assert 0 <= stats.accepted <= stats.drafted
        assert not drafter_threads()


# -- sampling: the target's distribution -----------------------------------------

def asynchronous(draft_table, k: int = 4) -> AsyncSpeculativeDecoding:
    return AsyncSpeculativeDecoding(TableDecoder(TARGET),
                                    AsyncDraftModelDrafter(TableDecoder(draft_table)), k=k)


@pytest.mark.parametrize("draft,params,prompt,k", [
    ("skewed", TEMPERATURE, [1], 4),
    ("partial_support", TOP_P, [3, 5], 2),      # k=2: many bonus tokens
], ids=["skewed-k4", "partial_support-k2"])
def test_async_sampling_is_exact(draft, params, prompt, k):
    counts, stats = draw_counts(asynchronous(DRAFTS[draft], k), params, prompt, N_SAMPLED,
                                seed=1)
    check_stats(stats, N_SAMPLED)
    assert 0.02 < stats.acceptance_rate < 0.9
    assert stats.discarded > 0, "no draft was ever drafted from a rejected context"
    assert_exact(counts, params, prompt, f"async {draft}")


@dataclass
class _Recorded(async_module._Proposal):
    """A proposal that remembers it was made."""

    def __post_init__(self) -> None:
        DRAFTED.setdefault(self.position, []).append(self)


DRAFTED: dict[int, list] = {}


def _verifies_stale_drafts(propose):
    """A broken twin of ``propose``: where the thread once drafted a token
    at the same position from another context (one later rejected), that
    stale token is verified instead, as if it had been drafted from the
    committed context.  (A stale draft verified with its *own*
    distribution would still be exact: speculative sampling accepts any
    proposal distribution; the error a verifier can make is to take a draft
    of one context for a draft of another.)"""

    def broken(self, sequence, k, sampler):
        draft = propose(self, sequence, k, sampler)
        tokens = list(draft.tokens)
        context = async_module.hash_tokens(sequence)
        for i, token in enumerate(draft.tokens):
            position = len(sequence) + i
            stale = [p for p in DRAFTED.get(position, []) if p.context != context]
            if stale:
                tokens[i] = stale[-1].token
            context = async_module.extend_hash(context, token)
        return type(draft)(tokens, draft.probs)

    return broken


def _forgetting(begin):
    def fresh(self, prompt_ids):
        DRAFTED.clear()
        begin(self, prompt_ids)

    return fresh


@pytest.mark.power
def test_broken_twin_verifying_stale_drafts_is_detected(monkeypatch):
    monkeypatch.setattr(async_module, "_Proposal", _Recorded)
    monkeypatch.setattr(AsyncDraftModelDrafter, "propose",
                        _verifies_stale_drafts(AsyncDraftModelDrafter.propose))
    monkeypatch.setattr(AsyncDraftModelDrafter, "begin",
                        _forgetting(AsyncDraftModelDrafter.begin))
    counts, stats = draw_counts(asynchronous(_partial_support_draft(), k=4), TEMPERATURE, [1],
                                N_TWIN, seed=2)
    assert stats.discarded > 0
    assert_detected(counts, TEMPERATURE, [1], "async verifying stale drafts")


# -- through the API: stops, cancels, dropped streams, errors ----------------------

FLOAT32 = {"weights": "float32"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Qwen2 target and a draft perturbed from it (acceptance about
    0.5), loaded through forerun.load with a tokenizer."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FORERUN_CACHE", str(tmp_path_factory.mktemp("cache")))
        target = hf_model("qwen2", seed=3)
        draft = hf_model("qwen2", seed=3)
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05 * float(p.std()))
        loaded = []
        for name, model in (("target", target), ("draft", draft)):
            folder = tmp_path_factory.mktemp(name)
            model.save_pretrained(folder, safe_serialization=True)
            tiny_tokenizer_json(folder)
            loaded.append(forerun.load(folder, context_length=96, device="cpu",
                                       progress=False, **FLOAT32))
        yield loaded


N_MAX = 24


def test_stress_of_stops_cancels_and_dropped_streams(models, monkeypatch):
    target, draft = models
    # Every draft forward sleeps 0..2 ms, differently each run.
    monkeypatch.setattr(draft, "decoder", DelayedDecoder(draft.decoder, 0.002, seed=11))
    monkeypatch.setattr(target, "_methods", {})
    rng = random.Random(2024)
    prompts = [[rng.randrange(3, 290) for _ in range(rng.randrange(1, 12))] for _ in range(6)]
    plain = {tuple(p): target.generate(prompt_ids=p, max_new_tokens=N_MAX,
                                       ignore_eos=True).tokens for p in prompts}
    sampled: dict = {}
    repeats = []
    failures: list[str] = []
    counts: dict[str, int] = {}

    def one(i: int) -> None:
        prompt = rng.choice(prompts)
        expected = plain[tuple(prompt)]
        kind = rng.choice(["length", "stop", "cancel-callable", "cancel-event", "closed",
                           "dropped", "sampled"])
        counts[kind] = counts.get(kind, 0) + 1
        args = dict(prompt_ids=prompt, ignore_eos=True, draft=draft, draft_async=True,
                    draft_k=rng.choice([None, 1, 2, 4]), max_new_tokens=N_MAX)
        timer = None
        if kind == "length":
            n = rng.randrange(1, N_MAX + 1)
            result = target.generate(**{**args, "max_new_tokens": n})
            ok = result.tokens == expected[:n] and result.finish_reason == "length"
        elif kind == "stop":
            stop = expected[rng.randrange(N_MAX)]
            result = target.generate(**args, stop_token_ids=[stop])
            end = expected.index(stop) + 1
            ok = result.tokens == expected[:end] and result.finish_reason == "stop"
        elif kind in ("cancel-callable", "cancel-event"):
            if kind == "cancel-callable":
                calls = iter(range(rng.randrange(1, 8)))
                cancel = lambda: next(calls, None) is None  # noqa: E731
            else:
                cancel = threading.Event()
                timer = threading.Timer(rng.random() * 0.02, cancel.set)
                timer.start()
            result = target.generate(**args, cancel=cancel)
            n = len(result.tokens)
            ok = (result.tokens == expected[:n]
                  and result.finish_reason == ("length" if n == N_MAX else "cancelled"))
        elif kind in ("closed", "dropped"):
            stream = target.stream(**args)
            for _ in range(rng.randrange(0, 4)):
                if next(stream, None) is None:
                    break
            if kind == "closed":
                stream.close()
            else:
                del stream           # collected: its generation ends
                gc.collect()
            ok = True
        else:   # sampled: the same seed gives the same tokens, whatever the delays
            prompt = prompts[i % 2]
            args.update(prompt_ids=prompt, temperature=0.9, seed=0, draft_k=3)
            result = target.generate(**args)
            if tuple(prompt) in sampled:
                repeats.append(i)
            ok = sampled.setdefault(tuple(prompt), result.tokens) == result.tokens
        if timer is not None:
            timer.cancel()
            timer.join()
        if not ok:
            failures.append(f"generation {i} ({kind}): wrong output")
        if drafter_threads() or threading.active_count() != baseline[0]:
            failures.append(f"generation {i} ({kind}): a thread outlived it: "
                            f"{[t.name for t in threading.enumerate()]}")

    baseline = []

    def all_of_them() -> None:
        baseline.append(threading.active_count())
        for i in range(N_STRESS):
            one(i)

    worker = threading.Thread(target=all_of_them, daemon=True)
    worker.start()
    worker.join(WAIT)
    assert not worker.is_alive(), f"hung (kinds so far: {counts})"
    assert not failures, failures[:5]
    assert sum(counts.values()) == N_STRESS and len(counts) == 7
    assert repeats, "no sampled generation was repeated"


def test_drafter_error_reaches_the_caller_and_models_stay_usable(models, monkeypatch):
    target, draft = models
    # Feeds 1-4 time a draft step before the split, 5 is the prompt: 8 is a draft step.
    failing = FailingDecoder(draft.decoder, fail_at=8, error=RuntimeError("injected"))
    monkeypatch.setattr(draft, "decoder", failing)
    monkeypatch.setattr(target, "_methods", {})
    prompt = [5, 17, 99, 3]
    plain = target.generate(prompt_ids=prompt, max_new_tokens=N_MAX, ignore_eos=True)
    with pytest.raises(DrafterError, match="RuntimeError: injected"):
        target.generate(prompt_ids=prompt, max_new_tokens=N_MAX, ignore_eos=True, draft=draft,
                        draft_async=True, draft_k=2)
    assert not drafter_threads()
    failing.armed = False
    for options in ({"draft_async": True}, {}):
        again = target.generate(prompt_ids=prompt, max_new_tokens=N_MAX, ignore_eos=True,
                                draft=draft, **options)
        assert again.tokens == plain.tokens
    assert draft.generate(prompt_ids=prompt, max_new_tokens=4).tokens


def test_the_model_keeps_its_threads_where_another_count_changes_its_logits(
        models, monkeypatch, tmp_path):
    """Verifying on fewer threads than plain decoding is exact only where the
    grouping probe finds that count gives the same logits: else an explicit
    target_threads is refused, and the default split leaves the model its
    own threads; a smaller exact group on that count caps verifications."""
    from forerun.errors import ConfigError
    from forerun.protocol import grouping_probe
    from forerun.protocol.grouping_probe import GroupingResult

    target, draft = models
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path))
    monkeypatch.setattr(target, "_methods", {})
    answer = {"exact": 0}
    real = grouping_probe.exact_group_size

    def probe(decoder, tokens, *, contexts, max_group=16, threads=None):
        if threads is None:
            return real(decoder, tokens, contexts=contexts, max_group=max_group)
        exact = answer["exact"]
        return GroupingResult(exact, max_group, exact + 1, 1e-5, tuple(contexts))

    monkeypatch.setattr(grouping_probe, "exact_group_size", probe)
    prompt = [5, 17, 99, 3]
    plain = target.generate(prompt_ids=prompt, max_new_tokens=N_MAX, ignore_eos=True).tokens
    torch.set_num_threads(2)      # set back by the single_thread fixture
    with pytest.raises(ConfigError, match="target_threads=1: on 1 thread.*other logits"):
        target.generate(prompt_ids=prompt, max_new_tokens=4, draft=draft, draft_async=True,
                        target_threads=1)
    kept = target.generate(prompt_ids=prompt, max_new_tokens=N_MAX, ignore_eos=True,
                           draft=draft, draft_async=True, draft_k=3)
    assert (kept.stats.draft_threads, kept.stats.target_threads) == (1, 2)
    assert kept.tokens == plain
    answer["exact"] = 2
    monkeypatch.setattr(target, "_methods", {})
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "again"))
    split = target.generate(prompt_ids=prompt, max_new_tokens=N_MAX, ignore_eos=True,
                            draft=draft, draft_async=True, draft_k=3)
    own_group = target.verification_grouping().exact_group
    assert (split.stats.target_threads, split.stats.verify_group) == (1, min(own_group, 2))
    assert split.tokens == plain
    assert torch.get_num_threads() == 2
