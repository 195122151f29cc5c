"""forerun's PyTorch engine on a GPU: tiny random Qwen2 and Llama models
loaded through the public API (``forerun.load(..., device=...)``) in every
weight format, checked on the device against transformers on the same
device, and every decoding method's greedy output checked token for token
against plain decoding there.

Every test runs once per device of :func:`devices_under_test`: ``cuda``
where torch sees a GPU, and also ``cpu`` with ``FORERUN_TEST_CUDA_ON_CPU=1``
(which proves the tests themselves on a machine without one).  With neither,
every test is skipped at once (CI has no GPU).  Nothing here needs a shipped
model.  The ``gguf`` package is needed all the same: ``forerun.load`` imports
it even for a Hugging Face folder (``load_model_files`` imports the
conversion cache, whose GGUF reader imports ``gguf``); the GGUF test also
writes its file with it.

The tolerances were measured on the CPU (AMD EPYC, AVX2; forerun's native
int8/int4 kernels, torch's, and an emulation of the GPU's path: int8/int4
values dequantized to bfloat16) on these very models and prompt: the largest
logit difference was 2.4e-7 in float32, 2.7e-3 in bfloat16, and, against
transformers running the same quantized values, 6.8e-3 in q8 and 6.5e-3 in
q4.  Each tolerance is four to six times that (float32's far more, for
another device's summation order), and each is checked, on the device, to
be at most a fifth of the difference a wrong model makes (the same weights
with two layers swapped: 0.34 to 0.37 here).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

import forerun
from forerun.engines.linear import QUANTIZED_FORMATS, quantize_int4, quantize_int8
from forerun.engines.transformer import PADDED_ROWS
from forerun.protocol.grouping_probe import MAX_GROUP
from tiny_models import VOCAB, hf_model, tiny_tokenizer_json  # noqa: F401 (VOCAB: see tiny)

ON_CPU_VARIABLE = "FORERUN_TEST_CUDA_ON_CPU"


def devices_under_test() -> list[str]:
    """``["cuda"]`` where torch sees a GPU, plus ``"cpu"`` when
    ``FORERUN_TEST_CUDA_ON_CPU=1`` (to exercise these tests without one)."""
    devices = ["cuda"] if torch.cuda.is_available() else []
    if os.environ.get(ON_CPU_VARIABLE, "") == "1":
        devices.append("cpu")
    return devices


DEVICES = devices_under_test()
SKIP_REASON = (f"no CUDA device (torch {torch.__version__} sees none); set "
               f"{ON_CPU_VARIABLE}=1 to run these tests on the CPU")
DEVICE_PARAMS = DEVICES or [pytest.param("cuda", marks=pytest.mark.skip(reason=SKIP_REASON))]

ARCHS = ("qwen2", "llama")
FORMATS = ("float32", "bfloat16", "q8", "q4", "q4-all")
# Largest logit difference from transformers on the same device (see the
# module's docstring); q8/q4 against transformers running their values.
TOLERANCE = {"float32": 1e-4, "bfloat16": 1.5e-2, "q8": 3e-2, "q4": 3e-2, "q4-all": 3e-2}
CONTEXT = 256            # room for the grouping probe's long context (160 + 16)
N_NEW = 40
# Greedy outputs of the random models vary with larger weights than
# transformers' default init (as in tests/decoding/test_speculative_greedy.py);
# the draft is the target with 2% relative noise (acceptance about 0.5).
INIT = dict(initializer_range=0.2)
PERTURBATION = 0.02
PROMPT_IDS = torch.randint(3, 250, (20,), generator=torch.Generator().manual_seed(2)).tolist()
OTHER_IDS = torch.randint(3, 250, (20,), generator=torch.Generator().manual_seed(3)).tolist()
TEXT = "the quick brown fox jumps over the lazy dog, hello world, the quick brown"
MATRICES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
            "gate_proj.weight", "up_proj.weight", "down_proj.weight")


# -- fixtures --------------------------------------------------------------------------

@pytest.fixture(scope="module", params=DEVICE_PARAMS)
def device(request):
    return request.param


@pytest.fixture(scope="module")
def forerun_cache(tmp_path_factory):
    """An empty forerun cache for the module (``FORERUN_CACHE``): the
    calibration records (grouping probe, verification costs), compiled
    kernels and converted models go there, nowhere else."""
    root = tmp_path_factory.mktemp("forerun-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FORERUN_CACHE", str(root))
        yield root


def _save(model, folder: Path) -> Path:
    model.save_pretrained(folder, safe_serialization=True)
    tiny_tokenizer_json(folder)
    return folder


def _perturbed(model):
    model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * PERTURBATION * float(p.std()))
    return model


def _tokenizer_size(tmp_path_factory) -> int:
    """How many tokens the tiny tokenizer has (299 with tokenizers 0.23,
    where tiny_models' VOCAB is 300)."""
    from tokenizers import Tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    tiny_tokenizer_json(folder)
    return Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Per architecture, transformers models (on the CPU) and their Hugging
    Face folders: ``parity`` (default init, for logit parity), ``target``
    and ``draft`` (its perturbed copy), sharing one tokenizer.  The models
    that generate have exactly the tokenizer's vocabulary: a random model
    of tiny_models' VOCAB rows can generate an id the tokenizer lacks, which
    the generation's text decoding refuses (InvalidTokenError)."""
    out = {"vocab": _tokenizer_size(tmp_path_factory)}
    for arch in ARCHS:
        parity = hf_model(arch, seed=0)
        target = hf_model(arch, seed=0, vocab_size=out["vocab"], **INIT)
        draft = _perturbed(target)
        for role, model in (("parity", parity), ("target", target), ("draft", draft)):
            out[arch, role] = (model, _save(model, tmp_path_factory.mktemp(f"{arch}-{role}")))
    return out


@pytest.fixture(scope="module")
def load(device, forerun_cache):
    """``load(folder, weights)``: a forerun Model on the device, loaded once
    per module through the public API."""
    models: dict = {}

    def get(folder: Path, weights: str) -> forerun.Model:
        key = (str(folder), weights)
        if key not in models:
            models[key] = forerun.load(folder, device=device, weights=weights,
                                       context_length=CONTEXT, progress=False)
        return models[key]

    yield get
    models.clear()
    if device == "cuda":
        torch.cuda.empty_cache()


def _quantized_state(state: dict, fmt: str) -> dict:
    """The weights as ``fmt`` holds them (float32 again): what transformers
    runs as the reference of a quantized format.  Quantized formats keep the
    embedding as int8 rows and every matrix (LM head included) in their
    own kind (an HF folder's matrices all fit 4-bit groups of 32)."""
    if fmt not in QUANTIZED_FORMATS:
        return state
    out = {}
    for name, value in state.items():
        if name == "model.embed_tokens.weight":
            value = quantize_int8(value).dequantize()
        elif name == "lm_head.weight" or name.endswith(MATRICES):
            value = (quantize_int8(value) if fmt == "q8" else quantize_int4(value)).dequantize()
        out[name] = value
    return out


def _swapped_layers(state: dict) -> dict:
    """The same weights with layers 0 and 1 swapped: a wrong model."""
    out = dict(state)
    for name, value in state.items():
        for a, b in ((".layers.0.", ".layers.1."), (".layers.1.", ".layers.0.")):
            if a in name:
                out[name.replace(a, b)] = value
    return out


@pytest.fixture(scope="module")
def reference(device, tiny):
    """``reference(arch, fmt, ids, wrong=False)``: transformers' float32
    logits ``[T, vocab]`` on the device for the parity model's weights as
    ``fmt`` holds them (``wrong``: with two layers swapped)."""
    cache: dict = {}

    def logits(arch: str, fmt: str, ids: list[int], wrong: bool = False) -> torch.Tensor:
        key = (arch, fmt, tuple(ids), wrong)
        if key not in cache:
            model, _ = tiny[arch, "parity"]
            state = _quantized_state(model.state_dict(), fmt)
            if wrong:
                state = _swapped_layers(state)
            ref = copy.deepcopy(model)
            ref.load_state_dict(state)
            ref = ref.to(device)
            with torch.no_grad():
                out = ref(torch.tensor([ids], device=device)).logits[0].float()
            assert out.device.type == device
            cache[key] = out
        return cache[key]

    return logits


def _held_tensors(obj, seen: set | None = None):
    """Every tensor a forerun object holds (its layers, norms, tables)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _held_tensors(item, seen)
    elif type(obj).__module__.startswith("forerun.") and hasattr(obj, "__dict__"):
        for value in vars(obj).values():
            yield from _held_tensors(value, seen)


def _matrix_layers(network):
    layers = [network.lm_head]
    for block in network.layers:
        layers += [block.qkv, block.o, block.gate_up, block.down]
    return [p for layer in layers for p in getattr(layer, "parts", [layer])]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a.float() - b.float()).abs().max().item()


# -- loading ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", ARCHS)
def test_loads_onto_the_device(device, load, tiny, arch, fmt):
    model = load(tiny[arch, "parity"][1], fmt)
    decoder, network = model.decoder, model.decoder.model
    assert decoder.device.type == device
    assert network.weights_format == fmt
    assert decoder.settings.device.startswith(device)
    held = list(_held_tensors(network))
    assert len(held) > 20
    wrong = {t.device.type for t in held} - {device}
    assert not wrong, f"tensors on {wrong}, not on {device}"
    cache = decoder.cache
    assert cache.keys.device.type == device and cache.values.device.type == device
    assert cache.keys.dtype == torch.float32         # the cache stays float32 in every format
    if device != "cpu" and fmt in QUANTIZED_FORMATS:
        # Off the CPU the int8/int4 values run dequantized to bfloat16.
        for layer in _matrix_layers(network):
            assert not layer._kernel and layer.weight.dtype == torch.bfloat16, layer.format
    out = decoder.feed(PROMPT_IDS[:4])
    assert out.logits.device.type == device and out.logits.dtype == torch.float32
    assert decoder.length == 4
    decoder.reset()


# -- logit parity with transformers ----------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(device, load, tiny, reference, arch, fmt):
    """A 20-token prompt's logits at every position, through each path a
    generation takes: a whole forward (as a verification), a prefill's
    last row, and one position at a time (as plain decoding)."""
    tol = TOLERANCE[fmt]
    want = reference(arch, fmt, PROMPT_IDS)
    wrong = _max_diff(reference(arch, fmt, PROMPT_IDS, wrong=True), want)
    assert wrong > 5 * tol, f"the {fmt} tolerance {tol} would not tell a wrong model apart " \
                            f"(it differs by {wrong:.3g})"
    decoder = load(tiny[arch, "parity"][1], fmt).decoder
    decoder.reset()
    whole = decoder.feed(PROMPT_IDS).logits
    assert whole.device.type == device
    decoder.reset()
    last = decoder.feed(PROMPT_IDS, last_only=True).logits
    decoder.reset()
    steps = torch.cat([decoder.feed([t]).logits for t in PROMPT_IDS])
    decoder.reset()
    for path, got, ref in (("whole", whole, want), ("prefill", last, want[-1:]),
                           ("one by one", steps, want)):
        diff = _max_diff(got, ref)
        assert diff < tol, f"{arch} {fmt} on {device}, {path}: logits differ by {diff:.3g}"


# -- the KV cache ------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "q8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_rollback_and_refeed_give_identical_logits(device, load, tiny, reference, arch, fmt):
    decoder = load(tiny[arch, "parity"][1], fmt).decoder
    decoder.reset()
    decoder.feed(PROMPT_IDS[:12], last_only=True)
    fresh = decoder.feed(PROMPT_IDS[12:]).logits
    decoder.reset()
    decoder.feed(PROMPT_IDS[:12], last_only=True)
    decoder.feed(OTHER_IDS[:8])                       # a wrong continuation ...
    assert decoder.length == 20
    decoder.rollback(12)                              # ... forgotten
    assert decoder.length == 12
    again = decoder.feed(PROMPT_IDS[12:]).logits
    assert decoder.length == len(PROMPT_IDS)
    assert torch.equal(again, fresh)
    assert _max_diff(again, reference(arch, fmt, PROMPT_IDS)[12:]) < TOLERANCE[fmt]
    # Rolled back further than once, into the prompt, and fed on one by one.
    decoder.rollback(5)
    rows = torch.cat([decoder.feed([t]).logits for t in PROMPT_IDS[5:]])
    assert _max_diff(rows, reference(arch, fmt, PROMPT_IDS)[5:]) < TOLERANCE[fmt]
    decoder.reset()


# -- the grouping probe ---------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["float32", "bfloat16"])
def test_grouping_probe_measures_the_device(device, tiny, tmp_path, monkeypatch,
                                            record_property, fmt):
    """The probe runs on the device (a fresh cache: measured, not read),
    its result governs the decoder, and groups of that size are exact
    there on tokens the probe never saw.  Off the CPU every forward of up
    to PADDED_ROWS positions runs at that many rows, so every group up to
    them is exact by construction: the probe must find all of them, and
    they must hold on windows of other tokens (unpadded, on an H200,
    bfloat16 groups the probe had found exact differed on 1 to 10 of 28
    such windows)."""
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path))
    model = forerun.load(tiny["qwen2", "target"][1], device=device, weights=fmt,
                         context_length=CONTEXT, progress=False)
    records = tmp_path / "calibration" / "grouping"
    assert not records.exists() or not any(records.iterdir())
    result = model.verification_grouping()
    assert list(records.iterdir()), "the probe's result was not recorded"
    assert f'"{device}' in next(records.iterdir()).read_text()     # measured on the device
    group = result.exact_group
    if device == "cpu":
        assert 1 <= group <= MAX_GROUP == result.max_group
    else:           # the engine's ceiling off the CPU (TorchDecoder.group_ceiling)
        assert group == result.max_group == model.decoder.group_ceiling == PADDED_ROWS
    assert model.decoder.verify_group == group
    print(f"\n{device} {fmt}: {result.describe()}")
    record_property(f"grouping_{device}_{fmt}", result.to_dict())

    decoder = model.decoder
    gen = torch.Generator().manual_seed(9)
    windows = (24, 170) if device == "cpu" else (24, 40, 60, 80, 100, 120, 150, 170) * 4
    for context in windows:
        tokens = torch.randint(3, 250, (context + group,), generator=gen).tolist()
        decoder.reset()
        decoder.feed(tokens[:context], last_only=True)
        one_by_one = torch.cat([decoder.feed([t]).logits for t in tokens[context:]])
        for size in range(2, group + 1):
            decoder.rollback(context)
            together = decoder.feed(tokens[context:context + size]).logits
            assert torch.equal(together, one_by_one[:size]), \
                f"a group of {size} at {context} differs on {device} ({fmt})"
    decoder.reset()


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "q4"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_verified_tree_is_exact(device, load, tiny, arch, fmt):
    """A tree of drafts verified in one forward with a tree attention mask
    (cut into the probe's groups) gives each node exactly the logits its
    branch gets fed one position at a time, as plain decoding feeds it:
    what keeps Medusa and draft-model trees token-identical."""
    model = load(tiny[arch, "target"][1], fmt)
    model.verification_grouping()
    decoder = model.decoder
    head, (a, b, c, d) = PROMPT_IDS[:16], PROMPT_IDS[16:20]
    base = len(head)
    mask = torch.zeros(4, base + 4, dtype=torch.bool)
    mask[:, :base] = True
    for node, parents in enumerate([[], [0], [0], [0, 2]]):   # a; b <- a; c <- a; d <- c <- a
        mask[node, [base + p for p in parents] + [base + node]] = True
    decoder.reset()
    decoder.feed(head, last_only=True)
    tree = decoder.forward([a, b, c, d], [base, base + 1, base + 1, base + 2],
                           mask.to(device)).logits
    branches = []
    for branch in ([a, b], [a, c, d]):
        decoder.rollback(base)
        branches.append(torch.cat([decoder.feed([t]).logits for t in branch]))
    left, right = branches
    assert torch.equal(tree, torch.stack([left[0], left[1], right[1], right[2]])), \
        f"a verified tree differs from plain decoding on {device} ({fmt}, groups of " \
        f"{decoder.verify_group})"
    decoder.reset()


# -- greedy speculative decoding ---------------------------------------------------------------

def _medusa_heads(seed: int, vocab: int, hidden: int = 64, n: int = 3):
    from forerun.drafters.medusa.heads import MedusaHeads

    gen = torch.Generator().manual_seed(seed)
    blocks = [[(torch.randn(hidden, hidden, generator=gen) * 0.3 / hidden ** 0.5,
                torch.randn(hidden, generator=gen) * 0.1)] for _ in range(n)]
    return MedusaHeads(blocks, None, None, vocab, {})


@pytest.fixture(scope="module")
def medusa(tiny):
    return {arch: _medusa_heads(n, tiny["vocab"]) for n, arch in enumerate(ARCHS)}


def _draft_arguments(method: str, draft, heads, draft_folder: Path) -> dict:
    return {
        "ngram": dict(draft="ngram", draft_k=4),
        "draft-chain": dict(draft=draft, draft_k=3, draft_lookup=False),
        "draft-adaptive+lookup": dict(draft=draft),
        "draft-path": dict(draft=str(draft_folder), draft_k=3),
        "draft-tree": dict(draft=draft, tree_nodes=6),
        "draft-async": dict(draft=draft, draft_async=True, draft_k=3),
        "medusa": dict(draft=heads, draft_k=6),
    }[method]


# Whether a method drafts every round (so it must have drafted something).
ALWAYS_DRAFTS = {"draft-chain", "draft-path", "draft-tree", "draft-async", "medusa"}
GREEDY_CASES = ([(fmt, m) for fmt in ("float32", "bfloat16")
                 for m in ("draft-chain", "draft-adaptive+lookup", "ngram", "draft-tree",
                           "draft-async", "medusa")]
                + [(fmt, m) for fmt in ("q8", "q4") for m in ("draft-path", "ngram")])


def _lookup_must_match(prompt: list[int], new: list[int]) -> bool:
    """Whether prompt lookup (n-grams of 2 to 4) must have found a match
    in a generation of ``new`` after ``prompt``: a round ends after each
    committed token but the last (unless a draft was accepted, which is
    drafting), and drafts when the sequence's last two tokens occurred
    before."""
    sequence = prompt + new
    seen = {tuple(sequence[i - 1:i + 1]) for i in range(1, len(prompt))}
    for i in range(len(prompt), len(sequence) - 1):
        pair = tuple(sequence[i - 1:i + 1])
        if pair in seen:
            return True
        seen.add(pair)
    return False


@pytest.mark.parametrize("fmt,method", GREEDY_CASES, ids=[f"{f}-{m}" for f, m in GREEDY_CASES])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_speculative_equals_plain(device, load, tiny, medusa, arch, fmt, method):
    target = load(tiny[arch, "target"][1], fmt)
    draft_folder = tiny[arch, "draft"][1]
    kwargs = _draft_arguments(method, load(draft_folder, fmt), medusa[arch], draft_folder)
    drafted = 0
    # A chat (the template rendered, then tokenized) and token ids.
    for prompt in (dict(messages=[{"role": "user", "content": TEXT}]),
                   dict(prompt_ids=PROMPT_IDS)):
        plain = target.generate(**prompt, max_new_tokens=N_NEW, ignore_eos=True)
        assert len(plain.tokens) == N_NEW
        out = target.generate(**prompt, max_new_tokens=N_NEW, ignore_eos=True, **kwargs)
        assert out.tokens == plain.tokens, f"{method} on {device} ({fmt}) is not plain greedy"
        assert out.text == plain.text
        stats = out.stats
        assert stats.rounds >= 1 and 0 <= stats.accepted <= stats.drafted
        drafted += stats.drafted
        if method == "ngram" and _lookup_must_match(target.encode_prompt(**prompt),
                                                    plain.tokens):
            assert stats.drafted > 0, "prompt lookup had a match but drafted nothing"
    if method in ALWAYS_DRAFTS:
        assert drafted > 0, f"{method} drafted nothing: only plain steps were tested"
    # The real path: the grouping probe ran on this device and the
    # verifications were cut into its exact groups.
    grouping = target.verification_grouping()
    assert 1 <= grouping.exact_group <= MAX_GROUP
    assert target.decoder.verify_group == grouping.exact_group
    assert stats.verify_group == grouping.exact_group
    assert target.decoder.device.type == device
    for draft_model in target.drafts:
        assert draft_model.decoder.device.type == device
    if method == "draft-path":
        # Loaded by path beside the target: on its device, in q4-all beside
        # a quantized target (forerun.api.loader.draft_weights).
        assert target.drafts[-1].decoder.model.weights_format == "q4-all"


# -- sampling ----------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["plain", "draft-chain", "draft-tree", "ngram", "medusa"])
@pytest.mark.parametrize("arch", ARCHS)
def test_sampling_runs_and_repeats_with_a_seed(device, forerun_cache, tiny, medusa, arch,
                                               method):
    """Sampling on the device gives tokens of the vocabulary, and the same
    ones again for the same seed.  Each run loads its models afresh, as a
    new process would: the adaptive methods learn as they run (Medusa's
    tree follows its heads' measured accuracy), so a second run on the same
    models may draft other trees and draw other (equally distributed)
    tokens."""
    draft_folder = tiny[arch, "draft"][1]

    def fresh(folder: Path) -> forerun.Model:
        return forerun.load(folder, device=device, weights="float32", context_length=CONTEXT,
                            progress=False)

    def sample(seed: int) -> list[int]:
        target = fresh(tiny[arch, "target"][1])
        kwargs = ({} if method == "plain" else
                  _draft_arguments(method, fresh(draft_folder), medusa[arch], draft_folder))
        out = target.generate(prompt_ids=PROMPT_IDS, max_new_tokens=24, temperature=0.9,
                              top_p=0.95, seed=seed, ignore_eos=True, **kwargs)
        assert target.decoder.device.type == device
        assert (out.stats.method == "plain") == (method == "plain")
        if method not in ("plain", "ngram"):
            assert out.stats.drafted > 0
        return out.tokens

    first = sample(11)
    assert len(first) == 24 and all(isinstance(t, int) and 0 <= t < tiny["vocab"]
                                    for t in first)
    assert sample(11) == first, f"{method} sampling on {device} does not repeat with its seed"
    assert sample(12) != first, "another seed drew the very same 24 tokens"


# -- a GGUF file ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["float32", "q8", "q4", "auto"])
def test_gguf_loads_onto_the_device(device, request, forerun_cache, reference, fmt):
    """A tiny GGUF (float32 tensors; the parity Qwen2's weights), loaded on
    the device twice: built (converted or packed), then read back from
    forerun's cache; both give transformers' logits, and the same ones."""
    pytest.importorskip("gguf")
    path = request.getfixturevalue("gguf_path")
    first = forerun.load(path, device=device, weights=fmt, context_length=64, progress=False)
    second = forerun.load(path, device=device, weights=fmt, context_length=64,
                          progress=False)
    resolved = first.decoder.model.weights_format
    assert resolved == second.decoder.model.weights_format
    if fmt == "auto" and device != "cpu":
        assert resolved in ("float32", "bfloat16")
    logits = []
    for model in (first, second):
        held = list(_held_tensors(model.decoder.model))
        assert held and {t.device.type for t in held} == {device}
        logits.append(model.decoder.feed(PROMPT_IDS).logits)
        model.decoder.reset()
    assert torch.equal(logits[0], logits[1])
    diff = _max_diff(logits[0], reference("qwen2", resolved, PROMPT_IDS))
    assert diff < TOLERANCE[resolved], f"GGUF in {resolved} on {device}: differs by {diff:.3g}"
