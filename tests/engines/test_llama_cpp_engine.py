"""The llama.cpp engine: the Decoder protocol's contracts, agreement with
llama-cpp-python itself (tokenizer and greedy generation on the same GGUF),
and lossless speculative decoding on it.

Skipped when llama-cpp-python is not installed, except in CI (``CI`` set),
where its absence is an error: these tests must not vanish there.
"""

import importlib.util
import os
import sys

import pytest
import torch

import forerun
from forerun.api.engine_policy import probe_tokens
from forerun.errors import (
    CacheStateError,
    ConfigError,
    ContextLengthError,
    EngineUnavailableError,
    InvalidTokenError,
    ModelFormatError,
    UnsupportedArchitectureError,
    UnsupportedOperationError,
)

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
if not HAVE_LLAMA_CPP and os.environ.get("CI"):
    raise RuntimeError("CI must run the llama.cpp engine tests: pip install 'forerun[llama]'")

needs_llama_cpp = pytest.mark.skipif(
    not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed (pip install 'forerun[llama]')")

CONTEXT = 1024
NEW_TOKENS = 32
# Two threads, the engine's default on these 2-core machines: several
# threads is where llama.cpp's kernels can disagree (see the engine's
# docstring), so that is what the tests run.
THREADS = 2

_MODELS: dict = {}
_REFERENCES: dict = {}


@pytest.fixture(scope="module")
def llama_model(preset_gguf):
    """``llama_model(name)``: a forerun Model of a preset on the llama.cpp
    engine, loaded once."""

    def get(name):
        if name not in _MODELS:
            preset_gguf(name)
            _MODELS[name] = forerun.load(name, engine="llama.cpp", context_length=CONTEXT,
                                         progress=False, engine_options={"n_threads": THREADS})
        return _MODELS[name]

    yield get
    for model in _MODELS.values():
        model.decoder.close()
    _MODELS.clear()


@pytest.fixture(scope="module")
def reference(preset_gguf):
    """``reference(name, vocab_only=False)``: llama-cpp-python's own ``Llama``
    on the same GGUF, set up like the engine."""
    from forerun.bench.llama_cpp_reference import reference_llama

    def get(name, vocab_only=False):
        key = (name, vocab_only)
        if key not in _REFERENCES:
            _REFERENCES[key] = reference_llama(preset_gguf(name), context_length=CONTEXT,
                                               n_threads=THREADS, vocab_only=vocab_only)
        return _REFERENCES[key]

    yield get
    for llm in _REFERENCES.values():
        llm.close()
    _REFERENCES.clear()


def chat(model, text):
    return model.encode_prompt(messages=[{"role": "user", "content": text}])


def llama_greedy(llm, prompt_ids, n):
    """``n`` greedy tokens from llama-cpp-python's own generation loop."""
    llm.reset()
    tokens = []
    gen = llm.generate(list(prompt_ids), top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0,
                       temp=0.0, repeat_penalty=1.0, reset=True)
    try:
        for token in gen:
            tokens.append(int(token))
            if len(tokens) == n:
                break
    finally:
        gen.close()
    return tokens


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def assert_same_tokens(model, prompt_ids, expected, got, label):
    if got == expected:
        return
    i = first_difference(expected, got)
    model.decoder.reset()
    logits = model.decoder.feed(list(prompt_ids) + expected[:i], last_only=True).logits[-1]
    top = logits.topk(2).values
    pytest.fail(f"{label}: first difference at token {i} ({expected[i:i + 3]} vs "
                f"{got[i:i + 3]}); top-2 logit gap there is {float(top[0] - top[1]):.3f}")


# -- engine selection ------------------------------------------------------------

def test_engine_unavailable_without_llama_cpp(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)   # import llama_cpp -> ImportError
    with pytest.raises(EngineUnavailableError, match=r"pip install 'forerun\[llama\]'"):
        forerun.load("smollm2-135m", engine="llama.cpp")


def test_unknown_engine():
    with pytest.raises(ConfigError, match="unknown engine"):
        forerun.load("smollm2-135m", engine="vllm")


@needs_llama_cpp
def test_llama_cpp_needs_a_gguf_and_the_cpu(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelFormatError, match="GGUF"):
        forerun.load(tmp_path, engine="llama.cpp")
    with pytest.raises(ConfigError, match="CPU"):
        forerun.load("smollm2-135m", engine="llama.cpp", device="cuda")
    with pytest.raises(ConfigError, match="engine_options"):
        forerun.load("smollm2-135m", engine_options={"n_threads": 1})


@needs_llama_cpp
def test_auto_runs_an_architecture_the_torch_engine_lacks_on_llama_cpp(tmp_path):
    from forerun.api.loader import choose_engine
    from tiny_gguf import write_tiny_gguf

    qwen = write_tiny_gguf(tmp_path / "qwen.gguf")
    other = write_tiny_gguf(tmp_path / "other.gguf", arch="frobnicator", pad_vocab=True)
    assert choose_engine(qwen) == "torch"
    assert choose_engine(write_tiny_gguf(tmp_path / "gemma.gguf", arch="gemma3")) == "torch"
    assert choose_engine(other) == "llama.cpp"
    assert choose_engine(tmp_path) == "torch"   # a folder: the torch engine says what's wrong
    # llama.cpp itself does not know it: the error names the architecture
    with pytest.raises(ModelFormatError, match="architecture 'frobnicator'.*qwen2, llama"):
        forerun.load(other, progress=False)
    with pytest.raises(UnsupportedArchitectureError,
                       match="'frobnicator' is not supported by forerun's torch engine"):
        forerun.load(other, engine="torch", progress=False)
    with pytest.raises(ConfigError, match="weights='q8' applies to the torch engine only"):
        forerun.load(other, weights="q8", progress=False)


def test_auto_without_llama_cpp_names_the_architecture_and_the_install(tmp_path,
                                                                       monkeypatch):
    from tiny_gguf import write_tiny_gguf

    other = write_tiny_gguf(tmp_path / "other.gguf", arch="frobnicator", pad_vocab=True)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)   # import llama_cpp -> ImportError
    with pytest.raises(UnsupportedArchitectureError,
                       match=r"'frobnicator'.*qwen2, llama.*pip install 'forerun\[llama\]'"):
        forerun.load(other, progress=False)


