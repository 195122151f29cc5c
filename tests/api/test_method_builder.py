"""The one builder from a speculation config to a decoding method: draft
models load like the target and are checked against it, and every method
the API builds keeps plain decoding's greedy output."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import forerun
from forerun.api.loader import check_draft_model, draft_weights, load_draft_model
from forerun.drafters.draft_window import DEFAULT_DRAFT_WINDOW
from forerun.errors import ConfigError, GenerationConfigError, ModelNotFoundError, TokenizerError
from forerun.speculation import resolve
from tiny_models import hf_folders


def _tokenizer(fingerprint):
    return SimpleNamespace(fingerprint=lambda: fingerprint)


def test_check_draft_model_refuses_another_tokenizer_and_a_shorter_context():
    target = SimpleNamespace(name="target", tokenizer=_tokenizer("abc"),
                             decoder=SimpleNamespace(context_length=64))
    check_draft_model(target, "draft", _tokenizer("abc"), 64)
    check_draft_model(target, "draft", _tokenizer("abc"), 128)
    with pytest.raises(TokenizerError, match="draft model draft uses a different tokenizer"):
        check_draft_model(target, "draft", _tokenizer("xyz"), 64)
    with pytest.raises(ConfigError, match=r"draft's context \(32\) is shorter.*\(64\)"):
        check_draft_model(target, "draft", _tokenizer("abc"), 32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folders = hf_folders(tmp_path_factory, (5, 6), prefix="d")
    target = forerun.load(folders[0], context_length=64, device="cpu", weights="float32",
                          progress=False)
    return target, folders[1]


@pytest.fixture()
def never_loads(monkeypatch):
    """A draft model load that fails the test if it is reached."""
    import forerun.api.loader

    def load(*args, **kwargs):
        pytest.fail("the draft model was loaded before it was refused")

    monkeypatch.setattr(forerun.api.loader, "load", load)


def test_a_draft_with_another_tokenizer_is_refused_before_it_loads(tiny, tmp_path, never_loads):
    """Issue 42 row 7: a draft with another tokenizer was refused only after
    its weights were packed and measured (127 s).  Its header decides."""
    import json
    import shutil

    target, draft_folder = tiny
    other = tmp_path / "other-tokenizer"
    shutil.copytree(draft_folder, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]          # two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(TokenizerError, match="different tokenizer"):
        load_draft_model(target, other)


def test_a_mistyped_drafter_is_named_as_one(tiny, never_loads):
    """'sufix' is neither a preset nor a path: the error says so, and names
    the built-in drafters it may have meant."""
    target, _ = tiny
    with pytest.raises(ModelNotFoundError, match="neither a preset nor an existing path.*"
                                                 "built-in drafter: ngram, suffix, medusa, eagle"):
        load_draft_model(target, "sufix")


def test_a_draft_with_a_shorter_context_is_refused_before_it_loads(tiny, tmp_path, never_loads):
    import json
    import shutil

    target, draft_folder = tiny
    short = tmp_path / "short"
    shutil.copytree(draft_folder, short)
    config = json.loads((short / "config.json").read_text())
    config["max_position_embeddings"] = 32
    (short / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"draft's context \(32\) is shorter.*\(64\)"):
        load_draft_model(target, short)


def test_a_draft_path_loads_like_the_target(tiny):
    target, draft_folder = tiny
    draft = load_draft_model(target, draft_folder)
    assert draft.decoder.context_length == target.decoder.context_length
    assert draft.decoder.settings.weights == target.decoder.settings.weights
    assert draft.decoder.settings.engine == target.decoder.settings.engine


def test_a_quantized_targets_draft_runs_every_matrix_in_4_bits(tiny):
    """Beside a q4 or q8 target the draft loads in q4-all (its precision
    never changes the output); beside a float target, in the target's
    format."""
    assert [draft_weights(f) for f in ("q4", "q8", "q4-all", "float32", "bfloat16")] == \
        ["q4-all", "q4-all", "q4-all", "float32", "bfloat16"]
    target, draft_folder = tiny
    quantized = forerun.load(target.source, context_length=64, device="cpu", weights="q8",
                             progress=False)
    draft = load_draft_model(quantized, draft_folder)
    assert draft.decoder.settings.weights == "q4-all"
    layer = draft.decoder.model.layers[0].gate_up
    assert layer.format == "q4"


def test_api_draft_none_is_plain_decoding(tiny):
    target, _ = tiny
    plain = target.generate(prompt_ids=[1, 2, 3], max_new_tokens=8, ignore_eos=True)
    none = target.generate(prompt_ids=[1, 2, 3], max_new_tokens=8, ignore_eos=True,
                           draft="none")
    assert none.tokens == plain.tokens and none.stats.method == plain.stats.method
    with pytest.raises(GenerationConfigError, match="draft_k needs a draft"):
        target.generate(prompt_ids=[1, 2, 3], max_new_tokens=2, draft="none", draft_k=2)


def test_api_draft_tree_matches_plain_and_refuses_wrong_combinations(tiny):
    target, draft_folder = tiny
    plain = target.generate(prompt_ids=[1, 2, 3], max_new_tokens=12, ignore_eos=True)
    for nodes in (None, 4):
        out = target.generate(prompt_ids=[1, 2, 3], max_new_tokens=12, ignore_eos=True,
                              draft=draft_folder, draft_tree=True, tree_nodes=nodes)
        assert out.tokens == plain.tokens
    wrong = [
        (dict(draft="ngram", draft_tree=True), "need a draft model"),
        (dict(draft=draft_folder, draft_tree=True, draft_k=3),
         "draft_k does not apply to a draft model's trees"),
        (dict(draft=draft_folder, tree_nodes=3, draft_async=True), "ask for two shapes"),
        (dict(draft=draft_folder, tree_nodes=0), "tree_nodes must be a positive integer"),
        (dict(draft=draft_folder, draft_tree="yes"), "draft_tree must be true or false"),
        (dict(draft=None, draft_tree=True), "need a draft model"),
    ]
    for kwargs, message in wrong:
        with pytest.raises(GenerationConfigError, match=message):
            target.generate(prompt_ids=[1, 2, 3], max_new_tokens=2, **kwargs)


def test_api_draft_lookup_matches_plain_and_refuses_wrong_combinations(tiny):
    target, draft_folder = tiny
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    plain = target.generate(prompt_ids=prompt, max_new_tokens=16, ignore_eos=True)
    out = target.generate(prompt_ids=prompt, max_new_tokens=16, ignore_eos=True,
                          draft=draft_folder, draft_lookup=True)
    assert out.tokens == plain.tokens and out.stats.method == "draft+lookup"
    method, _ = target._method(resolve(draft_folder, draft_lookup=True))
    assert method.planner.model.context.window == DEFAULT_DRAFT_WINDOW
    # By default a draft model drafts beside prompt lookup where it can: not
    # with a fixed length, a tree or asynchronous drafting, nor when told not to.
    default = target.generate(prompt_ids=prompt, max_new_tokens=16, ignore_eos=True,
                              draft=draft_folder)
    assert default.tokens == plain.tokens and default.stats.method == "draft+lookup"
    for kwargs, name in [(dict(draft_lookup=False), "draft"), (dict(draft_k=2), "draft"),
                         (dict(draft_tree=True), "draft-tree"),
                         (dict(draft_async=True), "draft-async")]:
        out = target.generate(prompt_ids=prompt, max_new_tokens=16, ignore_eos=True,
                              draft=draft_folder, **kwargs)
        assert out.tokens == plain.tokens and out.stats.method == name, kwargs
    wrong = [
        (dict(draft="ngram", draft_lookup=True), "for prompt lookup alone draft with 'ngram'"),
        (dict(draft=None, draft_lookup=True), "draft_lookup needs a draft model"),
        (dict(draft=draft_folder, draft_lookup=True, draft_k=2), "drop draft_k"),
        (dict(draft=draft_folder, draft_lookup=True, draft_tree=True), "two shapes"),
        (dict(draft=draft_folder, draft_lookup=True, draft_async=True), "draft_async"),
        (dict(draft=draft_folder, draft_lookup=1), "draft_lookup must be true, false"),
    ]
    for kwargs, message in wrong:
        with pytest.raises(GenerationConfigError, match=message):
            target.generate(prompt_ids=[1, 2, 3], max_new_tokens=2, **kwargs)


@pytest.mark.parametrize("options, drafter_of", [
    (dict(draft_lookup=True), lambda m: m.planner.model),
    (dict(draft_lookup=False), lambda m: m.drafter),
    (dict(draft_tree=True), lambda m: m.planner.drafter),
    (dict(draft_async=True), lambda m: m.drafter),
])
def test_every_draft_model_method_reads_the_window_it_is_given(tiny, options, drafter_of):
    target, draft_folder = tiny
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 5, 6, 7]
    plain = target.generate(prompt_ids=prompt, max_new_tokens=12, ignore_eos=True)
    for window, expected in ((None, DEFAULT_DRAFT_WINDOW), (8, 8), ("all", None)):
        config = resolve(draft_folder, draft_window=window, **options)
        out = target.generate(prompt_ids=prompt, max_new_tokens=12, ignore_eos=True,
                              speculative=config)
        assert out.tokens == plain.tokens
        method, _ = target._method(config)
        assert drafter_of(method).context.window == expected


def _eagle_weights(target, **overrides):
    from forerun.drafters.eagle.weights import Eagle3Config, Eagle3Weights

    c = target.decoder.model.config
    values = dict(hidden_size=c.hidden_size, intermediate_size=32, num_heads=c.num_heads,
                  num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                  rope_theta=c.rope_theta, rope_scaling=None, vocab_size=c.vocab_size,
                  draft_vocab_size=64, aux_layers=(0, 1, 2))
    values.update(overrides)
    return Eagle3Weights.random(Eagle3Config(**values), seed=1)


def test_api_eagle_heads_match_plain_as_objects_and_folders(tiny, tmp_path):
    """An EAGLE-3 head given as weights or as a folder in the published
    layout (``draft='eagle:PATH'``) drafts chains and trees that keep plain
    decoding's output; a head for another model, a missing one and the
    options that don't apply are refused."""
    from forerun.drafters.eagle.files import save_eagle3
    from forerun.errors import ModelNotFoundError

    target, _ = tiny
    plain = target.generate(prompt_ids=[1, 2, 3], max_new_tokens=12, ignore_eos=True)
    weights = _eagle_weights(target)
    save_eagle3(weights, tmp_path / "head")
    for draft in (weights, f"eagle:{tmp_path / 'head'}"):
        # (prompt lookup beside the head unless a length, a tree or False is asked)
        for options, lookup in (({}, True), ({"draft_k": 3}, False),
                                ({"draft_tree": True}, False), ({"tree_nodes": 4}, False),
                                ({"draft_lookup": True}, True), ({"draft_lookup": False}, False)):
            out = target.generate(prompt_ids=[1, 2, 3], max_new_tokens=12, ignore_eos=True,
                                  draft=draft, **options)
            assert out.tokens == plain.tokens, (draft, options)
            assert out.stats.method.startswith("eagle"), out.stats.method
            assert out.stats.method.endswith("+lookup") == lookup, (options, out.stats.method)
            if options.get("draft_k") or options.get("tree_nodes"):
                # (an adaptive policy drafts only where measured costs say it pays)
                assert out.stats.drafted > 0
    wrong = [
        (dict(draft=weights, draft_lookup=True, draft_k=2), GenerationConfigError,
         "drop draft_k"),
        (dict(draft=weights, draft_async=True), GenerationConfigError, "needs a draft model"),
        (dict(draft=_eagle_weights(target, vocab_size=999)), ConfigError,
         "trained for another model"),
        (dict(draft="eagle:"), ConfigError, "needs a path"),
        (dict(draft="eagle"), ModelNotFoundError, "ships no EAGLE head"),
        (dict(draft=f"eagle:{tmp_path / 'nothing'}"), ModelNotFoundError, "nothing"),
    ]
    for kwargs, error, message in wrong:
        with pytest.raises(error, match=message):
            target.generate(prompt_ids=[1, 2, 3], max_new_tokens=2, **kwargs)


