"""The llama.cpp peers on a tiny GGUF: llama-cpp-python as it comes, its
own prompt lookup, the peer set up like forerun's engine, and when they
load and free their models."""

import numpy as np
import pytest

import forerun
from forerun.bench import BenchSettings, run_bench
from forerun.bench.llama_cpp_reference import machine_cores
from forerun.bench.method import BenchContext
from forerun.bench.peers import LlamaCppMethod, _RecordedDrafts
from forerun.engines.llama_cpp_engine import CACHE_TYPES, cpu_has_amx

from .conftest import PROMPTS

llama_cpp = pytest.importorskip("llama_cpp")

CONTEXT = 1024
# A prompt that repeats itself: prompt lookup has something to propose.
REPETITIVE = [5, 6, 7, 8, 9, 10, 11, 12] * 8


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny random Qwen2 GGUF that llama.cpp loads, and the forerun model
    loaded from it: 2,048 positions, heads of 32 dimensions (q8_0 values,
    the matched peer's, come in blocks of 32)."""
    from tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path_factory.mktemp("peers") / "tiny.gguf", hidden_size=128,
                           intermediate_size=256, overrides={"qwen2.context_length": 2048},
                           pad_vocab=True)
    # float32: nothing to measure about which weight format is fastest
    model = forerun.load(path, context_length=CONTEXT, weights="float32", progress=False)
    return path, model


@pytest.fixture
def context(tiny_gguf):
    path, model = tiny_gguf
    return BenchContext(model, model_source=str(path))


@pytest.fixture
def peer(context):
    """``peer(name, mode, ...)``: a llama.cpp peer set up on the tiny GGUF,
    closed after the test."""
    made = []

    def make(name, mode, **kw):
        method = LlamaCppMethod(name, mode, **kw)
        made.append(method)
        method.setup(context)
        return method

    yield make
    for method in made:
        method.close()


def greedy(method, context, prompt_ids, n):
    return method.generate(context, prompt_ids, max_new_tokens=n, temperature=0.0, seed=0)


def test_the_plain_peer_is_llama_cpp_python_with_its_defaults(peer):
    method = peer("llamacpp-plain", "stock")
    params = method._llm.context_params
    assert params.type_k == params.type_v == CACHE_TYPES["f16"]
    assert params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    assert params.n_threads == params.n_threads_batch == machine_cores()
    assert params.n_ctx == CONTEXT
    assert params.n_batch == params.n_ubatch == 512          # Llama's defaults
    assert method._llm.model_params.n_gpu_layers == 0
    assert method._llm.model_params.use_extra_bufts == (not cpu_has_amx())
    assert method.baseline is None and method.peer
    for setting in (f"n_ctx={CONTEXT}", f"n_threads={machine_cores()}",
                    f"n_threads_batch={machine_cores()}", "n_batch=512", "n_ubatch=512",
                    "flash attention off", "f16 keys, f16 values", "n_gpu_layers=0",
                    "with its defaults", "half of them"):
        assert setting in method.note


def test_the_matched_peer_is_set_up_like_forerun_s_engine(peer):
    method = peer("llamacpp-matched", "matched")
    params = method._llm.context_params
    assert params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    assert (params.type_k, params.type_v) == (CACHE_TYPES["f16"], CACHE_TYPES["q8_0"])
    assert "like forerun's llama.cpp engine" in method.note
    assert "flash attention on, f16 keys, q8_0 values" in method.note


def test_prompt_lookup_reproduces_the_plain_peer_and_accepts_drafts(peer, context):
    plain = peer("llamacpp-plain", "stock")
    lookup = peer("llamacpp-lookup", "lookup")
    assert lookup.baseline == "llamacpp-plain"
    assert "LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=2)" in lookup.note
    assert "logits_all=True" in lookup.note
    expected = greedy(plain, context, REPETITIVE, 40)
    out = greedy(lookup, context, REPETITIVE, 40)
    assert out.tokens == expected.tokens
    assert len(out.tokens) == 40
    stats = out.stats
    assert stats["rounds"] > 0 and 0 < stats["accepted"] <= stats["drafted"]
    # Every round commits its accepted drafts and one token of the model's:
    # all tokens but the prompt forward's first (the last round, cut at 40
    # tokens, may end before its own token).
    assert stats["accepted"] + stats["rounds"] in (40 - 1, 40)


def test_a_lookup_length_of_its_own(peer):
    method = peer("llamacpp-lookup-k10", "lookup", lookup_tokens=10)
    assert "num_pred_tokens=10" in method.note


def test_prompt_lookup_runs_past_llama_cpp_python_s_batch(peer, context):
    """Prompt and answer longer than n_batch (512): llama-cpp-python's
    default keeps logits for only n_batch positions and fails there."""
    lookup = peer("llamacpp-lookup", "lookup")
    prompt = (list(range(20, 120)) * 6)[:560]
    out = greedy(lookup, context, prompt, 8)
    assert len(out.tokens) == 8


