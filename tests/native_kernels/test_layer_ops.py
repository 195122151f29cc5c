"""forerun's native layer operations (``avx2_layer_ops.c``): RMSNorm,
SiLU gating, and RoPE with the cache write and attention, against torch's
operators; a position's result alone and among others; bad arguments; a
library that computes them wrongly; and their use where torch's matrix
kernels won the timing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from forerun.engines import kernel_choice
from forerun.engines.layer_factory import make_linear
from forerun.engines.rope import apply_rotary
from forerun.engines.transformer import rms_norm
from forerun.kernels import build, native
from forerun.machine.cpu import cpu_flags

CPU = torch.device("cpu")


def _angles(positions: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    freqs = positions.float()[:, None] * inv[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _torch_attention(qkv, cos, sin, keys, values, start, mask, heads):
    """What the transformer's torch path computes, on copies of the cache."""
    t = qkv.shape[0]
    kv, _, d = keys.shape
    q, k, v = qkv.split((heads * d, kv * d, kv * d), dim=-1)
    q = apply_rotary(q.reshape(t, heads, d).transpose(0, 1), cos, sin)
    k = apply_rotary(k.reshape(t, kv, d).transpose(0, 1), cos, sin)
    keys, values = keys.clone(), values.clone()
    keys[:, start:start + t], values[:, start:start + t] = k, v.reshape(t, kv, d).transpose(0, 1)
    if mask is None:
        mask = torch.arange(start + t)[None] <= torch.arange(start, start + t)[:, None]
    out = F.scaled_dot_product_attention(q[None], keys[None, :, :start + t],
                                         values[None, :, :start + t], attn_mask=mask[None, None],
                                         enable_gqa=heads != kv)
    return out[0].transpose(0, 1).reshape(t, heads * d), keys, values


def _case(heads, kv, d, start, t, capacity=300, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (heads + 2 * kv) * d, generator=gen)
    keys = torch.randn(kv, capacity, d, generator=gen)
    values = torch.randn(kv, capacity, d, generator=gen)
    cos, sin = _angles(torch.arange(start, start + t), d)
    return qkv, cos, sin, keys, values


