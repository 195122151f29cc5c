"""Medusa heads: their files (forerun's and the original Medusa layout), the
errors a mismatched or broken file gets, greedy Medusa decoding against
plain decoding on tiny models, the API and CLI, and a quick training run."""

from __future__ import annotations

import json

import pytest
import torch

import forerun
from forerun.cli.main import main as cli_main
from forerun.corpus.text_files import corpus_files
from forerun.decoding.plain import PlainDecoding
from forerun.decoding.rank_tree_planner import TreeShape
from forerun.decoding.sampling import SamplingParams, TokenSampler
from forerun.decoding.stats import GenerationStats
from forerun.decoding.tree_speculative import TreeSpeculativeDecoding
from forerun.drafters.medusa.heads import MedusaDrafter, MedusaHeads, shipped_heads_path
from forerun.drafters.medusa.training import (
    TrainSettings,
    _Heads,
    batch_loss,
    build_corpus,
    candidate_vocab,
    collect_teacher,
    own_paths,
    train_medusa,
)
from forerun.errors import ConfigError, ModelFormatError, ModelNotFoundError
from forerun.machine.output_files import OutputPathError
from method_runs import greedy_tokens
from tiny_models import VOCAB, forerun_decoder, hf_model
from training_steps import gradient, within_tolerance

H = 64   # hidden size of the tiny models


def random_heads(n=3, layers=1, seed=0, own_lm_head=False, vocab=None, scale=0.3):
    gen = torch.Generator().manual_seed(seed)
    blocks = [[(torch.randn(H, H, generator=gen) * scale / H ** 0.5,
                torch.randn(H, generator=gen) * 0.1) for _ in range(layers)] for _ in range(n)]
    rows = VOCAB if vocab is None else len(vocab)
    lm = [torch.randn(rows, H, generator=gen) for _ in range(n)] if own_lm_head else None
    return MedusaHeads(blocks, lm, None if vocab is None else torch.tensor(vocab), VOCAB, {})