@pytest.mark.real_model
@needs_llama_cpp
def test_gemma3_ends_a_turn_at_end_of_turn_on_llama_cpp(llama_model):
    model = llama_model("gemma3-270m")
    end_of_turn = model.tokenizer.token_to_id("<end_of_turn>")
    assert set(model.eos_token_ids) == {model.tokenizer.eos_token_id, end_of_turn}
    # (the preset is the pretrained model, which rarely ends a turn:
    # stopping at any EOS id is tested on every engine elsewhere)
    out = model.generate(prompt="def reverse(s):", max_new_tokens=16)
    assert len(out.tokens) == 16 and out.text.strip()


@pytest.mark.real_model
@needs_llama_cpp
def test_engine_options(preset_gguf):
    path = preset_gguf("smollm2-135m")
    with pytest.raises(ConfigError, match="n_thread"):
        forerun.load(path, engine="llama.cpp", engine_options={"n_thread": 1})
    model = forerun.load(path, engine="llama_cpp", context_length=64,
                         engine_options={"n_threads": 1, "n_batch": 8})
    try:
        assert model.decoder.engine == "llama.cpp" and model.decoder.context_length == 64
        assert model.decoder.options["n_threads"] == 1
        assert model.decoder.options["n_batch"] == 8
    finally:
        model.decoder.close()
    model = forerun.load(path, engine="llama.cpp", context_length=64)
    try:
        assert model.decoder.options["n_threads"] == torch.get_num_threads()
        assert model.decoder.options["n_ubatch"] == 512 and model.decoder.options["flash_attn"]
        assert model.decoder.options["cache_type_k"] == "f16"
        assert model.decoder.options["cache_type_v"] == "q8_0"
    finally:
        model.decoder.close()
    with pytest.raises(ConfigError, match="cache_type_v must be one of f16, q8_0"):
        forerun.load(path, engine="llama.cpp", engine_options={"cache_type_v": "q4"})