def test_a_draft_model_beside_suffix_drafting_matches_plain_and_drafts_earlier_answers(
        tiny, monkeypatch):
    """The new pairing of the one ``*-lookup`` rule: a draft model beside
    suffix drafting (``draft_lookup="suffix"``), greedy, keeps plain
    decoding's tokens; asked again, the answer the model gave before drafts
    it.  Its broken twin, prompt lookup beside the draft (blind to earlier
    answers), verifies as often the second time as the first.

    The verification costs are pinned (``k`` positions cost ``1 + 0.1(k-1)``
    times one, a memory-bound forward): this test asks what the drafter
    remembers, not what the machine measured.  Costs measured in CI (and
    stored by other tests of the same tiny model) once made long lookup
    drafts look dear, and the second ask took 24 rounds, not 15 or fewer."""
    from forerun.decoding.draft_length import VerifyCosts
    from forerun.drafters.ngram import NgramDrafter
    from forerun.drafters.suffix import SuffixDrafter

    monkeypatch.setattr(VerifyCosts, "__call__", lambda self, k: 1e-3 * (1 + 0.1 * (k - 1)))
    target, draft_folder = tiny
    prompt = [7, 3, 9, 1, 12, 5]
    plain = target.generate(prompt_ids=prompt, max_new_tokens=32, ignore_eos=True)
    rounds = {}
    for lookup, drafter in (("suffix", SuffixDrafter), (True, NgramDrafter)):
        target.suffix_store().clear()
        asks = [target.generate(prompt_ids=prompt, max_new_tokens=32, ignore_eos=True,
                                draft=draft_folder, draft_lookup=lookup) for _ in range(2)]
        assert [a.tokens for a in asks] == [plain.tokens] * 2
        method, _ = target._method(resolve(draft_folder, draft_lookup=lookup))
        assert isinstance(method.planner.lookup, drafter)
        rounds[lookup] = [a.stats.rounds for a in asks]
    assert asks[0].stats.method == "draft+lookup"
    first, second = rounds["suffix"]
    assert second <= first // 2, rounds            # the earlier answer drafted itself
    assert rounds[True][1] > 2 * second, rounds    # prompt lookup: no such help