class ReferenceResBlock(torch.nn.Module):
    """Medusa's ResBlock, written out: x + SiLU(Linear(x))."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(H, H)
        self.act = torch.nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


def reference_medusa(n=2, layers=1, seed=0):
    """The module tree of the original MedusaModel.medusa_head."""
    torch.manual_seed(seed)
    return torch.nn.ModuleList([
        torch.nn.Sequential(*[ReferenceResBlock() for _ in range(layers)],
                            torch.nn.Linear(H, VOCAB, bias=False))
        for _ in range(n)])


def write_original(folder, module, *, fmt="safetensors", prefix="medusa_head.", config=None):
    folder.mkdir(parents=True, exist_ok=True)
    state = {prefix + k: v.detach().clone().contiguous() for k, v in module.state_dict().items()}
    if fmt == "safetensors":
        from safetensors.torch import save_file
        save_file(state, str(folder / "medusa_lm_head.safetensors"))
    else:
        torch.save(state, str(folder / "medusa_lm_head.pt"))
    layers = sum(1 for k in state if k.startswith(prefix + "0.") and k.endswith("linear.weight"))
    cfg = {"medusa_num_heads": len(module), "medusa_num_layers": layers,
           "base_model_name_or_path": "tiny/base"}
    cfg.update(config or {})
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


# -- files --------------------------------------------------------------------------

def test_forerun_format_round_trip(tmp_path):
    heads = random_heads(n=2, vocab=list(range(0, VOCAB, 3)))
    heads.info["base_model"] = "tiny"
    heads.info["accuracy"] = {"top1": [0.5, 0.3], "top5": [0.7, 0.5],
                              "rank_hits": [[0.5, 0.1], [0.3, 0.1]]}
    path = tmp_path / "heads.safetensors"
    heads.save(path)
    back = MedusaHeads.load(path)
    assert back.num_heads == 2 and back.num_layers == 1 and back.hidden_size == H
    assert back.dtype == torch.float16                    # stored small
    assert back.lm_heads is None and back.vocab.tolist() == list(range(0, VOCAB, 3))
    assert back.vocab_size == VOCAB and back.info["base_model"] == "tiny"
    assert back.rank_accuracy() == [[0.5, 0.1], [0.3, 0.1]]
    dec = forerun_decoder(hf_model("qwen2"))
    drafter = MedusaDrafter.for_decoder(back, dec)
    assert drafter.heads.dtype == torch.float32           # the model's dtype
    h = torch.randn(H)
    lm = dec.model.lm_head.weight_rows()
    want = heads.logits(h, lm)[:, heads.vocab]
    got = drafter.heads.logits(h, lm)[:, heads.vocab]
    assert (want - got).abs().max() < 0.05                # float16 rounding only


@pytest.mark.parametrize("fmt,prefix,layers", [("safetensors", "medusa_head.", 1),
                                               ("pt", "", 1), ("safetensors", "medusa_head.", 2)],
                         ids=["safetensors", "pt-unprefixed", "two-layers"])
def test_original_medusa_layout(tmp_path, fmt, prefix, layers):
    module = reference_medusa(n=2, layers=layers, seed=3)
    folder = write_original(tmp_path / "medusa", module, fmt=fmt, prefix=prefix)
    heads = MedusaHeads.load(folder)
    assert heads.num_heads == 2 and heads.num_layers == layers
    assert heads.lm_heads is not None and heads.vocab is None
    x = torch.randn(5, H)
    with torch.no_grad():
        want = torch.stack([head(x) for head in module])
    assert (heads.logits(x, None) - want).abs().max() < 1e-5
    # The checkpoint file itself also loads (its config.json is beside it).
    file = next(folder.glob("medusa_lm_head.*"))
    assert MedusaHeads.load(file).num_heads == 2


def test_original_layout_drafts_with_its_own_lm_heads(tmp_path):
    module = reference_medusa(n=2, seed=4)
    heads = MedusaHeads.load(write_original(tmp_path / "m", module))
    dec = forerun_decoder(hf_model("llama"))
    drafter = MedusaDrafter.for_decoder(heads, dec)
    h = torch.randn(H)
    cands = drafter.candidates([1, 2], h, depth=2, width=3, sampler=None)
    with torch.no_grad():
        want = [head(h).topk(3).indices.tolist() for head in module]
    assert cands == want


def test_mismatched_heads_are_clear_errors(tmp_path):
    dec = forerun_decoder(hf_model("qwen2"))
    wide = MedusaHeads([[(torch.zeros(32, 32), torch.zeros(32))]], None, None, VOCAB)
    with pytest.raises(ConfigError, match="hidden size 64"):
        MedusaDrafter.for_decoder(wide, dec, "tiny")
    other_vocab = MedusaHeads([[(torch.zeros(H, H), torch.zeros(H))]], None, None, 1000)
    with pytest.raises(ConfigError, match="vocabulary of 1000"):
        MedusaDrafter.for_decoder(other_vocab, dec, "tiny")
    # Original layout with LM heads of another vocabulary.
    module = reference_medusa(n=1)
    module[0][-1] = torch.nn.Linear(H, VOCAB + 10, bias=False)
    with pytest.raises(ConfigError, match="another model"):
        MedusaDrafter.for_decoder(MedusaHeads.load(write_original(tmp_path / "v", module)), dec)
    out_of_range = MedusaHeads([[(torch.zeros(H, H), torch.zeros(H))]], None,
                               torch.tensor([1, VOCAB + 5]), None)
    with pytest.raises(ConfigError, match="outside"):
        MedusaDrafter.for_decoder(out_of_range, dec)


def test_broken_files_are_clear_errors(tmp_path):
    with pytest.raises(ModelNotFoundError):
        MedusaHeads.load(tmp_path / "missing.safetensors")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="medusa_lm_head"):
        MedusaHeads.load(empty)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(ModelFormatError):
        MedusaHeads.load(junk)
    from safetensors.torch import save_file
    save_file({"something.else": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ModelFormatError, match="no Medusa head tensors"):
        MedusaHeads.load(tmp_path / "other.safetensors")
    # config.json promises more heads than the file holds
    folder = write_original(tmp_path / "few", reference_medusa(n=2),
                            config={"medusa_num_heads": 3})
    with pytest.raises(ModelFormatError, match="3 Medusa heads"):
        MedusaHeads.load(folder)
    # a head without its LM head in the original layout
    module = reference_medusa(n=1)
    state = {f"medusa_head.{k}": v for k, v in module.state_dict().items()
             if not k.endswith("1.weight")}
    save_file(state, str(tmp_path / "nolm.safetensors"))
    with pytest.raises(ModelFormatError, match="LM head"):
        MedusaHeads.load(tmp_path / "nolm.safetensors")


# -- greedy Medusa decoding is plain greedy decoding -------------------------------------

@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("tree", [None, TreeShape.from_counts([3, 2, 2]),
                                  TreeShape([(0, 0, 0), (1, 0), (2,), (0, 1)])],
                         ids=["policy", "counts", "sparse"])
def test_greedy_medusa_is_plain_greedy(arch, tree):
    ref = hf_model(arch, seed=7)
    target = forerun_decoder(ref, context_length=160)
    drafter = MedusaDrafter.for_decoder(random_heads(seed=1, vocab=list(range(VOCAB))), target)
    method = TreeSpeculativeDecoding(target, drafter, tree=tree, max_nodes=8)
    method.policy.costs.seconds = [None] + [1.0] * 9     # trees always pay
    method._calibrated = True
    plain_method = PlainDecoding(forerun_decoder(ref, context_length=160))
    for prompt in ([3], [5, 17, 42, 99, 7], list(range(20, 60))):
        stats = GenerationStats()
        assert greedy_tokens(method, prompt, 48, stats) == greedy_tokens(plain_method, prompt, 48)
        assert stats.rounds <= 48 and stats.accepted <= stats.drafted
    assert method.nodes_verified > 0


def test_sampled_medusa_runs_and_repeats_with_a_seed():
    ref = hf_model("qwen2", seed=7)
    target = forerun_decoder(ref, context_length=128)
    drafter = MedusaDrafter.for_decoder(random_heads(seed=2), target)
    method = TreeSpeculativeDecoding(target, drafter, tree=TreeShape.from_counts([2, 2]))
    params = SamplingParams(temperature=0.8, top_p=0.9)

    def sample(seed):
        sampler = TokenSampler(params, seed)
        out, rounds = [], method.run([4, 5, 6], sampler, GenerationStats())
        for tokens in rounds:
            out += tokens
            if len(out) >= 30:
                break
        rounds.close()
        method.settle(33)
        return out[:30]

    assert sample(1) == sample(1)
    assert all(0 <= t < VOCAB for t in sample(2))


def test_medusa_needs_hidden_states():
    from table_decoders import TableDecoder

    target = TableDecoder(torch.zeros(3, 8, 8))
    drafter = MedusaDrafter(random_heads(), torch.randn(VOCAB, H))
    with pytest.raises(ConfigError, match="hidden states"):
        TreeSpeculativeDecoding(target, drafter)


# -- the API and the CLI ------------------------------------------------------------------

def tiny_folder(tmp_path, arch="qwen2"):
    try:
        from tiny_models import tiny_tokenizer_json
    except ImportError:   # older layout of the test helpers
        from loading.test_load import tiny_tokenizer_json

    model = hf_model(arch, seed=3)
    folder = tmp_path / f"tiny-{arch}"
    model.save_pretrained(folder, safe_serialization=True)
    tiny_tokenizer_json(folder)
    return folder


def test_api_draft_medusa(tmp_path, monkeypatch):
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))
    folder = tiny_folder(tmp_path)
    heads_file = tmp_path / "heads.safetensors"
    random_heads(seed=5).save(heads_file)
    model = forerun.load(folder, context_length=128, device="cpu", progress=False)
    ids = model.tokenizer.encode("hello world, the quick brown fox")
    plain = model.generate(prompt_ids=ids, max_new_tokens=24, ignore_eos=True)
    out = model.generate(prompt_ids=ids, max_new_tokens=24, ignore_eos=True,
                         draft=f"medusa:{heads_file}")
    assert out.tokens == plain.tokens
    assert out.stats.method == "medusa" and out.stats.rounds > 0
    fixed = model.generate(prompt_ids=ids, max_new_tokens=24, ignore_eos=True,
                           draft=f"medusa:{heads_file}", draft_k=3)
    assert fixed.tokens == plain.tokens and fixed.stats.drafted > 0
    sampled = model.generate(prompt_ids=ids, max_new_tokens=12, temperature=0.7, seed=3,
                             draft=f"medusa:{heads_file}")
    assert len(sampled.tokens) <= 12
    # No shipped heads for this model: a clear error naming the fix.
    with pytest.raises(ModelNotFoundError, match="forerun train medusa"):
        model.generate(prompt_ids=ids, max_new_tokens=4, draft="medusa")
    with pytest.raises(ConfigError, match="hidden size"):
        MedusaHeads([[(torch.zeros(8, 8), torch.zeros(8))]], None, None, None).save(
            tmp_path / "small.safetensors")
        model.generate(prompt_ids=ids, max_new_tokens=4,
                       draft=f"medusa:{tmp_path / 'small.safetensors'}")


def test_cli_generate_with_medusa(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))
    folder = tiny_folder(tmp_path, "llama")
    heads_file = tmp_path / "heads.safetensors"
    random_heads(seed=6).save(heads_file)
    args = ["generate", "-m", str(folder), "--raw", "-n", "8", "--json", "--quiet",
            "--context-length", "64"]
    assert cli_main(args + ["hello world"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli_main(args + ["--draft", f"medusa:{heads_file}", "hello world"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == plain["tokens"] and out["stats"]["method"] == "medusa"
    assert cli_main(args + ["--draft", "medusa", "hello world"]) == 1
    assert "ships no Medusa heads" in capsys.readouterr().err


# -- training -------------------------------------------------------------------------------

def _sharp_tiny_model():
    """A tiny random model with a 10x LM head: its predictions are peaked,
    so its greedy tokens follow from its input rather than from noise."""
    model = hf_model("qwen2", seed=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    return model


def _train_tiny(tmp_path, *, lr, log=None, out=None, heads=2, compute="float32"):
    """Heads for a tiny model trained on a corpus that repeats ten distinct
    bytes: the model's greedy token two positions ahead is then a function
    of the current byte, which a head can learn far past what the untrained
    head (the model's own next-token head) gets right."""
    corpus = tmp_path / "corpus"
    corpus.mkdir(exist_ok=True)
    for i in range(6):
        (corpus / f"f{i}.txt").write_text("abcdefghij" * 200)
    (corpus / "binary.bin").write_bytes(b"\0\1\2")
    dec = forerun_decoder(_sharp_tiny_model(), context_length=128)

    def encode(text):
        return [b % VOCAB for b in text.encode()]

    result = train_medusa(dec, encode, "tiny", [corpus], out,
                          settings=TrainSettings(heads=heads, epochs=3, batch_size=64, lr=lr,
                                                 compute=compute),
                          seq_len=128, max_tokens=2400, held_out_tokens=400, progress=False,
                          log=log)
    return dec, encode, result


def test_training_with_a_zero_learning_rate_learns_nothing(tmp_path, monkeypatch):
    """The broken twin of the training test: without updates, head 0 stays
    where it started, so the margin asserted there is training's doing."""
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))
    _, _, result = _train_tiny(tmp_path, lr=0.0, heads=1)
    assert result.accuracy.top1[0] == result.initial_accuracy.top1[0]