# -- the Decoder protocol --------------------------------------------------------

@pytest.fixture(scope="module")
def smollm(llama_model):
    return llama_model("smollm2-135m")


@pytest.fixture
def decoder(smollm):
    d = smollm.decoder
    d.reset()
    yield d
    d.reset()


PROMPT = list(range(1000, 1040))
MORE = [300, 301, 302, 303, 304, 305, 306, 307, 308]


@pytest.mark.real_model
@needs_llama_cpp
def test_facts(smollm):
    d = smollm.decoder
    assert d.vocab_size == smollm.config.vocab_size == 49152
    assert d.context_length == CONTEXT
    assert d.capabilities.hidden_states is False and d.capabilities.tree_masks is False
    assert d.device == "cpu"
    assert d.eos_token_ids == smollm.config.eos_token_ids
    assert isinstance(d, forerun.protocol.decoder.Decoder)


@pytest.mark.real_model
@needs_llama_cpp
def test_feed_shapes_and_last_only(decoder):
    full = decoder.feed(PROMPT).logits
    assert full.dtype == torch.float32 and tuple(full.shape) == (len(PROMPT), 49152)
    assert decoder.length == len(PROMPT)
    decoder.reset()
    last = decoder.feed(PROMPT, last_only=True).logits
    assert tuple(last.shape) == (1, 49152)
    # A long prefill may take other kernels: close, not necessarily equal.
    assert torch.allclose(last[0], full[-1], atol=0.2)
    decoder.reset()
    assert torch.equal(decoder.feed(PROMPT[:7], last_only=True).logits[0], full[6])


@pytest.mark.real_model
@needs_llama_cpp
def test_rollback_restores_logits(decoder):
    decoder.feed(PROMPT, last_only=True)
    first = decoder.feed(MORE).logits
    decoder.rollback(len(PROMPT))
    assert decoder.length == len(PROMPT)
    decoder.feed([7, 8, 9, 10])             # something else in between
    decoder.rollback(len(PROMPT))
    again = decoder.feed(MORE).logits
    assert torch.equal(first, again)


@pytest.mark.real_model
@needs_llama_cpp
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"])
def test_logits_do_not_depend_on_how_positions_are_grouped(llama_model, name):
    """What makes speculative decoding lossless on this engine: after the
    same prefill, verifying k+1 positions in one feed gives the logits of
    k+1 one-position feeds, for any k, once the engine cuts verifications
    into the groups the probe measured exact on this machine."""
    model = llama_model(name)
    result = model.verification_grouping()
    decoder = model.decoder
    assert decoder.verify_group == result.exact_group >= 1
    decoder.reset()
    decoder.feed(PROMPT, last_only=True)
    one_by_one = torch.cat([decoder.feed([t]).logits for t in MORE])
    for size in (2, 3, 7, 9):
        decoder.rollback(len(PROMPT))
        grouped = torch.cat([decoder.feed(MORE[i:i + size]).logits
                             for i in range(0, len(MORE), size)])
        assert torch.equal(grouped, one_by_one), f"groups of {size}"
    if result.first_inexact is not None:
        # The probe's finding is real: fed as the probe fed it (its tokens,
        # at its cached lengths), one group of that size differs from its
        # one-position feeds.  Not necessarily on PROMPT: whether a larger
        # group's other kernels round differently depends on the values
        # (on a Zen 3, Gemma 3's group past the exact ones matched here).
        size = result.first_inexact
        tokens = probe_tokens(model, max(result.contexts) + size)
        decoder.verify_group = size
        try:
            differs = []
            for c in result.contexts:
                decoder.reset()
                decoder.feed(tokens[:c], last_only=True)
                alone = torch.cat([decoder.feed([t]).logits for t in tokens[c:c + size]])
                decoder.rollback(c)
                differs.append(not torch.equal(decoder.feed(tokens[c:c + size]).logits, alone))
            assert any(differs), result
        finally:
            decoder.verify_group = result.exact_group