def test_rms_norm_and_gating_match_torch(kernels):
    gen = torch.Generator().manual_seed(0)
    for h in (8, 40, 896, 1539):                        # whole vectors, and tails
        x, w = torch.randn(5, h, generator=gen), torch.randn(h, generator=gen)
        assert torch.allclose(kernels.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6),
                              rtol=1e-5, atol=1e-5)
        gate_up = 6 * torch.randn(5, 2 * h, generator=gen)
        gate, up = gate_up.chunk(2, dim=-1)
        assert torch.allclose(kernels.silu_mul(gate_up), F.silu(gate) * up,
                              rtol=1e-5, atol=1e-5)
    # Gates far out: silu(-100) is about 0 and silu(1e30) 1e30, not NaN or inf.
    extreme = torch.tensor([[-100.0, 100.0, 0.0, -1e30, 1e30, 1.0, 1.0, 1.0, 1.0, 1.0]])
    assert torch.allclose(kernels.silu_mul(extreme), torch.tensor([[0.0, 100.0, 0.0, 0.0, 1e30]]),
                          rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("heads,kv,d", [(4, 2, 16), (4, 4, 12), (14, 2, 64), (12, 2, 128),
                                        (3, 1, 10)])
@pytest.mark.parametrize("start,t", [(0, 1), (37, 1), (200, 5), (0, 9)])
def test_attention_matches_torchs(kernels, heads, kv, d, start, t):
    """Grouped and plain heads, head sizes with and without a tail of 8,
    an empty cache, one position and several: the output, and the rotated
    keys and the values written into the cache, are torch's."""
    qkv, cos, sin, keys, values = _case(heads, kv, d, start, t)
    want, want_keys, want_values = _torch_attention(qkv, cos, sin, keys, values, start, None,
                                                    heads)
    got = kernels.attention(qkv.clone(), cos, sin, keys, values, start, None, heads)
    assert torch.allclose(got, want, atol=2e-5)
    assert torch.allclose(keys[:, :start + t], want_keys[:, :start + t], atol=2e-5)
    assert torch.equal(values[:, :start + t], want_values[:, :start + t])


def test_a_masked_attention_sees_only_its_slots(kernels):
    """A tree's mask: each position attends over exactly the slots allowed."""
    heads, kv, d, start, t = 4, 2, 16, 50, 6
    qkv, cos, sin, keys, values = _case(heads, kv, d, start, t, seed=3)
    mask = torch.rand(t, start + t, generator=torch.Generator().manual_seed(4)) < 0.5
    mask[:, start:] = torch.eye(t, dtype=torch.bool) | (torch.rand(t, t) < 0.3).tril()
    want, want_keys, _ = _torch_attention(qkv, cos, sin, keys, values, start, mask, heads)
    got = kernels.attention(qkv.clone(), cos, sin, keys, values, start,
                            mask.to(torch.uint8), heads)
    assert torch.allclose(got, want, atol=2e-5)
    # A slot it may not see changes nothing; one it sees changes its output.
    hidden = int(torch.nonzero(~mask[0, :start])[0])
    seen = int(torch.nonzero(mask[0, :start])[0])
    for slot, changes in ((hidden, False), (seen, True)):
        keys2, values2 = keys.clone(), values.clone()
        values2[:, slot] += 1.0
        again = kernels.attention(qkv.clone(), cos, sin, keys2, values2, start,
                                  mask.to(torch.uint8), heads)
        assert torch.equal(again[0], got[0]) != changes


def test_a_tree_that_sees_the_whole_prefix_gets_torchs_attention(kernels):
    """A tree's usual mask: every position sees the whole cache before it
    (whole blocks of slots, read for all rows at once) and some of the fed
    positions (blocks seen in part, slot by slot)."""
    heads, kv, d, start, t = 6, 2, 32, 70, 9
    qkv, cos, sin, keys, values = _case(heads, kv, d, start, t, seed=6)
    mask = torch.ones(t, start + t, dtype=torch.bool)
    mask[:, start:] = torch.eye(t, dtype=torch.bool) | (
        torch.rand(t, t, generator=torch.Generator().manual_seed(7)) < 0.4).tril()
    want, _, _ = _torch_attention(qkv, cos, sin, keys, values, start, mask, heads)
    got = kernels.attention(qkv.clone(), cos, sin, keys, values, start,
                            mask.to(torch.uint8), heads)
    assert torch.allclose(got, want, atol=2e-5)


@pytest.mark.parametrize("start,t", [(0, 20), (45, 20), (100, 3)])
def test_the_causal_mask_given_as_a_mask_changes_no_bit(kernels, start, t):
    """The causal mask passed as a mask, or no mask: the same result to the
    bit, whichever blocks of slots a row sees whole or in part (more rows
    than share one read of the cache, too)."""
    heads, kv, d = 7, 1, 64
    qkv, cos, sin, keys, values = _case(heads, kv, d, start, t, capacity=130, seed=8)
    causal = torch.arange(start + t)[None] <= torch.arange(start, start + t)[:, None]
    plain = kernels.attention(qkv.clone(), cos, sin, keys.clone(), values.clone(), start,
                              None, heads)
    masked = kernels.attention(qkv.clone(), cos, sin, keys.clone(), values.clone(), start,
                               causal.to(torch.uint8), heads)
    assert torch.equal(plain, masked)


@pytest.mark.parametrize("heads,kv,d", [(14, 2, 64), (9, 3, 64), (4, 1, 128)])
def test_a_position_is_the_same_alone_or_among_others(kernels, heads, kv, d):
    """Row invariance: a position's output is bit-identical fed alone (as a
    one-position step sees the slots before it) or anywhere among up to 17
    positions (more than share one read of the cache), on 1 or 2 threads,
    with more key heads than threads, fewer, or a number they don't divide."""
    start = 120
    qkv, cos, sin, keys, values = _case(heads, kv, d, start, 17, seed=5)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            cache_k, cache_v = keys.clone(), values.clone()
            together = kernels.attention(qkv.clone(), cos, sin, cache_k, cache_v, start, None,
                                         heads)
            for t in (2, 9, 17):
                got = kernels.attention(qkv[:t].clone(), cos[:t], sin[:t], keys.clone(),
                                        values.clone(), start, None, heads)
                assert torch.equal(got, together[:t])
            cache_k, cache_v = keys.clone(), values.clone()
            for i in range(17):
                alone = kernels.attention(qkv[i:i + 1].clone(), cos[i:i + 1], sin[i:i + 1],
                                          cache_k, cache_v, start + i, None, heads)
                assert torch.equal(alone[0], together[i]), (n, i)
    finally:
        torch.set_num_threads(threads)


def _wide_build():
    """This CPU's vpdpbusd build with 512-bit registers (AMX or AVX512-VNNI),
    whose attention runs its own 512-bit passes; the test is skipped where
    the CPU has none."""
    wide = [extra for name, extra in build.dot_builds(cpu_flags())
            if name in ("amx-int8", "avx512-vnni")]
    if not wide:
        pytest.skip("this CPU has no AVX-512 build")
    return native.build_library(wide[-1])


@pytest.mark.parametrize("heads,kv,d", [(12, 2, 128), (14, 2, 64), (9, 3, 64), (4, 1, 256),
                                        (6, 2, 24)])
def test_the_512bit_attention_gives_the_avx2_builds_bit_for_bit(kernels, heads, kv, d):
    """The AVX-512 builds' attention (query heads in pairs over 4 keys,
    outputs in 16-float pieces, 16 scores' exponentials at a time) equals
    the AVX2 build's to the bit: the head shapes of Qwen2.5 1.5B and 0.5B,
    SmolLM2 and Gemma 3 270M, and one whose values end in an 8-float piece;
    1 to 40 rows after 0 to 70 slots, causal and masked, over float32 and
    float16 caches."""
    wide, avx2 = _wide_build(), native.layer_ops()
    assert wide.path != avx2.path and avx2.instruction == "avx2"
    gen = torch.Generator().manual_seed(11)
    for start, t in ((0, 1), (70, 1), (13, 4), (70, 40)):
        qkv, cos, sin, keys, values = _case(heads, kv, d, start, t, capacity=start + t,
                                            seed=start + t)
        mask = torch.rand(t, start + t, generator=gen) < 0.8
        mask[:, 0] = True
        for dtype in (torch.float32, torch.float16):
            for rows in (None, mask.to(torch.uint8)):
                got, want = (lib.attention(qkv.clone(), cos, sin, keys.to(dtype),
                                           values.to(dtype), start, rows, heads)
                             for lib in (wide, avx2))
                assert torch.equal(got, want), (start, t, dtype, rows is None)


@pytest.mark.parametrize("heads,kv,d,start,t", [(12, 2, 128, 40, 1), (12, 2, 128, 40, 17),
                                                (9, 3, 64, 0, 5), (4, 2, 12, 7, 3)])
def test_a_half_cache_gives_the_float32_attention_of_its_values(kernels, heads, kv, d, start,
                                                                  t):
    """A float16 cache is read as the float32 values it holds: where the
    cache and the fed keys and values are values float16 holds exactly (no
    rotation), its results and its slots equal a float32 cache's to the
    bit, causal and masked, one row or more than share a read (17), with
    head sizes that are whole registers or not (12)."""
    qkv, _, _, keys, values = _case(heads, kv, d, start, t, capacity=start + t + 3, seed=3)
    qkv = qkv.half().float()
    cos, sin = torch.ones(t, d), torch.zeros(t, d)
    mask = torch.rand(t, start + t, generator=torch.Generator().manual_seed(4)) < 0.6
    mask[torch.arange(t), start + torch.arange(t)] = True
    for rows in (None, mask.to(torch.uint8)):
        halves = keys.half(), values.half()
        floats = halves[0].float(), halves[1].float()
        got = kernels.attention(qkv.clone(), cos, sin, *halves, start, rows, heads)
        want = kernels.attention(qkv.clone(), cos, sin, *floats, start, rows, heads)
        assert torch.equal(got, want)
        assert all(torch.equal(h.float(), f) for h, f in zip(halves, floats))


def test_a_half_cache_holds_its_keys_and_values_rounded_as_torch_rounds_them(kernels):
    """Rotated keys and fed values go into a float16 cache rounded to the
    nearest (ties to even: torch's ``.half()``), and the slots outside the
    fed ones are left as they were."""
    heads, kv, d, start, t = 6, 2, 64, 30, 9
    qkv, cos, sin, keys, values = _case(heads, kv, d, start, t, capacity=50, seed=6)
    first_value = (heads + kv) * d
    # ties, overflow, subnormals
    qkv[0, first_value:first_value + 8] = torch.tensor([1 + 2 ** -11, 1 + 3 * 2 ** -11, 7e4,
                                                        -1e-8, 3e-5, 2 ** -24, 65519.0, 65520.0])
    halves = keys.half(), values.half()
    before = halves[0].clone(), halves[1].clone()
    floats = keys.clone(), values.clone()
    kernels.attention(qkv.clone(), cos, sin, *halves, start, None, heads)
    kernels.attention(qkv.clone(), cos, sin, *floats, start, None, heads)
    fed = slice(start, start + t)
    for h, f, b in zip(halves, floats, before):
        assert torch.equal(h[:, fed], f[:, fed].half())
        assert torch.equal(h[:, :start], b[:, :start]) and torch.equal(h[:, fed.stop:],
                                                                       b[:, fed.stop:])


def test_bad_arguments_are_refused_before_any_write(kernels):
    """Shapes that would make the library write past the cache or read
    past the mask raise, and leave the cache as it was."""
    heads, kv, d = 4, 2, 16
    qkv, cos, sin, keys, values = _case(heads, kv, d, 0, 3, capacity=10)
    before = keys.clone()
    mask = torch.ones(3, 11, dtype=torch.uint8)
    bad = {
        "no room": dict(start=8),
        "a negative start": dict(start=-1),
        "a mask of the wrong shape": dict(start=8 - 3, mask=torch.ones(3, 4, dtype=torch.uint8)),
        "a bool mask": dict(start=8, mask=mask.bool()),
        "float16 keys beside float32 values": dict(keys=keys.half()),
        "a bfloat16 cache": dict(keys=keys.bfloat16(), values=values.bfloat16()),
        "a cache view": dict(keys=keys[:, ::2]),
        "too few heads' values": dict(heads=3),
        "angles of the wrong size": dict(cos=cos[:, :8]),
    }
    for what, change in bad.items():
        args = dict(qkv=qkv.clone(), cos=cos, sin=sin, keys=keys, values=values, start=0,
                    mask=None, heads=heads)
        args.update(change)
        with pytest.raises(ValueError, match="attention needs"):
            kernels.attention(**args)
        assert torch.equal(keys, before), what


def test_a_norm_weight_or_gating_width_that_does_not_fit_is_refused(kernels):
    x = torch.randn(2, 16)
    for weight in (torch.randn(15), torch.randn(16).double(), torch.randn(32)[::2]):
        with pytest.raises(ValueError, match="RMSNorm needs"):
            kernels.rms_norm(x, weight, 1e-6)
    with pytest.raises(ValueError, match="even width"):
        kernels.silu_mul(torch.randn(2, 15))


def test_a_library_whose_attention_is_wrong_is_refused(altered_source):
    """The load-time check catches layer operations that compute other
    numbers (here attention scaled by 1/D instead of 1/sqrt(D))."""
    altered_source("LAYER_OPS_SOURCE", "1.0f / sqrtf((float)D)", "1.0f / (float)D")
    assert native.layer_ops() is None and native.native_kernels() is None
    assert "computes attention wrongly" in native.unavailable_reason()


@pytest.mark.parametrize("old,new", [
    # written rounded toward zero instead of to the nearest
    ("_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT",
     "_mm256_loadu_ps(src + i), _MM_FROUND_TO_ZERO"),
    # read one element off
    ("((const uint16_t *)p + i)", "((const uint16_t *)p + i + 1)"),
], ids=["rounding", "reading"])
def test_a_library_whose_float16_cache_is_wrong_is_refused(altered_source, old, new):
    """The load-time check catches a float16 cache written or read wrongly."""
    altered_source("LAYER_OPS_SOURCE", old, new)
    assert native.layer_ops() is None and native.native_kernels() is None
    assert "attention over a float16 cache differs" in native.unavailable_reason()


def test_they_run_where_torchs_matrix_kernels_won(fresh_cache, monkeypatch):
    """The layer operations don't depend on the matrices' kernels: where
    torch's won the timing, the layers multiply with torch's and still
    run their norms and attention natively."""
    monkeypatch.delenv(native.SWITCH)
    monkeypatch.setattr(kernel_choice, "time_against_torch",
                        lambda kernels, repeats=3: {"native": [30.0, 40.0],
                                                    "torch": [10.0, 20.0]})
    assert kernel_choice.product_kernels() is None
    assert native.layer_ops() is not None
    assert make_linear(torch.randn(32, 64), None, "q4", CPU).kernel == "torch"


def test_turned_off_by_the_switch_with_the_products(monkeypatch):
    monkeypatch.setenv(native.SWITCH, "0")
    native.reset()
    try:
        assert native.layer_ops() is None
    finally:
        native.reset()