def test_training_on_a_tiny_model(tmp_path, monkeypatch):
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))
    logs: list[str] = []
    out = tmp_path / "heads.safetensors"
    dec, encode, result = _train_tiny(tmp_path, lr=1e-2, log=logs.append, out=out)
    acc = result.accuracy
    assert len(acc.top1) == 2 and all(0 <= a <= t <= 1 for a, t in zip(acc.top1, acc.top5))
    assert all(len(row) == 10 for row in acc.rank_hits)
    assert result.train_tokens > 1000 and result.held_out_tokens >= 400
    # Self-distillation learns what the model predicts two positions ahead,
    # by a margin no CPU's rounding decides.
    assert acc.top1[0] >= result.initial_accuracy.top1[0] + 0.4, (
        acc.top1[0], result.initial_accuracy.top1[0])
    assert any("top-1" in line for line in logs)
    heads = MedusaHeads.load(out)
    assert heads.num_heads == 2 and heads.vocab is not None
    assert heads.info["accuracy"]["top1"] == acc.top1
    # Cached: a second run feeds nothing to the model.
    calls = []
    original = dec.feed
    monkeypatch.setattr(dec, "feed", lambda *a, **k: calls.append(1) or original(*a, **k))
    train_medusa(dec, encode, "tiny", [tmp_path / "corpus"], None,
                 settings=TrainSettings(heads=1, epochs=1), seq_len=128, max_tokens=2400,
                 held_out_tokens=400, progress=False, log=None)
    assert calls == []
    # The heads draft for the model they were trained on.
    method = TreeSpeculativeDecoding(dec, MedusaDrafter.for_decoder(heads, dec, "tiny"),
                                     tree=TreeShape.from_counts([2, 1]))
    plain = greedy_tokens(PlainDecoding(forerun_decoder(_sharp_tiny_model(), 128)),
                          encode("abcde"), 20)
    assert greedy_tokens(method, encode("abcde"), 20) == plain