@pytest.mark.real_model
@needs_llama_cpp
def test_grouping_probe_is_stored_per_machine_and_settings(llama_model, tmp_path, monkeypatch):
    """The probe runs once per machine and engine settings: a second model
    with the same settings reads it back, other thread counts measure anew,
    and a damaged record is measured again."""
    from forerun.engines.llama_cpp_engine import LlamaCppDecoder
    from forerun.protocol import grouping_probe

    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path))
    monkeypatch.setattr(LlamaCppDecoder, "probe_context", 200)   # what is stored, not how long
    calls = []
    real = grouping_probe.exact_group_size
    monkeypatch.setattr(grouping_probe, "exact_group_size",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    path = llama_model("smollm2-135m").decoder.path

    def fresh(threads):
        m = forerun.load(str(path), engine="llama.cpp", context_length=CONTEXT, progress=False,
                         engine_options={"n_threads": threads})
        try:
            return m.verification_grouping()
        finally:
            m.decoder.close()

    first = fresh(THREADS)
    assert calls == [1]
    assert fresh(THREADS) == first and calls == [1]
    fresh(1)
    assert calls == [1, 1]
    records = list((tmp_path / "calibration" / "grouping").glob("*.json"))
    assert len(records) == 2
    for record in records:
        record.write_text('{"key": 3, "value": "garbage"}')
    assert fresh(THREADS) == first and len(calls) == 3


@pytest.mark.real_model
@needs_llama_cpp
def test_grouping_invariance_up_to_the_default_context(preset_gguf):
    """Past 256, 512 and 1024 cached positions llama.cpp's flash attention
    changes how it tiles the keys (and, with F16 keys and values on several
    threads, splits them across threads).  With the engine's defaults and
    the probed group size, a verification still gives the logits of
    one-position feeds near the end of the default context (4096)."""
    from forerun.engines.llama_cpp_engine import LlamaCppDecoder

    model = forerun.load("smollm2-135m", engine="llama.cpp", progress=False,
                         engine_options={"n_threads": THREADS})
    try:
        decoder = model.decoder
        assert decoder.context_length == 4096 and decoder.options["cache_type_v"] == "q8_0"
        group = model.verification_grouping().exact_group
        long_prompt = probe_tokens(model, 4096 - 2 * len(MORE))
        decoder.reset()
        for length in (600, 1154, 2100, len(long_prompt)):
            decoder.feed(long_prompt[decoder.length:length], last_only=True)
            together = decoder.feed(MORE).logits
            decoder.rollback(length)
            one_by_one = torch.cat([decoder.feed([t]).logits for t in MORE])
            decoder.rollback(length)
            assert torch.equal(together, one_by_one), f"at {length} cached positions"
        # F16 values are exact only on one thread (the documented fallback).
        with LlamaCppDecoder(decoder.path, context_length=CONTEXT, n_threads=1,
                             cache_type_v="f16") as f16_values:
            f16_values.verify_group = group
            f16_values.feed(long_prompt[:600], last_only=True)
            together = f16_values.feed(MORE[:group]).logits
            f16_values.rollback(600)
            one_by_one = torch.cat([f16_values.feed([t]).logits for t in MORE[:group]])
            assert torch.equal(together, one_by_one)
    finally:
        model.decoder.close()


@pytest.mark.real_model
@needs_llama_cpp
def test_feeds_longer_than_a_batch(smollm, decoder):
    from forerun.engines.llama_cpp_engine import LlamaCppDecoder

    expected = decoder.feed(PROMPT).logits
    with LlamaCppDecoder(smollm.decoder.path, context_length=128, n_batch=16,
                         n_threads=THREADS) as small:
        assert torch.equal(small.feed(PROMPT).logits, expected)
        small.reset()
        assert torch.equal(small.feed(PROMPT, last_only=True).logits[0], expected[-1])


@pytest.mark.real_model
@needs_llama_cpp
def test_context_overflow_changes_nothing(smollm):
    from forerun.engines.llama_cpp_engine import LlamaCppDecoder

    with LlamaCppDecoder(smollm.decoder.path, context_length=48, n_threads=THREADS) as d:
        d.feed(PROMPT, last_only=True)
        with pytest.raises(ContextLengthError, match="do not fit"):
            d.feed(MORE)                     # 40 + 9 > 48
        assert d.length == len(PROMPT)
        got = d.feed(MORE[:8]).logits        # exactly fills the context
        assert d.length == 48
        with pytest.raises(ContextLengthError):
            d.feed([5])
        d.reset()
        d.feed(PROMPT, last_only=True)
        assert torch.equal(d.feed(MORE[:8]).logits, got)


@pytest.mark.real_model
@needs_llama_cpp
def test_commit_floor(decoder):
    decoder.feed(PROMPT[:10], last_only=True)
    decoder.commit()
    assert decoder.committed_length == 10
    decoder.feed(PROMPT[10:20], last_only=True)
    with pytest.raises(CacheStateError):
        decoder.rollback(9)
    with pytest.raises(CacheStateError):
        decoder.rollback(21)
    with pytest.raises(CacheStateError):
        decoder.commit(5)                    # the floor never goes down
    with pytest.raises(CacheStateError):
        decoder.commit(25)
    decoder.rollback(10)
    assert decoder.length == 10
    decoder.reset()
    assert decoder.length == 0 and decoder.committed_length == 0


@pytest.mark.real_model
@needs_llama_cpp
def test_bad_tokens(decoder):
    with pytest.raises(InvalidTokenError):
        decoder.feed([5, -1])
    with pytest.raises(InvalidTokenError):
        decoder.feed([49152])
    with pytest.raises(CacheStateError):
        decoder.feed([])
    assert decoder.length == 0


@pytest.mark.real_model
@needs_llama_cpp
def test_forward_supports_only_the_causal_mask(decoder):
    decoder.feed(PROMPT, last_only=True)
    start, t = decoder.length, 4
    causal = torch.ones(t, start + t, dtype=torch.bool).tril(diagonal=start)
    got = decoder.forward(MORE[:t], list(range(start, start + t)), causal).logits
    decoder.rollback(start)
    assert torch.equal(got, decoder.feed(MORE[:t]).logits)
    decoder.rollback(start)
    tree = causal.clone()
    tree[2, start + 1] = False               # siblings: node 2 does not see node 1
    with pytest.raises(UnsupportedOperationError, match="tree"):
        decoder.forward(MORE[:t], [start, start + 1, start + 1, start + 2], tree)
    with pytest.raises(UnsupportedOperationError):
        decoder.forward(MORE[:t], list(range(start, start + t)), tree)
    with pytest.raises(CacheStateError, match="shape"):
        decoder.forward(MORE[:t], list(range(start, start + t)), causal[:, 1:])
    assert decoder.length == start
    with pytest.raises(UnsupportedOperationError, match="hidden"):
        decoder.feed([5], return_hidden=True)


@pytest.mark.real_model
@needs_llama_cpp
def test_fork_has_its_own_cache(decoder):
    expected = decoder.feed(PROMPT).logits
    fork = decoder.fork()
    try:
        assert fork.length == 0 and decoder.length == len(PROMPT)
        assert torch.equal(fork.feed(PROMPT).logits, expected)
        fork.rollback(5)
        fork.feed([9, 9, 9])
        assert decoder.length == len(PROMPT)
        after = decoder.feed(MORE[:2]).logits     # untouched by what the fork did
        fork.reset()
        assert torch.equal(fork.feed(PROMPT + MORE[:2]).logits[-2:], after)
    finally:
        fork.close()


@pytest.mark.real_model
@needs_llama_cpp
def test_closed_decoder(smollm):
    d = smollm.decoder.fork()
    d.close()
    d.close()                                # twice is fine
    with pytest.raises(CacheStateError, match="closed"):
        d.feed([5])
    # the model stays loaded for the decoder it was forked from
    smollm.decoder.reset()
    assert smollm.decoder.feed([5, 6]).logits.shape == (2, 49152)
    smollm.decoder.reset()


# -- agreement with llama-cpp-python ----------------------------------------------

TOKENIZER_TEXTS = [
    "Hello world",
    " leading space and trailing space ",
    "def fibonacci(n):\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }",
    "x = {'a': [1, 2, 3], \"b\": None}  # comment",
    "Numbers: 1234567890 3.14159 -42 1e-9 0x1F",
    "Größe, naïve café, Ærøskøbing, Zürich",
    "日本語のテキストと中文文本",
    "Привет, мир! Как дела?",
    "emoji 🙂🚀👩‍💻 mixed with text",
    "tabs\tand\nnewlines\r\n\n\nand    many     spaces",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "I'm sure you've heard they'll go, we'd done it, it's DON'T",
    "https://example.com/path?query=1&other=two#frag",
    "    indented\n\tcode\n",
    "ALLCAPS lowercase CamelCase snake_case kebab-case",
    "a" * 40 + " " + "ab" * 15,
    "$$\\frac{a}{b} + \\sqrt{x^2}$$",
    "''' triple quotes \"\"\" and `backticks`",
]


@pytest.mark.real_model
@needs_llama_cpp
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_tokenizer_agrees_with_llama_cpp(llama_model, reference, name):
    model = llama_model(name)
    llm = reference(name, vocab_only=True)
    for text in TOKENIZER_TEXTS:
        ours = model.tokenizer.encode(text, add_special_tokens=False)
        theirs = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        assert ours == theirs, f"{name}: tokens differ on {text!r}"
        back = llm.detokenize(theirs, special=True).decode("utf-8")
        assert model.tokenizer.decode(ours) == back == text, f"{name}: text differs on {text!r}"


GREEDY_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash table is in three sentences.",
    "Repeat exactly: the quick brown fox jumps over the lazy dog.",
]


