"""forerun's engine against transformers on tiny random models (fp32),
with its layers' small operations in forerun's native library and in
torch's operators."""

import pytest
import torch

from forerun.kernels import native
from tiny_models import VOCAB, forerun_decoder, hf_model

TOL = 1e-4
TOL_HALF = 2e-3
CASES = [
    ("qwen2", {}),
    ("qwen2", {"tie_word_embeddings": True}),
    ("llama", {}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 32}}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    ("llama", {"num_key_value_heads": 4}),
    ("qwen3", {}),
    ("gemma3", {}),
]
IDS = ["qwen2", "qwen2-tied", "llama", "llama3-rope", "linear-rope", "llama-mha", "qwen3",
       "gemma3"]


@pytest.fixture(params=["native", "native-float16", "torch"])
def layer_ops(request):
    """Which runs a layer's norms, gating and attention (one position at a
    time, or rowwise): forerun's native library, over a float32 cache or
    the float16 one it keeps by default, or torch's operators."""
    if request.param != "torch" and native.layer_ops() is None:
        pytest.skip(f"forerun's native library doesn't run here: {native.unavailable_reason()}")
    return request.param


@pytest.fixture(params=range(len(CASES)), ids=IDS)
def pair(request, layer_ops):
    arch, overrides = CASES[request.param]
    model = hf_model(arch, seed=request.param, **overrides)
    decoder = forerun_decoder(model)
    assert (decoder.model.layer_ops is not None) == (native.layer_ops() is not None)
    assert decoder.cache.keys.dtype == (torch.float16 if native.layer_ops() is not None
                                        else torch.float32)
    if layer_ops == "torch":
        decoder.model.layer_ops = None
        decoder = decoder.fork()     # (a cache in the activations' dtype, as torch's keep)
    if layer_ops == "native":
        decoder.model.kv_dtype = torch.float32
        decoder = decoder.fork()
    return model, decoder


def tol(decoder, want: torch.Tensor | None = None) -> float:
    """How far from transformers' logits (or the states ``want``) a
    decoder's may be: TOL, or over a float16 cache, whose keys and values
    are rounded to 11 significant bits, TOL_HALF times the largest value
    beyond 1 (logits 2e-4 to 4e-4 apart measured on these models, against
    2e-7 to 6e-7 over a float32 cache; layer states up to 4e-3 at values of
    about 5)."""
    if decoder.cache.keys.dtype != torch.float16:
        return TOL
    return TOL_HALF * (1.0 if want is None else max(1.0, want.abs().max().item()))