def test_a_bfloat16_step_matches_a_float32_one_within_the_stated_tolerance():
    """compute="bfloat16" (autocast): a batch's loss and gradient are
    float32's within COMPUTE_TOLERANCE, yet not equal (the products ran in
    bfloat16); a twin that drops the rows off the model's own path is not
    close, so the tolerance tells a wrong loss from rounding."""
    dec = forerun_decoder(_sharp_tiny_model(), context_length=128)
    # Text, then the model's own greedy continuation: rows on and off its path.
    text = [b % VOCAB for b in ("abcdefghij" * 4).encode()]
    own_text = text + greedy_tokens(PlainDecoding(dec), text, 60)
    teacher = collect_teacher(dec, [own_text, own_text[5:]], progress=False)
    vocab = candidate_vocab(teacher, VOCAB)
    local = torch.full((VOCAB,), -1, dtype=torch.long)
    local[vocab] = torch.arange(vocab.numel())
    lm_rows = dec.output_layer.weight_rows().detach().float().index_select(0, vocab)
    model = _Heads(2, H, lm_rows, own_lm_head=False)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for w in model.w:
            w.copy_(torch.randn(H, H, generator=gen) * 0.3 / H ** 0.5)
    rows = teacher.pairs(0)[0]
    own = own_paths(teacher, 2)
    assert 0 < int(own[0][rows].sum()) < rows.numel()    # the twin drops some rows

    def step(compute, off_path_weight=1.0):
        model.zero_grad()
        settings = TrainSettings(heads=2, compute=compute, off_path_weight=off_path_weight)
        loss = batch_loss(model, teacher, rows, local, own, settings)
        loss.backward()
        return float(loss.detach()), gradient(model)

    full = step("float32")
    half = step("bfloat16")
    assert within_tolerance(half, full) and half[0] != full[0]
    assert model.lm_rows.dtype == torch.float32     # the shared rows stay as they were
    assert not within_tolerance(step("bfloat16", off_path_weight=0.0), full)