@pytest.mark.real_model
@needs_llama_cpp
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m",
                                  pytest.param("qwen2.5-coder-1.5b", marks=pytest.mark.slow)])
def test_greedy_matches_llama_cpp_python(llama_model, reference, name):
    model = llama_model(name)
    llm = reference(name)
    for text in GREEDY_PROMPTS:
        ids = chat(model, text)
        ours = model.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        theirs = llama_greedy(llm, ids, NEW_TOKENS)
        assert_same_tokens(model, ids, theirs, ours.tokens, f"{name} on {text[:30]!r}")


# -- speculative decoding on the engine ----------------------------------------

SD_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Repeat the following sentence exactly twice: the quick brown fox jumps over the "
    "lazy dog.",
]
KS = [1, 3, None]


def check_speculative(model, draft, label):
    for text in SD_PROMPTS:
        ids = chat(model, text)
        plain = model.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS)
        for k in KS:
            out = model.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, draft=draft,
                                 draft_k=k)
            assert_same_tokens(model, ids, plain.tokens, out.tokens,
                               f"{label}, k={k}, on {text[:30]!r}")
            assert out.finish_reason == plain.finish_reason
            assert out.stats.accepted <= out.stats.drafted


@pytest.mark.real_model
@needs_llama_cpp
def test_ngram_is_lossless(smollm):
    check_speculative(smollm, "ngram", "smollm2 ngram")


