"""The EAGLE-3 head's network against a reference built from transformers'
Llama modules in float32 (attention, MLP, RMSNorm, rotary embedding), as
vLLM's ``llama_eagle3.py`` and SpecForge's ``llama3_eagle.py`` compose them:
one decoder layer whose q/k/v read ``[input_layernorm(embedding);
hidden_norm(feature)]``.  Prefill, one slot at a time, a tree, and the
int8 format close to float32."""

from __future__ import annotations

import pytest
import torch

from forerun.drafters.eagle.head import EagleHead
from forerun.drafters.eagle.weights import Eagle3Config, Eagle3Weights

H, VOCAB, DRAFT_VOCAB = 64, 300, 128
TOL = 1e-4


def config(norm_before_residual=False, **overrides) -> Eagle3Config:
    values = dict(hidden_size=H, intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=16,
                  rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, vocab_size=VOCAB,
                  draft_vocab_size=DRAFT_VOCAB, aux_layers=(0, 1, 2),
                  norm_before_residual=norm_before_residual, max_position_embeddings=512)
    values.update(overrides)
    return Eagle3Config(**values)


def weights(norm_before_residual=False, seed=0, **overrides) -> Eagle3Weights:
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:DRAFT_VOCAB]
    w = Eagle3Weights.random(config(norm_before_residual, **overrides), ids.sort().values,
                             seed=seed)
    for name in ("fc.weight", "lm_head.weight"):     # larger: differences show
        w.tensors[name] = w.tensors[name] * 10
    return w


EMBED = torch.randn(VOCAB, H, generator=torch.Generator().manual_seed(7))


def embed(tokens: torch.Tensor) -> torch.Tensor:
    return EMBED[tokens]


class Reference(torch.nn.Module):
    """The head from transformers' Llama modules."""

    def __init__(self, w: Eagle3Weights) -> None:
        import transformers
        from transformers.models.llama import modeling_llama as ml

        super().__init__()
        c = w.config
        hf = transformers.LlamaConfig(
            vocab_size=c.vocab_size, hidden_size=H, intermediate_size=c.intermediate_size,
            num_hidden_layers=1, num_attention_heads=c.num_heads,
            num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
            rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
            max_position_embeddings=c.max_position_embeddings)
        hf._attn_implementation = "eager"
        self.c = c
        self.attn = ml.LlamaAttention(hf, layer_idx=0)
        for n in ("q", "k", "v"):                       # q/k/v read 2H values
            out = getattr(self.attn, f"{n}_proj").out_features
            setattr(self.attn, f"{n}_proj", torch.nn.Linear(2 * H, out, bias=False))
        self.mlp = ml.LlamaMLP(hf)
        self.norms = {n: ml.LlamaRMSNorm(H, eps=c.rms_norm_eps) for n in (
            "input_layernorm", "hidden_norm", "post_attention_layernorm", "norm")}
        self.rotary = ml.LlamaRotaryEmbedding(hf)
        t = w.tensors
        with torch.no_grad():
            for n in ("q", "k", "v", "o"):
                weight = t[f"midlayer.self_attn.{n}_proj.weight"]
                getattr(self.attn, f"{n}_proj").weight.copy_(weight)
            for n in ("gate", "up", "down"):
                getattr(self.mlp, f"{n}_proj").weight.copy_(t[f"midlayer.mlp.{n}_proj.weight"])
            for n, norm in self.norms.items():
                norm.weight.copy_(t["norm.weight" if n == "norm" else f"midlayer.{n}.weight"])
        self.fc, self.lm_head = t["fc.weight"], t["lm_head.weight"]

    @torch.no_grad()
    def forward(self, tokens, features, positions, mask):
        """A whole sequence of slots (``mask``: bool ``[T, T]``)."""
        x = features if features.shape[-1] == H else features @ self.fc.T
        e = self.norms["input_layernorm"](embed(tokens))
        h = self.norms["hidden_norm"](x)
        residual = h if self.c.norm_before_residual else x
        cos, sin = self.rotary(x[None], positions[None])
        bias = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))[None, None]
        attn = self.attn(torch.cat([e, h], -1)[None], position_embeddings=(cos, sin),
                         attention_mask=bias)[0][0]
        residual = residual + attn
        out = residual + self.mlp(self.norms["post_attention_layernorm"](residual))
        return self.norms["norm"](out) @ self.lm_head.T, out


