"""A decoder layer in one native call (``decoder_layer.c``): a forward
computed position by position gives the same logits, hidden states,
captured states and caches, to the bit, with its layers fused as with them
run operation by operation (one position, a masked verification, several
sequences in one forward; q4 with mixed q/k/v formats, q8, biases; Qwen3's
and Gemma 3's norms, GELU and query scale); float layers go operation by
operation; and a library whose fused
layer computes otherwise is refused at load, or, let through, fails the
forward's comparison."""

from __future__ import annotations

import pytest
import torch

from forerun.engines.linear import ConcatLinear, Int6Blocks, quantize_int4
from forerun.engines.native_linear import NativeInt4Linear, NativeInt6Linear, native_product
from forerun.engines.transformer import Transformer
from forerun.kernels import native, self_check
from forerun.protocol.model_config import ModelConfig
from tiny_models import VOCAB, hf_model

PROMPT = [(i * 37 + 11) % VOCAB for i in range(23)]


def _network(arch: str, weights: str, seed: int = 4, **sizes) -> Transformer:
    model = hf_model(arch, seed=seed, **sizes)
    config = ModelConfig.from_hf(model.config.to_dict())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Transformer(config, state, weights_format=weights)


def _six_bit(w: torch.Tensor) -> NativeInt6Linear:
    """Random 6-bit values of ``w``'s shape (its inputs a multiple of 256)."""
    n, k = w.shape
    gen = torch.Generator().manual_seed(n + k)
    values = Int6Blocks(torch.randint(0, 64, (n, k), dtype=torch.uint8, generator=gen),
                        torch.randint(-40, 40, (n, k // 16), dtype=torch.int8, generator=gen),
                        torch.rand(n, k // 256, generator=gen) / 500)
    return NativeInt6Linear.build(values, None, native.native_kernels().row_group)


def _four_bit(w: torch.Tensor) -> NativeInt4Linear:
    return NativeInt4Linear.build(quantize_int4(w), None, native.native_kernels().row_group)


def _with_six_bit_values(net: Transformer) -> None:
    """Layer 0's q/k/v as a GGUF's Q4_K_M often holds it: q and k in 4
    bits, v in 6 (a ConcatLinear, with the attention's bias), and its down
    projection in 6 bits."""
    layer = net.layers[0]
    w, bias = layer.qkv.weight_rows(), layer.qkv.bias
    split = net.q_size + net.kv_size
    layer.qkv = ConcatLinear([_four_bit(w[:split]), _six_bit(w[split:])], bias)
    layer.down = _six_bit(layer.down.weight_rows())


def _forwards(net: Transformer, fuse: bool):
    """One position after a prompt, a masked verification of 4, three
    sequences in one forward, and a prompt of 23 positions row by row: each
    forward's logits, hidden states and captured layers, and the caches
    after them."""
    net.fuse_layers = fuse
    torch.manual_seed(0)
    out = []
    cache = net.new_cache(64)
    t = len(PROMPT)
    net.forward(torch.tensor(PROMPT), torch.arange(t), cache, None)
    states: list[torch.Tensor] = []
    out += net.forward(torch.tensor([7]), torch.tensor([t]), cache, None, states=states,
                       capture=(0, 1, net.config.num_layers))
    out += states
    mask = torch.ones(4, t + 5, dtype=torch.bool).tril(t + 1)
    mask[2, t + 1] = False                   # a tree: the third row skips the second
    out += net.forward(torch.tensor([9, 40, 41, 42]), torch.tensor([t + 1, t + 2, t + 2, t + 3]),
                       cache, mask, rowwise=True)
    caches = [cache]
    for n in range(2):
        c = net.new_cache(48)
        net.forward(torch.tensor(PROMPT[:5 + 7 * n]), torch.arange(5 + 7 * n), c, None)
        caches.append(c)
    rows = [(caches[0], 2), (caches[1], 1), (caches[2], 3)]
    tokens = torch.tensor([3, 4, 5, 6, 7, 8])
    positions = torch.tensor([t + 5, t + 6, 5, 12, 13, 14])
    out += net.forward_batch(tokens, positions, rows)
    # a prompt block as the engine prefills it: from 8 rows a fused layer
    # shares its row-wise steps (norms, RoPE, gating, sums) among the threads
    block = net.new_cache(64)
    out += net.forward(torch.tensor(PROMPT), torch.arange(t), block, None, rowwise=True)
    caches.append(block)
    out += [c.keys[:, :, :c.length] for c in caches] + [c.values[:, :, :c.length] for c in caches]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("arch,weights", [("qwen2", "q4"), ("qwen2", "q8"), ("llama", "q4")])
def test_fused_layers_compute_what_their_operations_compute(kernels, arch, weights):
    net = _network(arch, weights)
    ops, fused = net.fused_layers()
    assert ops is kernels and all(m is not None for m in fused)
    assert _same(_forwards(net, True), _forwards(net, False))


def test_with_q_k_v_of_two_formats_and_six_bit_matrices(kernels):
    net = _network("qwen2", "q4", hidden_size=256, intermediate_size=512)
    _with_six_bit_values(net)
    assert isinstance(net.layers[0].qkv, ConcatLinear) and net.layers[0].qkv.bias is not None
    assert all(m is not None for m in net.fused_layers()[1])
    assert _same(_forwards(net, True), _forwards(net, False))


@pytest.mark.parametrize("arch,weights", [("qwen3", "q4"), ("gemma3", "q4"), ("gemma3", "q8")])
def test_layers_with_norms_gelu_and_a_query_scale_are_fused_alike(kernels, arch, weights):
    """Query and key norms (Qwen3, Gemma 3), output norms, the tanh GELU, a
    query scale and sliding windows (Gemma 3): every layer is fused, with
    what its architecture adds, and computes what its operations compute."""
    net = _network(arch, weights)
    ops, fused = net.fused_layers()
    assert ops is kernels and all(m is not None and m.extras is not None for m in fused)
    if arch == "gemma3":
        assert net.query_factor != 1.0 and net.local_layers
        assert fused[0].extras.activation == 1 and fused[0].extras.post_mlp_norm
    assert fused[0].extras.q_norm and fused[0].extras.k_norm
    assert _same(_forwards(net, True), _forwards(net, False))


@pytest.mark.parametrize("arch,fault", [("qwen3", "query norm"), ("gemma3", "query norm"),
                                        ("gemma3", "query scale"), ("gemma3", "output norm")])
def test_a_fused_layer_that_skips_what_the_architecture_adds_differs(kernels, arch, fault):
    """The comparison above can fail: the same layers fused without their
    query and key norms, query scale or feed-forward output norm give
    other logits."""
    net = _network(arch, "q4")
    for m in net.fused_layers()[1]:
        if fault == "query scale":
            m.extras.query_factor = 1.0
        elif fault == "output norm":
            m.extras.post_mlp_norm = None
        else:
            m.extras.q_norm = m.extras.k_norm = None
    assert not _same(_forwards(net, True)[:2], _forwards(net, False)[:2])


def test_native_gelu_gating_matches_torch(kernels):
    """The tanh GELU of the layer operations (``fr_gelu_tanh_mul``) over the
    range a gate takes and past it (where e^(-2u) is clamped), a width that
    leaves a scalar tail: within 1e-5 of the exact value, relatively (in
    float64, as x sigmoid(2u), which 0.5 x (1 + tanh u) equals but loses
    to cancellation below -5; far in the negative tail e^(-2u)'s argument,
    about 30, carries a float32 rounding), and as close to torch's float32
    GELU as torch is to the exact value."""
    gate = torch.cat([torch.linspace(-12, 12, 4001), torch.tensor([-1e4, -90.0, 0.0, 1e-30,
                                                                  90.0, 1e4])])
    up = torch.rand_like(gate, generator=torch.Generator().manual_seed(1)) + 0.5
    got = kernels.gelu_tanh_mul(torch.stack([gate, up]).reshape(1, -1))[0].double()
    g = gate.double()
    exact = g * torch.sigmoid(2 * 0.7978845608028654 * (g + 0.044715 * g ** 3)) * up.double()
    assert gate.numel() % 8 != 0 and torch.isfinite(got).all()
    assert torch.allclose(got, exact, rtol=1e-5, atol=1e-34)
    torch_gelu = (torch.nn.functional.gelu(gate, approximate="tanh") * up).double()
    assert (got - torch_gelu).abs().max() <= 2 * (torch_gelu - exact).abs().max()


def test_float_layers_are_not_fused(kernels):
    net = _network("qwen2", "float32")
    assert native_product(net.layers[0].qkv) is None
    assert net.fused_layers()[0] is None


def test_a_library_whose_fused_layer_is_wrong_is_refused(altered_source):
    """The load-time check: a fused layer that skips a bias for several
    positions is caught before anything runs on the library."""
    altered_source("DECODER_LAYER_SOURCE", "    if (p->bias)\n", "    if (p->bias && T == 1)\n")
    assert native.layer_ops() is None and native.native_kernels() is None
    assert "decoder layer differs" in native.unavailable_reason()


def test_a_library_whose_fused_layer_skips_an_output_norm_is_refused(altered_source):
    """The load-time check covers what Qwen3 and Gemma 3 add: a fused
    layer that leaves out the feed-forward block's output norm is refused."""
    altered_source("DECODER_LAYER_SOURCE", "    if (e->post_mlp_norm) norm_rows(",
                   "    if (0) norm_rows(")
    assert native.native_kernels() is None
    assert "(with query and key norms" in native.unavailable_reason()


def test_that_wrong_fused_layer_let_through_fails_the_comparison(altered_source, monkeypatch):
    """The broken twin: the same fault with the load-time check skipped
    changes a masked verification's logits, so the comparison above would
    catch a fused layer that the check missed."""
    altered_source("DECODER_LAYER_SOURCE", "    if (p->bias)\n", "    if (p->bias && T == 1)\n")
    monkeypatch.setattr(native, "check_decoder_layer", lambda kernels, ops: None)
    assert native.native_kernels() is not None
    net = _network("qwen2", "q4")
    assert not _same(_forwards(net, True), _forwards(net, False))


def test_the_load_time_check_passes_on_this_machine(kernels):
    self_check.check_decoder_layer(kernels, native.layer_ops())