@pytest.mark.real_model
@needs_llama_cpp
def test_ngram_is_lossless_on_gemma3(llama_model):
    gemma = llama_model("gemma3-270m")
    assert gemma.config.architecture == "gemma3"
    check_speculative(gemma, "ngram", "gemma3 ngram")


@pytest.mark.real_model
@needs_llama_cpp
def test_self_draft_on_a_fork_is_lossless(smollm):
    check_speculative(smollm, smollm, "smollm2 drafting for itself")
    out = smollm.generate(prompt_ids=chat(smollm, SD_PROMPTS[0]), max_new_tokens=16,
                          draft=smollm, draft_k=3)
    assert out.stats.acceptance_rate == 1.0      # the same model drafts exactly its output


@pytest.mark.real_model
@needs_llama_cpp
def test_pytorch_draft_for_a_llama_cpp_target(smollm, preset_model):
    draft = preset_model("smollm2-135m", CONTEXT)   # forerun's torch engine, same tokenizer
    assert draft.tokenizer.fingerprint() == smollm.tokenizer.fingerprint()
    check_speculative(smollm, draft, "smollm2 on llama.cpp with a torch draft")
    out = smollm.generate(prompt_ids=chat(smollm, SD_PROMPTS[1]), max_new_tokens=16,
                          draft=draft, draft_k=3)
    assert out.stats.acceptance_rate > 0.5       # dequantized weights: nearly the same model


