"""The PyTorch engine's weight formats: each layer type against the
dequantized product, GGUF 4-bit blocks kept exactly, logit parity of whole
models with the float32 reference, exact verification groups per format
(measured by the grouping probe), and clear errors for bad options."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGMLType

import forerun
from forerun.api.engine_policy import probe_tokens
from forerun.engines.layer_factory import fuse_linear, make_linear, restore_linear
from forerun.engines.linear import (
    QUANTIZE_ROWS,
    WEIGHT_FORMATS,
    ConcatLinear,
    Int4Groups,
    check_kernels,
    concat_rows,
    quantize_int4,
    quantize_int8,
)
from forerun.engines.torch_engine import TorchDecoder
from forerun.engines.transformer import PADDED_ROWS, Transformer
from forerun.errors import ConfigError, EngineError
from forerun.kernels import layouts, native
from forerun.loading.dequantize import dequantize
from forerun.loading.gguf_quantized import int4_groups, int6_blocks
from forerun.protocol.grouping_probe import MAX_GROUP, exact_group_size
from tiny_models import VOCAB, hf_model

CPU = torch.device("cpu")


def _random_blocks(qtype: GGMLType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid random blocks of a 4-bit GGUF type: random bytes, with finite
    fp16 scales in the header fields."""
    block_size, block_bytes = {GGMLType.Q4_K: (256, 144), GGMLType.Q4_0: (32, 18),
                               GGMLType.Q4_1: (32, 20)}[qtype]
    rng = np.random.default_rng(seed)
    n = rows * cols // block_size
    blocks = rng.integers(0, 256, size=(n, block_bytes), dtype=np.uint8)
    heads = 2 if qtype == GGMLType.Q4_0 else 4
    halves = rng.uniform(0.001, 0.05, size=(n, heads // 2)).astype("<f2")
    blocks[:, :heads] = halves.view(np.uint8).reshape(n, heads)
    return blocks.reshape(-1)


@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q4_0, GGMLType.Q4_1])
def test_gguf_4bit_blocks_keep_their_values(qtype, matrix_kernels):
    """A Q4_K/Q4_0/Q4_1 matrix becomes int4 groups of 32 whose values are
    ggml's own: the same weights up to float32 rounding of the
    scale-and-zero form, and the packed layer computes with them up to
    rounding scale and zero to its kernel's dtype."""
    rows, cols = 32, 512
    raw = _random_blocks(qtype, rows, cols)
    want = torch.from_numpy(dequantize(raw, qtype, (rows, cols)))
    values = int4_groups(raw, qtype, (rows, cols))
    assert values.q.dtype == torch.uint8 and int(values.q.max()) <= 15
    assert values.scale.shape == (rows, cols // 32)
    torch.testing.assert_close(values.dequantize(), want, rtol=1e-5, atol=1e-6)
    layer = make_linear(values, None, "q4", CPU)
    assert layer.format == "q4" and getattr(layer, "kernel", "torch") == matrix_kernels
    x = torch.randn(3, cols)
    product, weights = _as_the_kernel_computes(matrix_kernels, values, x)
    tolerance = 1e-3 if matrix_kernels == "native" else 2e-2   # sums in another order
    torch.testing.assert_close(layer(x), product, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(layer.weight_rows(), weights, rtol=1e-2, atol=1e-3)


def _as_the_kernel_computes(kernels: str, values: Int4Groups, x: torch.Tensor):
    """``x @ W.T`` and ``W`` as each kernel holds and computes them: torch's
    casts the activations, scales and zeros to bfloat16; forerun's native
    kernel quantizes the activations to int8 per group of 32 and holds
    ``scale`` and ``minimum = zero - 8 * scale`` in float16."""
    if kernels == "torch":
        w = Int4Groups(values.q, values.scale.bfloat16().float(),
                       values.zero.bfloat16().float()).dequantize()
        return x.bfloat16().float() @ w.t(), w
    rows = native.native_kernels().quantize(x)
    k = x.shape[1]
    xq = layouts.from_chunks(rows.values).double() * rows.scale.double().repeat_interleave(32, 1)
    scale = values.scale.half().double()
    minimum = (values.zero - 8 * values.scale).half().double()
    w = values.q.double() * scale.repeat_interleave(32, 1) + minimum.repeat_interleave(32, 1)
    return (xq[:, :k] @ w.t()).float(), w.float()


def test_a_broken_nibble_order_is_caught():
    """The reconstruction test can fail: swapping the two sub-blocks a byte
    holds gives other weights."""
    raw = _random_blocks(GGMLType.Q4_K, 16, 256, seed=1)
    values = int4_groups(raw, GGMLType.Q4_K, (16, 256))
    q = values.q.reshape(16, 4, 2, 32).flip(2).reshape(16, 256)
    swapped = Int4Groups(q, values.scale, values.zero)
    want = torch.from_numpy(dequantize(raw, GGMLType.Q4_K, (16, 256)))
    assert not torch.allclose(swapped.dequantize(), want, atol=1e-3)


def _random_q6_k(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid random Q6_K blocks: random 6-bit values and int8 scales (the
    extremes included), a finite fp16 ``d``."""
    rng = np.random.default_rng(seed)
    n = rows * cols // 256
    blocks = rng.integers(0, 256, size=(n, 210), dtype=np.uint8)
    blocks[0, 192:194] = np.array([-128, 127], dtype=np.int8).view(np.uint8)
    blocks[:, 208:210] = rng.uniform(1e-4, 5e-3, size=(n, 1)).astype("<f2").view(np.uint8)
    return blocks.reshape(-1)


def test_gguf_6bit_blocks_keep_their_values(matrix_kernels):
    """A Q6_K matrix keeps ggml's own values exactly, and under q4 forerun's
    native kernels multiply them as they are (6.6 bits a weight); torch's
    kernels take them as int8 rows, as q8 does."""
    rows, cols = 32, 512
    raw = _random_q6_k(rows, cols)
    want = torch.from_numpy(dequantize(raw, GGMLType.Q6_K, (rows, cols)))
    values = int6_blocks(raw, (rows, cols))
    assert int(values.q.max()) == 63 and int(values.q.min()) == 0
    assert torch.equal(values.dequantize(), want)
    layer = make_linear(values, None, "q4", CPU)
    x = torch.randn(3, cols)
    if matrix_kernels == "torch":
        assert layer.format == "q8"
        torch.testing.assert_close(layer.weight_rows(), want, rtol=1e-2, atol=float(
            want.abs().max()) / 200)       # int8 rows (and torch's bfloat16 scales)
    else:
        assert layer.format == "q6" and layer.nbytes == rows * cols * 13 // 16 + rows * 2 * 4
        assert torch.equal(layer.weight_rows(), want)
        rows_q = native.native_kernels().quantize(x)
        xq = layouts.from_chunks(rows_q.values).double() * \
            rows_q.scale.double().repeat_interleave(32, 1)
        product = xq @ want.double().t()
        assert float((layer(x).double() - product).abs().max()) <= \
            1e-5 * float(product.abs().max())
    stored = restore_linear(*layer.state(), CPU)      # the packed-weight cache's way back
    assert stored.format == layer.format and torch.equal(stored(x), layer(x))
    assert make_linear(values, None, "q8", CPU).format == "q8"
    assert make_linear(values, None, "q4-all", CPU).format == "q4"
    torch.testing.assert_close(make_linear(values, None, "float32", CPU).weight_rows(), want)


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
def test_each_format_computes_the_product(fmt):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=gen) * 0.1
    b = torch.randn(48, generator=gen)
    x = torch.randn(5, 64, generator=gen)
    layer = make_linear(w, b, fmt, CPU)
    assert layer.format == {"q4-all": "q4"}.get(fmt, fmt)
    assert (layer.out_features, layer.in_features) == (48, 64)
    tolerance = {"float32": 1e-5, "bfloat16": 3e-2, "q8": 5e-2, "q4": 0.25, "q4-all": 0.25}[fmt]
    torch.testing.assert_close(layer(x), x @ w.t() + b, rtol=0, atol=tolerance)
    torch.testing.assert_close(layer.weight_rows(torch.tensor([3, 7])),
                               w[[3, 7]], rtol=0, atol=tolerance / 4)


def test_quantizers_round_trip():
    w = torch.randn(16, 64)
    q8 = quantize_int8(w)
    assert q8.q.dtype == torch.int8 and (q8.dequantize() - w).abs().max() <= q8.scale.max() / 2
    q4 = quantize_int4(w)
    step = q4.scale.repeat_interleave(32, dim=1)
    assert ((q4.dequantize() - w).abs() <= step / 2 + 1e-6).all()


def test_int8_quantizing_in_slices_of_rows_is_quantizing_each_row():
    gen = torch.Generator().manual_seed(3)
    rows = QUANTIZE_ROWS * 2 + 37       # two whole slices and a short one
    w = torch.randn(rows, 64, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
    for source in (w, quantize_int4(w)):
        dense = source if isinstance(source, torch.Tensor) else source.dequantize()
        got = quantize_int8(source)
        for n in (0, QUANTIZE_ROWS - 1, QUANTIZE_ROWS, rows - 1):
            one = quantize_int8(dense[n:n + 1])
            assert torch.equal(got.q[n], one.q[0]) and torch.equal(got.scale[n], one.scale[0])
        assert got.q.shape == (rows, 64) and got.scale.shape == (rows,)
        assert (got.q.abs().amax(dim=1) == 127).all()     # each row's own scale


def test_int4_needs_packable_shapes(matrix_kernels):
    """torch's int4 kernel packs rows in 16s, and both int4 kernels groups
    of 32 columns; other shapes fall back to int8 instead of failing."""
    layer = make_linear(torch.randn(300, 64), None, "q4", CPU)
    assert isinstance(layer.weight_rows(), torch.Tensor)
    assert layer.format == ("q4" if matrix_kernels == "native" else "q8")
    layer = make_linear(torch.randn(32, 40), None, "q4", CPU)
    assert layer.format == "q8"
    # Rows of 100 values: the int8 kernel would crash; the layer runs dense.
    w, x = torch.randn(64, 100), torch.randn(4, 100)
    for fmt in ("q4", "q8"):
        torch.testing.assert_close(make_linear(w, None, fmt, CPU)(x), x @ w.t(),
                                   rtol=0, atol=0.5)


def test_parts_of_different_kinds_keep_their_own_values(matrix_kernels):
    """q/k in 4 bits and v in 8 (as a Q4_K_M GGUF stores them) fuse into one
    layer whose rows are each part's own product: no part is requantized
    to the other's kind."""
    gen = torch.Generator().manual_seed(5)
    parts = [quantize_int4(torch.randn(32, 64, generator=gen)),
             quantize_int4(torch.randn(16, 64, generator=gen)),
             quantize_int8(torch.randn(16, 64, generator=gen))]
    bias = torch.randn(64, generator=gen)
    layer = fuse_linear(parts, bias, "q4", CPU)
    assert isinstance(layer, ConcatLinear) and layer.format == "q4+q4+q8"
    x = torch.randn(3, 64, generator=gen)
    want = torch.cat([make_linear(p, None, "q4", CPU)(x) for p in parts], dim=-1) + bias
    assert torch.equal(layer(x), want)
    v = parts[2]   # torch's kernel holds scales in bfloat16, forerun's in float32
    scale = v.scale.bfloat16().float() if matrix_kernels == "torch" else v.scale
    assert torch.equal(layer.weight_rows()[48:], v.q.float() * scale[:, None])
    # One kind: one fused matrix.
    assert not isinstance(fuse_linear(parts[:2], None, "q4", CPU), ConcatLinear)


def test_q4_all_makes_every_matrix_4_bit(matrix_kernels):
    """Under q4-all the 8-bit part of a q/k/v is requantized to 4 bits and
    fused with the 4-bit parts into one 4-bit layer (the 4-bit parts keep
    their own values); rows that are not whole groups stay int8."""
    gen = torch.Generator().manual_seed(5)
    parts = [quantize_int4(torch.randn(32, 64, generator=gen)),
             quantize_int4(torch.randn(16, 64, generator=gen)),
             quantize_int8(torch.randn(16, 64, generator=gen))]
    layer = fuse_linear(parts, None, "q4-all", CPU)
    assert not isinstance(layer, ConcatLinear) and layer.format == "q4"
    want = make_linear(concat_rows([parts[0], parts[1], quantize_int4(parts[2].dequantize())]),
                       None, "q4", CPU)
    x = torch.randn(3, 64, generator=gen)
    assert torch.equal(layer(x), want(x))
    four_bit = quantize_int4(parts[2].dequantize())
    step = four_bit.scale.repeat_interleave(32, dim=1)
    assert ((layer.weight_rows()[48:] - parts[2].dequantize()).abs() <= step).all()
    assert make_linear(quantize_int8(torch.randn(32, 40)), None, "q4-all", CPU).format == "q8"
    assert make_linear(parts[2], None, "q4", CPU).format == "q8"      # q4 keeps 8 bits


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS + ("mixed",))
def test_a_layer_restored_from_its_state_computes_the_same(fmt, matrix_kernels):
    """What the packed-weight cache stores rebuilds the layer bit for bit,
    without quantizing or packing again."""
    gen = torch.Generator().manual_seed(6)
    w, b = torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen)
    layer = (fuse_linear([quantize_int4(w[:32]), quantize_int8(w[32:])], b, "q4", CPU)
             if fmt == "mixed" else make_linear(w, b, fmt, CPU))
    meta, tensors = layer.state()
    copy = restore_linear(meta, {k: t.clone() for k, t in tensors.items()}, CPU)
    x = torch.randn(4, 64, generator=gen)
    assert type(copy) is type(layer) and torch.equal(copy(x), layer(x))
    missing = dict(tensors)
    missing.pop(next(k for k in tensors if k != "bias"))
    with pytest.raises((ConfigError, KeyError)):
        restore_linear(meta, missing, CPU)


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_a_restored_layer_on_torchs_kernels_gets_aligned_weights(fmt, torch_kernels):
    """A stored network's tensors are views of its mapped file, 8-byte
    aligned; torch's int8 kernel read int8 weights 8 bytes off a 16-byte
    boundary with aligned loads and crashed the process.  A restored layer
    on torch's kernels holds its weights on a 64-byte boundary (a copy
    where the view is not), and computes what the layer computed."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(48, 256, generator=gen)
    layer = make_linear(w, None, fmt, CPU)
    meta, tensors = layer.state()
    assert meta["kind"] == fmt and meta["kernel"] is True
    shifted = {}
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).flatten()
        buffer = torch.empty(raw.numel() + 128, dtype=torch.uint8)
        start = (64 - buffer.data_ptr() % 64) % 64 + 8          # 8 bytes off a 64-byte line
        buffer[start:start + raw.numel()] = raw
        shifted[name] = buffer[start:start + raw.numel()].view(t.dtype).view(t.shape)
        assert shifted[name].data_ptr() % 16 == 8
    copy = restore_linear(meta, shifted, CPU)
    held = ("q", "scale") if fmt == "q8" else ("packed", "scales_and_zeros")
    assert all(getattr(copy, name).data_ptr() % 64 == 0 for name in held)
    x = torch.randn(3, 256, generator=gen)
    assert torch.equal(copy(x), layer(x))


def test_a_changed_kernel_is_refused(monkeypatch, torch_kernels):
    check_kernels(CPU)
    monkeypatch.setattr(torch, "_weight_int4pack_mm_for_cpu",
                        lambda x, w, g, sz: torch.zeros(x.shape[0], sz.shape[1],
                                                        dtype=x.dtype))
    with pytest.raises(EngineError, match="q4 kernel differently"):
        check_kernels(CPU)


# -- whole models -----------------------------------------------------------------

def _network(fmt: str, arch: str = "qwen2") -> Transformer:
    from forerun.protocol.model_config import ModelConfig

    model = hf_model(arch, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                     num_key_value_heads=2)
    config = ModelConfig.from_hf(model.config.to_dict())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Transformer(config, state, weights_format=fmt)


@pytest.mark.parametrize("fmt", ["bfloat16", "q8", "q4", "q4-all"])
def test_logit_parity_with_the_float32_reference(fmt):
    prompt = list(range(5, 45))
    ref = TorchDecoder(_network("float32"), 128).feed(prompt).logits
    got = TorchDecoder(_network(fmt), 128).feed(prompt).logits
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    assert float(cos.min()) > {"bfloat16": 0.999, "q8": 0.99, "q4": 0.95, "q4-all": 0.95}[fmt]
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean()
    assert float(agree) >= {"bfloat16": 0.95, "q8": 0.9, "q4": 0.75, "q4-all": 0.75}[fmt]


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_verification_is_exact_in_the_probed_groups(fmt, arch):
    """Per format: once verifications are cut into the groups the probe
    found exact, a feed of 9 positions (or a tree of them) gives the logits
    of 9 one-position feeds."""
    decoder = TorchDecoder(_network(fmt, arch), 256)
    tokens = [int(t) for t in torch.randint(3, VOCAB, (200,),
                                            generator=torch.Generator().manual_seed(1))]
    result = exact_group_size(decoder, tokens, contexts=(20, 150), max_group=9)
    decoder.verify_group = result.exact_group
    more = tokens[160:169]
    decoder.reset()
    decoder.feed(tokens[:150], last_only=True)
    one_by_one = torch.cat([decoder.feed([t]).logits for t in more])
    decoder.rollback(150)
    assert torch.equal(decoder.feed(more).logits, one_by_one)
    # The same chain through forward() with an explicit causal mask.
    decoder.rollback(150)
    mask = torch.ones(9, 159, dtype=torch.bool).tril(diagonal=150)
    out = decoder.forward(more, torch.arange(150, 159), mask).logits
    assert torch.equal(out, one_by_one)


@pytest.mark.parametrize("size", [2, 5, 40])
@pytest.mark.parametrize(("fmt", "arch"), [("q8", "qwen2"), ("q4", "qwen2"), ("q4", "gemma3")])
def test_a_last_only_feed_is_one_position_forwards(fmt, arch, size):
    """A ``last_only`` feed (a draft model's catch-up on a round's committed
    tokens, a prompt's block) runs each position as a one-position forward
    does, in the native layer operations, which is faster there than
    torch's batched operators: on the native kernels, whose products don't
    depend on the rows fed, its logits and its cache are those of feeding
    the tokens one by one, to the bit (Gemma 3: through its layers' windows
    of 8 too)."""
    if native.layer_ops() is None:
        pytest.skip(f"forerun's native library doesn't run here: {native.unavailable_reason()}")
    decoder = TorchDecoder(_network(fmt, arch), 128)
    ids = [int(t) for t in torch.randint(3, VOCAB, (40 + size,),
                                         generator=torch.Generator().manual_seed(3))]
    decoder.feed(ids[:40])
    last = decoder.feed(ids[40:], last_only=True).logits[0]
    after = decoder.feed([7]).logits[0]
    decoder.rollback(40)
    one_by_one = [decoder.feed([t]).logits[0] for t in ids[40:]]
    assert torch.equal(last, one_by_one[-1])
    assert torch.equal(after, decoder.feed([7]).logits[0])


@pytest.mark.parametrize("fmt", ["float32", "q8"])
def test_what_the_probe_finds_exact_stays_exact_at_a_long_context(fmt):
    """The torch engine's probe stops at its own ``probe_context`` (160), not
    at the 1,200 positions llama.cpp needs: a verified group attends for each
    position as a one-position forward does, so a long context changes none
    of its kernels."""
    decoder = TorchDecoder(_network(fmt), 1300)
    tokens = [int(t) for t in torch.randint(3, VOCAB, (1250,),
                                            generator=torch.Generator().manual_seed(2))]
    probed = exact_group_size(decoder, tokens, contexts=(32, decoder.probe_context),
                              max_group=9)
    long = exact_group_size(decoder, tokens, contexts=(1200,), max_group=9)
    assert long.exact_group >= probed.exact_group >= 1


def test_bad_weight_options(tmp_path):
    with pytest.raises(ConfigError, match="weights must be one of auto, float32"):
        forerun.load("smollm2-135m", weights="q3")
    with pytest.raises(ConfigError, match="weights must be one of"):
        forerun.load("smollm2-135m", weights=4)


def test_bad_weight_option_on_the_command_line(capsys):
    from forerun.cli.main import main

    with pytest.raises(SystemExit):
        main(["generate", "--weights", "q3", "hi"])
    assert "invalid choice: 'q3'" in capsys.readouterr().err


@pytest.mark.real_model
def test_weights_apply_to_the_torch_engine_only(preset_gguf):
    pytest.importorskip("llama_cpp")
    preset_gguf("smollm2-135m")
    with pytest.raises(ConfigError, match="applies to the torch engine"):
        forerun.load("smollm2-135m", engine="llama.cpp", weights="q4")


@pytest.mark.real_model
@pytest.mark.parametrize("fmt", ["q4", "q8", "bfloat16", "q4-all"])
def test_real_model_formats_agree_with_float32(preset_model, fmt):
    """SmolLM2 (Q4_1 and Q8_0/Q6_K tensors) in each format against its
    float32 dequantization, over real text."""
    ref = preset_model("smollm2-135m", 512)
    model = forerun.load("smollm2-135m", weights=fmt, context_length=512, progress=False)
    assert model.decoder.model.weights_format == fmt
    ids = probe_tokens(ref, 160)
    want = ref.decoder.feed(ids).logits
    ref.decoder.reset()
    got = model.decoder.feed(ids).logits
    agree = int((got.argmax(-1) == want.argmax(-1)).sum())     # counted: 152/160 is 95%
    share = {"bfloat16": 0.97, "q8": 0.9, "q4": 0.95, "q4-all": 0.9}[fmt]
    assert agree >= math.ceil(share * len(ids) - 1e-9), f"{agree} of {len(ids)}"


@pytest.mark.real_model
@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_real_model_greedy_speculation_is_plain_decoding(preset_gguf, fmt):
    """Greedy speculative decoding (prompt lookup and self-drafting) in a
    quantized format gives plain decoding's tokens in that format."""
    preset_gguf("smollm2-135m")
    model = forerun.load("smollm2-135m", weights=fmt, context_length=512, progress=False)
    ids = model.encode_prompt(messages=[{"role": "user", "content":
                                         "List the first ten prime numbers, then repeat "
                                         "the list backwards."}])
    plain = model.generate(prompt_ids=ids, max_new_tokens=40, ignore_eos=True)
    # By name, the draft is a second copy loaded in q4-all.
    for draft, k in (("ngram", None), ("ngram", 6), (model, 4), ("smollm2-135m", 4)):
        out = model.generate(prompt_ids=ids, max_new_tokens=40, ignore_eos=True,
                             draft=draft, draft_k=k)
        assert out.tokens == plain.tokens, (draft, k)
        # A fixed draft length always drafts; the adaptive one may take plain
        # steps where this machine's measured costs say drafting won't pay.
        assert out.stats.drafted > 0 or k is None, (draft, k)
    assert model.drafts[-1] is not model
    assert model.drafts[-1].decoder.settings.weights == "q4-all"


def test_off_the_cpu_the_ceiling_is_the_padded_rows():
    """On the CPU the torch engine leaves the verification group to the
    probe; on other devices it promises groups up to the rows every short
    forward is padded to, as a network built for such a device runs them."""
    from types import SimpleNamespace

    from forerun.protocol.model_config import ModelConfig

    ceiling = TorchDecoder.group_ceiling.fget
    on_cpu = _network("float32")
    assert on_cpu.padded_rows is None                     # on the CPU: no padding
    assert ceiling(SimpleNamespace(device=torch.device("cpu"), model=on_cpu)) is None
    for device in ("cuda", "mps", "meta"):
        network = Transformer.__new__(Transformer)
        network._setup(ModelConfig.from_hf(hf_model("qwen2").config.to_dict()), torch.float32,
                       device, "float32")
        assert network.padded_rows == PADDED_ROWS == MAX_GROUP
        assert ceiling(SimpleNamespace(device=torch.device(device), model=network)) == PADDED_ROWS


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "q8"])
def test_padded_rows_make_every_group_one_position_forwards(fmt):
    """With every forward of up to PADDED_ROWS positions run at that many
    rows (what the engine does off the CPU), torch's operators compute each
    fed position as a one-position forward does, to the bit, in every
    format, whatever the group: float32 products on this CPU, which differ
    between row counts unpadded, included.  Through feed() and through
    forward() with an explicit causal mask."""
    network = _network(fmt)
    network.layer_ops = None                  # torch's operators, as on a GPU
    network.padded_rows = PADDED_ROWS
    decoder = TorchDecoder(network, 256)
    tokens = [int(t) for t in torch.randint(3, VOCAB, (200,),
                                            generator=torch.Generator().manual_seed(1))]
    for context in (20, 150):
        decoder.reset()
        decoder.feed(tokens[:context], last_only=True)
        one_by_one = torch.cat([decoder.feed([t]).logits for t in tokens[context:context + 12]])
        for size in (2, 5, 9, 12):
            decoder.rollback(context)
            group = tokens[context:context + size]
            assert torch.equal(decoder.feed(group).logits, one_by_one[:size]), (context, size)
            decoder.rollback(context)
            mask = torch.ones(size, context + size, dtype=torch.bool).tril(diagonal=context)
            out = decoder.forward(group, torch.arange(context, context + size), mask).logits
            assert torch.equal(out, one_by_one[:size]), (context, size)


def test_an_engine_ceiling_caps_the_probe(tmp_path_factory, monkeypatch, tmp_path):
    """An engine that promises no verification group (group_ceiling 1):
    the probe stops at one position, keeps that, and speculative decoding
    verifies one position per forward, still token-identical to plain
    decoding."""
    from tiny_models import hf_folders

    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path))
    monkeypatch.setattr(TorchDecoder, "group_ceiling", 1)
    target, draft = hf_folders(tmp_path_factory, [3, 3], prefix="ceiling")
    model = forerun.load(target, context_length=128, weights="float32", progress=False)
    result = model.verification_grouping()
    assert (result.exact_group, result.max_group) == (1, 1)
    assert model.decoder.verify_group == 1 and "promises no grouping" in result.describe()
    prompt = list(range(5, 25))
    plain = model.generate(prompt_ids=prompt, max_new_tokens=24, temperature=0, draft=None)
    spec = model.generate(prompt_ids=prompt, max_new_tokens=24, temperature=0, draft=draft,
                          draft_k=4)
    assert spec.tokens == plain.tokens and spec.stats.verify_group == 1
    assert spec.stats.drafted > 0