def causal(t):
    return torch.ones(t, t, dtype=torch.bool).tril()


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_head_equals_the_reference_layer(norm_before_residual):
    w = weights(norm_before_residual)
    head, ref = EagleHead(w, embed, weights_format="float32"), Reference(w)
    g = torch.Generator().manual_seed(1)
    t = 12
    tokens = torch.randint(0, VOCAB, (t,), generator=g)
    states = torch.randn(t, 3 * H, generator=g)
    positions = torch.arange(5, 5 + t)          # any positions: they set the rotation only
    want_logits, want_out = ref(tokens, states, positions, causal(t))
    # all slots at once
    cache = head.new_cache(32)
    logits, out = head.forward(tokens, states, positions, cache)
    assert logits.shape == (t, DRAFT_VOCAB) and out.shape == (t, H)
    assert (logits - want_logits).abs().max() < TOL
    assert (out - want_out).abs().max() < TOL
    # one slot at a time, the last few reading the head's own outputs
    cache = head.new_cache(32)
    rows = [head.forward(tokens[i:i + 1], states[i:i + 1], positions[i:i + 1], cache)
            for i in range(t)]
    assert (torch.cat([r[0] for r in rows]) - want_logits).abs().max() < TOL
    own = torch.cat([states[:8] @ w.tensors["fc.weight"].T, torch.randn(4, H, generator=g)])
    want_logits, _ = ref(tokens, own, positions, causal(t))
    cache = head.new_cache(32)
    head.forward(tokens[:8], states[:8], positions[:8], cache)
    logits, _ = head.forward(tokens[8:], own[8:], positions[8:], cache)
    assert (logits - want_logits[8:]).abs().max() < TOL


def test_a_tree_level_equals_each_branch():
    w = weights()
    head, ref = EagleHead(w, embed, weights_format="float32"), Reference(w)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB, (8,), generator=g)
    states = torch.randn(6, 3 * H, generator=g)
    own = torch.randn(2, H, generator=g)
    fused = states @ w.tensors["fc.weight"].T
    cache = head.new_cache(16)
    head.forward(tokens[:6], states, torch.arange(6), cache)
    # two siblings at position 6, each seeing the committed slots and itself
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[:, :6] = True
    mask[0, 6] = mask[1, 7] = True
    logits, _ = head.forward(tokens[6:], own, torch.tensor([6, 6]), cache, mask)
    for i in range(2):
        seq = torch.cat([tokens[:6], tokens[6 + i:7 + i]])
        feats = torch.cat([fused, own[i:i + 1]])
        want, _ = ref(seq, feats, torch.arange(7), causal(7))
        assert (logits[i] - want[-1]).abs().max() < TOL


def test_int8_head_is_close_to_float32():
    w = weights()
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (6,), generator=g)
    states = torch.randn(6, 3 * H, generator=g)
    exact, _ = EagleHead(w, embed, weights_format="float32").forward(
        tokens, states, torch.arange(6), EagleHead(w, embed).new_cache(8))
    q8 = EagleHead(w, embed, weights_format="q8")
    logits, _ = q8.forward(tokens, states, torch.arange(6), q8.new_cache(8))
    assert (logits - exact).abs().max() < 0.05 * exact.abs().max()


def test_features_of_another_width_are_refused():
    head = EagleHead(weights(), embed, weights_format="float32")
    with pytest.raises(Exception, match="EAGLE feature"):
        head.forward(torch.tensor([1]), torch.zeros(1, 2 * H), torch.tensor([0]),
                     head.new_cache(4))