def test_speculative_takes_a_dict_or_a_config_and_the_keywords_are_its_shorthand(tiny):
    """One place decides a request's speculation: ``speculative=`` as a dict
    of options or a resolved config, or the same options as keywords."""
    target, _ = tiny
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    by_keywords = target.generate(prompt_ids=prompt, max_new_tokens=12, ignore_eos=True,
                                  draft="ngram", draft_k=2)
    by_dict = target.generate(prompt_ids=prompt, max_new_tokens=12, ignore_eos=True,
                              speculative={"draft": "ngram", "draft_k": 2})
    by_config = target.generate(prompt_ids=prompt, max_new_tokens=12, ignore_eos=True,
                                speculative=resolve("ngram", draft_k=2))
    assert by_keywords.tokens == by_dict.tokens == by_config.tokens
    assert by_keywords.stats.method == by_dict.stats.method == by_config.stats.method == "ngram"
    wrong = [
        (dict(speculative={"draft": "ngram"}, draft_k=2), "not both"),
        (dict(speculative=resolve("ngram"), draft="ngram"), "not both"),
        (dict(speculative={"draft": "ngram", "draftk": 2}), "unknown speculation option 'draftk'"),
        (dict(speculative="ngram"), "speculative must be a SpeculativeConfig"),
        (dict(speculative={"draft": "ngram", "draft_k": 0}), "draft_k must be a positive"),
    ]
    for kwargs, message in wrong:
        with pytest.raises(GenerationConfigError, match=message):
            target.generate(prompt_ids=prompt, max_new_tokens=2, **kwargs)