@pytest.mark.real_model
@pytest.mark.slow
@needs_llama_cpp
def test_draft_model_is_lossless_with_both_on_llama_cpp(llama_model):
    target = llama_model("qwen2.5-coder-1.5b")
    check_speculative(target, llama_model("qwen2.5-coder-0.5b"), "1.5B + 0.5B draft")


LONG_DOCUMENT = " ".join(
    f"Step {i}: the service reads batch {i} from the queue, checks its {i % 7 + 2} "
    f"records against the schema, writes the valid ones to table t{i % 3}, and logs "
    f"the rejected ones with their line numbers."
    for i in range(1, 13))


@pytest.mark.real_model
@needs_llama_cpp
def test_speculative_is_lossless_past_256_positions_with_threads(llama_model):
    """Past 256 cached positions, on two threads, with a prefill large enough
    for llama.cpp's large-batch kernels and verifications of up to 9
    positions: speculative decoding still gives plain decoding's tokens."""
    model = llama_model("qwen2.5-coder-0.5b")
    assert model.decoder.options["n_threads"] == 2
    ids = chat(model, "Summarise this log in three sentences, then list the tables "
                      "it writes to.\n\n" + LONG_DOCUMENT)
    assert len(ids) > 300
    plain = model.generate(prompt_ids=ids, max_new_tokens=48, ignore_eos=True)
    for draft, k in (("ngram", None), ("ngram", 8), (model, 8)):
        out = model.generate(prompt_ids=ids, max_new_tokens=48, ignore_eos=True,
                             draft=draft, draft_k=k)
        assert_same_tokens(model, ids, plain.tokens, out.tokens, f"draft {draft}, k={k}")
        # The adaptive length may rightly take plain steps all the way, where
        # the measured costs say a draft cannot pay; a fixed k always drafts.
        assert out.stats.drafted > 0 or k is None, (draft, k)


@pytest.mark.real_model
@pytest.mark.slow
@needs_llama_cpp
def test_asynchronous_drafting_is_lossless_on_a_thread_each(llama_model):
    """The 1.5B verifies on one thread while the 0.5B drafts on the other
    (the default split of two): greedy output is plain decoding's on two
    threads, and both models have their two threads back afterwards."""
    target, draft = llama_model("qwen2.5-coder-1.5b"), llama_model("qwen2.5-coder-0.5b")
    # One prompt (CI time: each 1.5B generation on one thread takes half a
    # minute); the asynchronous rules are checked on many more with the
    # torch engine and the tiny models.
    for text in SD_PROMPTS[:1]:
        ids = chat(target, text)
        plain = target.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS)
        for k in (3, None):
            out = target.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, draft=draft,
                                  draft_k=k, draft_async=True)
            assert_same_tokens(target, ids, plain.tokens, out.tokens,
                               f"asynchronous 1.5B + 0.5B, k={k}, on {text[:30]!r}")
            assert (out.stats.draft_threads, out.stats.target_threads) == (1, 1)
    assert target.decoder.threads == draft.decoder.threads == THREADS