def test_a_bfloat16_run_learns_as_a_float32_one_does(tmp_path, monkeypatch):
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))
    _, _, full = _train_tiny(tmp_path, lr=1e-2, heads=1)
    _, _, half = _train_tiny(tmp_path, lr=1e-2, heads=1, compute="bfloat16")
    assert half.accuracy.top1[0] >= half.initial_accuracy.top1[0] + 0.4
    assert half.accuracy.top1[0] == pytest.approx(full.accuracy.top1[0], abs=0.05)
    with pytest.raises(ConfigError, match="compute must be one of"):
        _train_tiny(tmp_path, lr=1e-2, heads=1, compute="float16")


def test_cli_train_and_info(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))
    folder = tiny_folder(tmp_path)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"{i}.txt").write_text("the quick brown fox jumps over the lazy dog. " * 30)
    out = tmp_path / "h.safetensors"
    code = cli_main(["train", "medusa", "--model", str(folder), "--corpus", str(corpus),
                     "--heads", "2", "--out", str(out), "--epochs", "1", "--seq-len", "64",
                     "--max-tokens", "600", "--held-out-tokens", "100", "--quiet"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "head 0 (token t+2): top-1" in text and "top-5" in text and out.is_file()
    assert cli_main(["medusa", "info", str(out)]) == 0
    assert "heads: 2" in capsys.readouterr().out
    # (the alias runs the same command)
    assert cli_main(["medusa", "train", "--model", str(folder), "--corpus",
                     str(tmp_path / "nowhere"), "--out", str(out), "--quiet"]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_heads_never_replace_a_file_forerun_did_not_write(tmp_path, monkeypatch, capsys):
    """``medusa train --out`` onto a file of the user's (another model's
    weights) is refused before training and leaves it as it was; forerun's
    own heads file is replaced, and ``--force`` replaces anything."""
    heads = random_heads(n=2)
    theirs = tmp_path / "model.safetensors"
    from safetensors.torch import save_file
    save_file({"w": torch.zeros(2)}, str(theirs))
    before = theirs.read_bytes()
    with pytest.raises(OutputPathError, match="is not a Medusa heads file that forerun wrote"):
        heads.save(theirs)
    assert theirs.read_bytes() == before
    ours = tmp_path / "heads.safetensors"
    heads.save(ours)
    heads.save(ours)                                    # forerun's own file
    assert MedusaHeads.load(ours).num_heads == 2
    heads.save(theirs, force=True)
    assert MedusaHeads.load(theirs).num_heads == 2

    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    assert cli_main(["medusa", "train", "--model", str(tiny_folder(tmp_path)), "--corpus",
                     str(tmp_path / "nowhere"), "--out", str(notes), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "--out" in err and "not a Medusa heads file" in err and "--force" in err
    assert "does not exist" not in err                   # refused before the corpus
    assert notes.read_text() == "mine"


def test_shipped_heads_lookup():
    assert shipped_heads_path("no-such-model") is None


def _corpus_of(tmp_path, sizes):
    """Files of ``sizes`` bytes (one token per byte with ``_bytes``)."""
    folder = tmp_path / "split-corpus"
    folder.mkdir(exist_ok=True)
    for i, n in enumerate(sizes):
        (folder / f"f{i}.txt").write_text(("abcdefghij" * (n // 10 + 1))[:n])
    return corpus_files([folder])


def _bytes(text):
    return list(text.encode())


def test_a_two_file_corpus_under_a_budget_leaves_tokens_to_train_on(tmp_path):
    """Issue 42: 47k tokens in 2 files with a budget went all to held-out
    (the per-file cap fell below the held-out size) and the error said the
    corpus was too small.  The held-out set takes only what it needs from a
    file; the rest trains."""
    files = _corpus_of(tmp_path, [5_000, 42_000])
    corpus = build_corpus(files, _bytes, seq_len=512, max_tokens=47_000)
    assert corpus.train_tokens > 20_000 and corpus.held_out_tokens >= 4_700
    assert corpus.train_files >= 1 and corpus.held_out_files >= 1
    assert corpus.train_tokens + corpus.held_out_tokens <= 47_000 + 4_700
    # Without a budget too, whichever file comes first.
    for seed in range(4):
        corpus = build_corpus(files, _bytes, seq_len=512, seed=seed)
        assert corpus.held_out_tokens == 10_000, seed
        assert corpus.train_tokens + corpus.held_out_tokens > 46_000, seed


def test_a_corpus_smaller_than_the_default_held_out_set_still_trains(tmp_path):
    files = _corpus_of(tmp_path, [3_000, 3_000])
    corpus = build_corpus(files, _bytes, seq_len=512)
    assert 600 <= corpus.held_out_tokens < 1_200 and corpus.train_tokens > 4_000


def test_the_corpus_split_message_says_what_is_wrong(tmp_path):
    files = _corpus_of(tmp_path, [3_000, 3_000])
    with pytest.raises(ConfigError) as err:
        build_corpus(files, _bytes, seq_len=512, held_out_tokens=10_000)
    text = str(err.value)
    assert "all 2 files" in text and "held-out" in text and "6000 tokens" in text
    assert "--held-out-tokens 600" in text and "too small" not in text
    binary = tmp_path / "b.bin"
    binary.write_bytes(b"\0\1\2")
    with pytest.raises(ConfigError, match="no text"):
        build_corpus([binary], _bytes)
    (tmp_path / "tiny").mkdir()
    with pytest.raises(ConfigError, match="too small: 1 files with text give 0"):
        build_corpus(_corpus_of(tmp_path / "tiny", [10]), _bytes)


# -- training on token manifests (forerun train data) ---------------------------------

def _records(n=40, length=100, seed=0):
    import numpy as np

    from forerun.corpus.token_manifest import Record

    rng = np.random.default_rng(seed)
    return [Record(rng.integers(3, VOCAB, length, dtype=np.int32), "conversation", 10)
            for _ in range(n)]


def test_a_manifest_corpus_holds_out_by_the_manifests_split():
    """Records go to the held-out set exactly as the manifest's split says
    (the one an EAGLE head's training takes), whole and in seq_len chunks;
    training stops taking records at max_tokens."""
    from forerun.corpus.token_manifest import is_held_out
    from forerun.drafters.medusa.training import corpus_from_records

    records = _records()
    held = [r for r in records if is_held_out(r.digest)]
    assert 0 < len(held) < len(records)
    corpus = corpus_from_records(records, seq_len=64)
    assert corpus.held_out == [c for r in held for c in
                               ([r.tokens[:64].tolist(), r.tokens[64:].tolist()])]
    assert corpus.held_out_files == len(held)
    assert corpus.train_tokens == 100 * (len(records) - len(held))
    assert all(16 <= len(c) <= 64 for c in corpus.train)
    small = corpus_from_records(records, seq_len=64, max_tokens=250)
    assert small.train_tokens == 250 and small.held_out == corpus.held_out


def test_a_manifest_corpus_with_nothing_to_train_or_hold_out_is_an_error():
    from forerun.corpus.token_manifest import is_held_out
    from forerun.drafters.medusa.training import corpus_from_records

    records = _records()
    with pytest.raises(ConfigError, match="leave the held-out set empty.*--resume"):
        corpus_from_records([r for r in records if not is_held_out(r.digest)])
    with pytest.raises(ConfigError, match="leave the training set empty"):
        corpus_from_records([r for r in records if is_held_out(r.digest)])


def test_cli_train_on_token_manifests(tmp_path, monkeypatch, capsys):
    from forerun.corpus.token_manifest import ManifestWriter

    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))
    folder = tiny_folder(tmp_path)
    root = tmp_path / "data"
    writer = ManifestWriter.create(root, model="tiny",
                                   fingerprint=forerun.load(str(folder)).tokenizer.fingerprint(),
                                   vocab_size=VOCAB, settings={})
    for record in _records(30, 60):
        writer.add(record)
    writer.flush()
    out = tmp_path / "h.safetensors"
    args = ["medusa", "train", "--model", str(folder), "--data", str(root), "--heads", "2",
            "--out", str(out), "--epochs", "1", "--seq-len", "64", "--quiet"]
    assert cli_main(args) == 0
    text = capsys.readouterr().out
    assert "training tokens from" in text and "records" in text and out.is_file()
    assert MedusaHeads.load(out).num_heads == 2
    assert cli_main(args + ["--held-out-tokens", "100"]) == 1
    assert "--held-out-tokens applies to --corpus" in capsys.readouterr().err
    assert cli_main(args[:5] + [str(tmp_path / "nowhere")] + args[6:]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "nowhere" in err
