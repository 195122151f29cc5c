"""Medusa heads: their files (forerun's and the original Medusa layout), the
errors a mismatched or broken file gets, greedy Medusa decoding against
plain decoding on tiny models, the API and CLI, and a quick training run."""

from __future__ import annotations

import json

import pytest
import torch

import forerun
from forerun.cli.main import main as cli_main
from forerun.decoding.plain import PlainDecoding
from forerun.decoding.rank_tree_planner import TreeShape
from forerun.decoding.sampling import SamplingParams, TokenSampler
from forerun.decoding.stats import GenerationStats
from forerun.decoding.tree_speculative import TreeSpeculativeDecoding
from forerun.drafters.medusa.heads import MedusaDrafter, MedusaHeads, shipped_heads_path
from forerun.errors import ConfigError, ModelFormatError, ModelNotFoundError
from forerun.machine.output_files import OutputPathError
from method_runs import greedy_tokens
from tiny_models import VOCAB, forerun_decoder, hf_folder, hf_model

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
    return hf_folder(tmp_path / f"tiny-{arch}", arch, seed=3)


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


# -- the heads file and the shipped heads -----------------------------------------------

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