def test_a_later_turn_reuses_the_previous_prompt_as_llama_cpp_python_does(peer, context,
                                                                          monkeypatch):
    method = peer("llamacpp-plain", "stock")
    previous, prompt = REPETITIVE[:20], REPETITIVE[:20] + [30, 31, 32, 33]
    evaluated = []
    evaluate = method._llm.eval
    monkeypatch.setattr(method._llm, "eval",
                        lambda tokens: (evaluated.append(list(tokens)), evaluate(tokens))[1])
    method.before_turn(context, previous)        # untimed: the previous turn's prompt
    assert evaluated == [previous]
    out = greedy(method, context, prompt, 3)
    assert evaluated[1] == [30, 31, 32, 33]      # Llama.generate's own prefix reuse
    assert out.stats["reused_prompt_tokens"] == 20
    # A first turn starts from an empty cache.
    evaluated.clear()
    method.before_turn(context, None)
    out = greedy(method, context, prompt, 3)
    assert evaluated[0] == prompt and out.stats["reused_prompt_tokens"] == 0


def test_recorded_drafts_count_rounds_drafted_and_accepted():
    proposals = iter([[7, 8, 9], [], [4, 5]])
    drafts = _RecordedDrafts(lambda ids: np.array(next(proposals)), 100)
    for _ in range(3):
        drafts(list(range(10)))
    # Token 0 from the prompt's forward; round 1 accepts 7, 8 and adds 1;
    # round 2 drafted nothing; round 3 accepts nothing (6 is not 4).
    tokens = [3, 7, 8, 1, 2, 6]
    proposed_before = [0, 1, 1, 1, 2, 3]
    assert drafts.count(tokens, proposed_before) == {"rounds": 3, "drafted": 5, "accepted": 2}


def test_recorded_drafts_keep_what_fits_the_context():
    drafts = _RecordedDrafts(lambda ids: np.array([1, 2, 3, 4]), 12)
    drafts(list(range(10)))
    assert drafts.proposals == [[1, 2]]


def test_each_peer_loads_once_per_run_and_is_freed(tiny_gguf, monkeypatch):
    path, model = tiny_gguf
    built, closed = [], []
    original = llama_cpp.Llama

    class CountedLlama(original):
        def __init__(self, *args, **kwargs):
            built.append(self)   # held here: no garbage collection closes it
            super().__init__(*args, **kwargs)

        def close(self):
            closed.append(self)
            super().close()

    monkeypatch.setattr(llama_cpp, "Llama", CountedLlama)
    from forerun.bench.prompts import _parse

    prompts = [_parse(p, "test") for p in PROMPTS]
    report = run_bench(BenchSettings(model=str(path), methods=("plain",), max_new_tokens=4,
                                     warmup=1, progress=False, peer_llama_cpp=True),
                       model=model, prompts=prompts, log=lambda m: None)
    assert [m for m in report.methods] == ["plain", "llamacpp-plain", "llamacpp-lookup"]
    for name in ("llamacpp-plain", "llamacpp-lookup"):
        assert report.methods[name]["status"] == "ok", report.methods[name]
        assert all(r["status"] == "ok" for r in report.rows if r["method"] == name)
    # One Llama per peer for the whole run (three prompts, four turns, a
    # warm-up), each closed at the end.
    assert sorted(llm.draft_model is not None for llm in built) == [False, True]
    assert sorted(map(id, closed)) == sorted(map(id, built))
    lookup_rows = [r for r in report.rows if r["method"] == "llamacpp-lookup"]
    assert all(r["mismatch"] is not None for r in lookup_rows)
    assert "greedy: the tokens of llamacpp-plain on" in report.methods["llamacpp-lookup"]["note"]


@pytest.mark.parametrize("engine, extra", [("torch", []), ("llama.cpp", ["llamacpp-matched"])])
def test_the_matched_peer_joins_only_on_the_llama_cpp_engine(engine, extra):
    names = BenchSettings(engine=engine, methods=("plain",), peer_llama_cpp=True).method_names()
    assert names == ["plain", "llamacpp-plain", "llamacpp-lookup"] + extra


def test_on_a_cpu_with_amx_the_plain_peer_turns_the_extra_buffers_off(peer, monkeypatch):
    """llama.cpp's AMX kernels crash virtual machines that advertise AMX
    without allowing it: the one setting changed from llama-cpp-python's
    defaults, and the note says why."""
    import forerun.bench.llama_cpp_reference as reference
    import forerun.engines.llama_cpp_engine as engine

    monkeypatch.setattr(reference, "cpu_has_amx", lambda: True)
    monkeypatch.setattr(engine, "cpu_has_amx", lambda: True)
    method = peer("llamacpp-plain", "stock")
    assert method._llm.model_params.use_extra_bufts is False
    assert "extra weight buffers off" in method.note and "AMX" in method.note