def reference_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def prompt(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def test_prefill_matches(pair):
    model, dec = pair
    ids = prompt()
    ref = reference_logits(model, ids)
    out = dec.feed(ids).logits
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() < tol(dec)
    assert dec.length == len(ids)


def test_token_by_token_matches(pair):
    model, dec = pair
    ids = prompt()
    ref = reference_logits(model, ids)
    rows = [dec.feed([t]).logits[0] for t in ids]
    assert (torch.stack(rows) - ref).abs().max().item() < tol(dec)


def test_rollback_and_refeed_matches(pair):
    model, dec = pair
    ids = prompt()
    other = prompt(seed=1)
    dec.feed(ids[:40])
    dec.feed(other[:20])          # a wrong continuation ...
    dec.rollback(40)              # ... forgotten
    out = dec.feed(ids[40:]).logits
    ref = reference_logits(model, ids)[40:]
    assert (out - ref).abs().max().item() < tol(dec)


def test_last_only_and_hidden_states(pair):
    model, dec = pair
    ids = prompt(16)
    out = dec.feed(ids, last_only=True, return_hidden=True)
    with torch.no_grad():
        ref = model(torch.tensor([ids]), output_hidden_states=True)
    assert out.logits.shape == (1, model.config.vocab_size)
    assert (out.logits[0] - ref.logits[0, -1]).abs().max().item() < tol(dec)
    assert (out.hidden[0] - ref.hidden_states[-1][0, -1]).abs().max().item() < tol(dec)


def test_mixed_chunks_match(pair):
    model, dec = pair
    ids = prompt()
    ref = reference_logits(model, ids)
    rows, i = [], 0
    for size in (5, 1, 7, 3, 1, 20, 27):
        rows.append(dec.feed(ids[i:i + size]).logits)
        i += size
    assert (torch.cat(rows) - ref).abs().max().item() < tol(dec)


def test_a_tree_matches_each_branch(pair):
    """A tree of drafts in one forward (two branches sharing a first node):
    each node's logits are those of its branch fed as a sequence."""
    model, dec = pair
    ids = prompt(44)
    head, (a, b, c, d) = ids[:40], ids[40:]
    dec.feed(head, last_only=True)
    mask = torch.zeros(4, 44, dtype=torch.bool)
    mask[:, :40] = True
    for node, parents in enumerate([[], [0], [0], [0, 2]]):   # a; b <- a; c <- a; d <- c <- a
        mask[node, [40 + p for p in parents] + [40 + node]] = True
    out = dec.forward([a, b, c, d], [40, 41, 41, 42], mask).logits
    left, right = reference_logits(model, head + [a, b]), reference_logits(model, head + [a, c, d])
    want = torch.stack([left[40], left[41], right[41], right[42]])
    assert (out - want).abs().max().item() < tol(dec)


@pytest.mark.parametrize("last_only", [False, True])
def test_layer_states_are_the_inputs_of_layers(pair, last_only):
    """``hidden_layers``: the residual stream entering each named layer, as
    transformers' ``hidden_states[i]`` gives it (the input of layer ``i``),
    for every fed position, also in a ``last_only`` prefill, in the order
    asked, and the last layer's output before the final norm for index
    ``num_layers``."""
    model, dec = pair
    ids = prompt(24)
    layers = model.config.num_hidden_layers
    out = dec.feed(ids, last_only=last_only, hidden_layers=(2, 0, layers))
    with torch.no_grad():
        ref = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        pre_norm: dict = {}
        hook = model.model.norm.register_forward_hook(
            lambda m, i, o: pre_norm.update(x=i[0]))   # returns None: the output stays
        try:
            model(torch.tensor([ids]))
        finally:
            hook.remove()
    h = model.config.hidden_size
    assert out.layers.shape == (len(ids), 3 * h)
    want = torch.cat([ref[2][0], ref[0][0], pre_norm["x"][0]], dim=-1)
    assert (out.layers - want).abs().max().item() < tol(dec, want)


def test_layer_states_of_verified_positions(pair):
    """One position at a time, and a tree in one forward: each row's states
    are those of its branch fed as a sequence."""
    model, dec = pair
    ids = prompt(44)
    head, (a, b, c, d) = ids[:40], ids[40:]
    dec.feed(head[:-1], last_only=True)
    one = dec.feed([head[-1]], hidden_layers=(1,)).layers
    mask = torch.zeros(4, 44, dtype=torch.bool)
    mask[:, :40] = True
    for node, parents in enumerate([[], [0], [0], [0, 2]]):   # a; b <- a; c <- a; d <- c <- a
        mask[node, [40 + p for p in parents] + [40 + node]] = True
    out = dec.forward([a, b, c, d], [40, 41, 41, 42], mask, hidden_layers=(1,)).layers
    with torch.no_grad():
        left = model(torch.tensor([head + [a, b]]), output_hidden_states=True).hidden_states[1][0]
        right = model(torch.tensor([head + [a, c, d]]),
                      output_hidden_states=True).hidden_states[1][0]
    want = torch.stack([left[40], left[41], right[41], right[42]])
    assert (one[0] - left[39]).abs().max().item() < tol(dec, left[39])
    assert (out - want).abs().max().item() < tol(dec, want)


def test_layer_states_out_of_range_are_refused(pair):
    _, dec = pair
    with pytest.raises(Exception, match="hidden_layers must be layer indices"):
        dec.feed([1, 2], hidden_layers=(dec.model.config.num_layers + 1,))
    assert dec.length == 0
