"""The checks a built library passes before anything uses it: its products
of every format against float64 sums of the same quantized values
(:func:`check_products`), its layer operations against float64 formulas
(:func:`check_layer_ops`), its decoder layer in one call against those
operations run one by one, bit for bit (:func:`check_decoder_layer`), and a
vpdpbusd build's products against the AVX2 build's, bit for bit
(:func:`check_same_products`).  Each raises
:class:`~forerun.kernels.build.Unavailable` naming what it computes wrongly."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from forerun.kernels.binding import (
    ACTIVATION_CODES,
    LayerExtras,
    LayerMatrices,
    Matrix,
    NativeKernels,
    Product,
    SequenceRows,
)
from forerun.kernels.build import Unavailable
from forerun.kernels.layouts import (
    BLOCK,
    GROUP,
    from_chunks,
    half_group_order,
    input_unit,
    pack_high_bits,
    pack_nibbles,
    padded,
    padded_rows,
    row_grouped,
    to_chunks,
    values_grouped,
)


@dataclass
class CheckMatrices:
    """Random weights of each format, for the checks of a built library: the
    values, and (``packed4`` .. ``packed8``) the arguments the products take
    after the activations."""

    q4: torch.Tensor          # [N, Kp] 0..15, with float16 scale and minimum per group
    scale: torch.Tensor
    minimum: torch.Tensor
    q8: torch.Tensor          # [N, Kp] int8, natural order, with a float32 scale per row
    s8: torch.Tensor
    q6: torch.Tensor          # [N, Kp] 0..63, an int8 scale per 16 (natural order), d per 256
    s6: torch.Tensor
    d6: torch.Tensor

    def packed4(self, rows: int) -> tuple:
        """The 4-bit matrix's arguments for kernels of row group ``rows``."""
        b = self.q4.shape[1] // BLOCK
        return (values_grouped(pack_nibbles(self.q4), rows), row_grouped(self.scale, b, rows),
                row_grouped(self.minimum, b, rows), self.q4.shape[0])

    def packed6(self, rows: int) -> tuple:
        b = self.q6.shape[1] // BLOCK
        return (values_grouped(pack_nibbles(self.q6 & 15), rows),
                values_grouped(pack_high_bits(self.q6), rows),
                row_grouped(half_group_order(self.s6), b, rows), row_grouped(self.d6, b, rows),
                self.q6.shape[0])

    def packed8(self, rows: int) -> tuple:
        n = self.q8.shape[0]
        scale = torch.nn.functional.pad(self.s8, (0, padded_rows(n, rows) - n))
        return (values_grouped(to_chunks(self.q8), rows), scale, n)


def check_matrices(gen: torch.Generator, n: int, kp: int) -> CheckMatrices:
    """``n`` random rows of ``kp`` (a multiple of 256) weights per format."""
    q4 = torch.randint(0, 16, (n, kp), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, kp // GROUP, generator=gen) + 0.5).half()
    minimum = (-8 * scale.float()).half()
    q8 = torch.randint(-128, 128, (n, kp), dtype=torch.int8, generator=gen)
    s8 = torch.rand(n, generator=gen) + 0.5
    q6 = torch.randint(0, 64, (n, kp), dtype=torch.uint8, generator=gen)
    s6 = torch.randint(-128, 128, (n, kp // 16), dtype=torch.int8, generator=gen)
    d6 = torch.rand(n, kp // BLOCK, generator=gen) / 64 + 1e-3
    return CheckMatrices(q4, scale, minimum, q8, s8, q6, s6, d6)


def check_products(kernels: NativeKernels) -> None:
    """The products on random values, against the same sums in float64
    from the quantized activations the library itself made."""
    gen = torch.Generator().manual_seed(0)
    n, k = 38, 300                            # padded rows and columns, a part row chunk
    x = torch.randn(5, k, generator=gen)
    rows = kernels.quantize(x)
    kp = padded(k)
    xq = from_chunks(rows.values).double() * rows.scale.double().repeat_interleave(GROUP, 1)
    if not torch.allclose(xq[:, :k], x.double(), atol=float(x.abs().max()) / 200):
        raise Unavailable("the built library quantizes activations wrongly")
    m = check_matrices(gen, n, kp)
    w4 = m.q4.double() * m.scale.double().repeat_interleave(GROUP, 1) + \
        m.minimum.double().repeat_interleave(GROUP, 1)
    w8 = m.q8.double() * m.s8.double()[:, None]
    p4, p8 = m.packed4(kernels.row_group), m.packed8(kernels.row_group)
    got4 = kernels.q4_matmul(rows, *p4)
    got8 = kernels.q8_matmul(rows, *p8)
    if not (torch.equal(kernels.q4_linear(x, *p4), got4)
            and torch.equal(kernels.q8_linear(x, *p8), got8)):
        raise Unavailable("the built library's one-call products differ from its two-call ones")
    w6 = ((m.q6.double() - 32) * m.s6.double().repeat_interleave(16, 1)
          * m.d6.double().repeat_interleave(BLOCK, 1))
    got6 = kernels.q6_linear(x, *m.packed6(kernels.row_group))
    for got, w, name in ((got4, w4, "4-bit"), (got6, w6, "6-bit"), (got8, w8, "8-bit")):
        want = xq @ w.t()
        if not torch.allclose(got.double(), want, rtol=1e-4, atol=1e-3 * float(want.abs().max())):
            raise Unavailable(f"the built library computes {name} products wrongly "
                              f"(largest error {float((got.double() - want).abs().max()):.3g})")
    _check_half_block(kernels, x, m)


def _check_half_block(kernels: NativeKernels, x: torch.Tensor, m: CheckMatrices) -> None:
    """An 8-bit matrix whose inputs end in half a block (where this build
    reads one: :func:`~forerun.kernels.layouts.input_unit`) gives what the
    same matrix padded to a whole block gives, bit for bit, for 1 to 7
    positions (one pass of each height) and as two calls."""
    unit = input_unit("q8", kernels.row_group)
    if kernels.k_unit != unit:
        raise Unavailable(f"the built library pads 8-bit inputs to {kernels.k_unit}, "
                          f"its layout to {unit}")
    k = x.shape[1]
    if padded(k, unit) == padded(k):
        return
    half = replace(m, q8=m.q8[:, :padded(k, unit)].contiguous())
    for t in range(1, x.shape[0] + 3):
        rows = x[torch.arange(t) % x.shape[0]]
        whole = kernels.q8_linear(rows, *m.packed8(kernels.row_group))
        got = kernels.q8_linear(rows, *half.packed8(kernels.row_group))
        two = kernels.q8_matmul(kernels.quantize(rows, padded(k, unit)),
                                *half.packed8(kernels.row_group))
        if not (torch.equal(got, whole) and torch.equal(two, whole)):
            raise Unavailable("the built library's 8-bit products of a half block differ from "
                              "the same matrix's padded to a whole block")


def check_layer_ops(kernels: NativeKernels) -> None:
    """The layer operations on random values, against float64 formulas:
    RMSNorm, SiLU and GELU gating, and attention with grouped heads over a cache,
    causal and masked."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 40, generator=gen), torch.randn(40, generator=gen)
    want = w.double() * x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    worst = {"RMSNorm": (kernels.rms_norm(x, w, 1e-6).double() - want).abs().max()}
    gu = 4 * torch.randn(3, 2 * 20, generator=gen, dtype=torch.float64)
    gate, up = gu.chunk(2, dim=-1)
    worst["SiLU gating"] = (kernels.silu_mul(gu.float()).double()
                            - gate * torch.sigmoid(gate) * up).abs().max()
    u = 0.7978845608028654 * (gate + 0.044715 * gate ** 3)
    worst["GELU gating"] = (kernels.gelu_tanh_mul(gu.float()).double()
                            - gate * torch.sigmoid(2 * u) * up).abs().max()
    heads, kv, d, capacity, start, t = 4, 2, 12, 16, 5, 3
    qkv = torch.randn(t, (heads + 2 * kv) * d, generator=gen)
    angles = torch.rand(t, d // 2, generator=gen, dtype=torch.float64) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    mask = torch.rand(t, start + t, generator=gen) < 0.7
    mask[:, 0] = True
    for rows in (None, mask):
        keys = torch.randn(kv, capacity, d, generator=gen)
        values = torch.randn(kv, capacity, d, generator=gen)
        cache_k, cache_v = keys.double().clone(), values.double().clone()
        fed = qkv.double().view(t, heads + 2 * kv, d)

        def rotated(v):
            half = d // 2
            return v * cos[:, None] + torch.cat([-v[..., half:], v[..., :half]], -1) * sin[:, None]

        q, k = rotated(fed[:, :heads]), rotated(fed[:, heads:heads + kv])
        cache_k[:, start:start + t] = k.transpose(0, 1)
        cache_v[:, start:start + t] = fed[:, heads + kv:].transpose(0, 1)
        sees = (torch.arange(start + t)[None] <= torch.arange(start, start + t)[:, None]
                if rows is None else rows)
        group = heads // kv
        scores = torch.einsum("thd,hsd->ths", q, cache_k[:, :start + t].repeat_interleave(
            group, 0)) / d ** 0.5
        probs = scores.masked_fill(~sees[:, None], float("-inf")).softmax(-1)
        want = torch.einsum("ths,hsd->thd", probs, cache_v[:, :start + t].repeat_interleave(
            group, 0)).reshape(t, heads * d)
        got = kernels.attention(qkv.clone(), cos.float(), sin.float(), keys, values, start,
                                None if rows is None else rows.to(torch.uint8), heads)
        name = "attention" if rows is None else "masked attention"
        worst[name] = max((got.double() - want).abs().max(),
                          (keys.double() - cache_k).abs().max(),
                          (values.double() - cache_v).abs().max())
    for name, error in worst.items():
        if not error < 1e-4:
            raise Unavailable(f"the built library computes {name} wrongly "
                              f"(largest error {float(error):.3g})")
    check_half_cache(kernels, qkv, cos.float(), sin.float(), heads, kv, start, gen)


def check_half_cache(kernels: NativeKernels, qkv: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, heads: int, kv: int, start: int,
                     gen: torch.Generator) -> None:
    """Attention over a float16 cache is attention over a float32 cache
    holding the same values, to the bit, and writes its new keys and values
    as torch rounds them to float16.  (The rows see the earlier slots only,
    so that neither cache's new slots, rounded in one and not in the other,
    are read.)"""
    t, d = qkv.shape[0], cos.shape[1]
    sees = torch.rand(t, start + t, generator=gen) < 0.7
    sees[:, 0], sees[:, start:] = True, False
    mask = sees.to(torch.uint8)
    halves = [torch.randn(kv, start + t, d, generator=gen).half() for _ in range(2)]
    floats = [h.float() for h in halves]
    got = kernels.attention(qkv.clone(), cos, sin, halves[0], halves[1], start, mask, heads)
    want = kernels.attention(qkv.clone(), cos, sin, floats[0], floats[1], start, mask, heads)
    if not (torch.equal(got, want) and all(torch.equal(h[:, start:], f[:, start:].half())
                                           for h, f in zip(halves, floats))):
        raise Unavailable("the built library's attention over a float16 cache differs "
                          "from its attention over the same values in float32")


def check_decoder_layer(kernels: NativeKernels, ops: NativeKernels) -> None:
    """``kernels``' decoder layer (:meth:`NativeKernels.decoder_layer`)
    equals, bit for bit, the operations it chains run one by one, the
    products on ``kernels`` and the norms, attention and gating on ``ops``
    (the library the engine's layer operations run on: the same one, or
    the AVX2 build beside a vpdpbusd one): two sequences of 3 and 2 rows,
    and of 7 and 3 (from 8 rows a layer shares its row-wise steps among
    the threads: ``FR_SPLIT_ROWS``), one masked, with a q/k/v of two
    formats side by side, a bias, and a 6-bit and an 8-bit matrix; once as
    a Qwen2 layer, once with what Qwen3 and Gemma 3 add (query and key
    norms, a query scale, output norms, the tanh GELU)."""
    for extras in (False, True):
        for counts in ((3, 2), (7, 3)):
            _check_decoder_layer(kernels, ops, extras, counts)


def _check_decoder_layer(kernels: NativeKernels, ops: NativeKernels, with_extras: bool,
                         counts: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(3)
    hidden, heads, kv, d, inner, eps = 40, 4, 2, 8, 24, 1e-6
    rows = kernels.row_group

    def matrix(fmt: str, n: int, k: int) -> tuple[Matrix, tuple]:
        m = check_matrices(gen, n, padded(k))
        args = {"q4": m.packed4, "q6": m.packed6, "q8": m.packed8}[fmt](rows)
        return Matrix.of(int(fmt[1:]), n, k, args[:-1]), args

    def product(parts: list[tuple[Matrix, tuple]], bias: torch.Tensor | None) -> Product:
        return Product.of([m for m, _ in parts], bias)

    q, kvs = matrix("q4", heads * d, hidden), matrix("q8", 2 * kv * d, hidden)
    o, gate_up = matrix("q6", hidden, heads * d), matrix("q4", 2 * inner, hidden)
    down = matrix("q8", hidden, inner)
    bias = torch.randn((heads + 2 * kv) * d, generator=gen)
    norms = torch.rand(2, hidden, generator=gen) + 0.5
    head_norms = torch.rand(2, d, generator=gen) + 0.5
    out_norms = torch.rand(2, hidden, generator=gen) + 0.5
    factor = 0.7
    extras = LayerExtras(head_norms[0].data_ptr(), head_norms[1].data_ptr(),
                         out_norms[0].data_ptr(), out_norms[1].data_ptr(), factor,
                         ACTIVATION_CODES["gelu_tanh"]) if with_extras else None
    layer = LayerMatrices(norms[0].contiguous(), norms[1].contiguous(),
                          product([q, kvs], bias), product([o], None),
                          product([gate_up], None), product([down], None), (), extras)
    run: dict[str, Callable[..., torch.Tensor]] = {
        "q4": kernels.q4_linear, "q6": kernels.q6_linear, "q8": kernels.q8_linear}
    one_by_one = {name: (lambda x, m=m, f=f: run[f](x, *m[1]))
                  for name, m, f in (("q", q, "q4"), ("kv", kvs, "q8"), ("o", o, "q6"),
                                     ("gate_up", gate_up, "q4"), ("down", down, "q8"))}
    layers, capacity, starts = 3, 16, (5, 2)
    caches = [(torch.randn(layers, kv, capacity, d, generator=gen),
               torch.randn(layers, kv, capacity, d, generator=gen)) for _ in counts]
    mask = (torch.rand(counts[1], starts[1] + counts[1], generator=gen) < 0.7).to(torch.uint8)
    mask[:, 0] = 1
    masks = (None, mask)
    t = sum(counts)
    x = torch.randn(t, hidden, generator=gen)
    angles = torch.rand(t, d // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    # one by one, on copies of the caches
    mine = [(k.clone(), v.clone()) for k, v in caches]
    h = ops.rms_norm(x, layer.attn_norm, eps)
    qkv = torch.cat([one_by_one["q"](h), one_by_one["kv"](h)], -1) + bias
    if with_extras:
        for begin, count, norm in ((0, heads, head_norms[0]), (heads * d, kv, head_norms[1])):
            part = qkv[:, begin:begin + count * d]
            part.copy_(ops.rms_norm(part.reshape(t * count, d), norm, eps).view(t, count * d))
        qkv[:, :heads * d] *= torch.tensor(factor, dtype=torch.float32)
    parts, row = [], 0
    for (keys, values), start, count, rows_mask in zip(mine, starts, counts, masks):
        parts.append(ops.attention(qkv[row:row + count], cos[row:row + count],
                                   sin[row:row + count], keys[1], values[1], start, rows_mask,
                                   heads))
        row += count
    out = one_by_one["o"](torch.cat(parts))
    want = x + (ops.rms_norm(out, out_norms[0], eps) if with_extras else out)
    h = ops.rms_norm(want, layer.mlp_norm, eps)
    gated = one_by_one["gate_up"](h)
    out = one_by_one["down"](ops.gelu_tanh_mul(gated) if with_extras else ops.silu_mul(gated))
    want = want + (ops.rms_norm(out, out_norms[1], eps) if with_extras else out)

    got = x.clone()
    spans = (SequenceRows * 2)(*(
        SequenceRows(count, start, capacity, keys.data_ptr(), values.data_ptr(),
                     None if m is None else m.data_ptr())
        for (keys, values), start, count, m in zip(caches, starts, counts, masks)))
    kernels.decoder_layer(got, layer, eps, heads, kv, cos, sin, 1, spans,
                          kernels.decoder_layer_scratch(t, hidden, heads, kv, d, inner))
    if not (torch.equal(got, want) and all(torch.equal(a, b) for pair in zip(caches, mine)
                                           for a, b in zip(*pair))):
        added = (" (with query and key norms, a query scale, output norms and GELU)"
                 if with_extras else "")
        raise Unavailable("the built library's decoder layer differs from its operations run "
                          f"one by one{added}")


def check_same_products(dot: NativeKernels, avx2: NativeKernels) -> None:
    """``dot``'s products equal ``avx2``'s bit for bit: the 4-, 6- and 8-bit
    products of 1 to 9 rows and of 16, 17 and 40 (an AMX build's tiles take
    those, from 16 rows during the check), on random values with the extreme weights
    (products that would overflow an int16 sum if a build let them), each
    build given the matrices in its own row groups.  Raises Unavailable
    naming the first that differs."""
    gen = torch.Generator().manual_seed(2)
    n, k = 21, 520                            # a part row chunk, and padding
    m = check_matrices(gen, n, padded(k))
    m.q4[0], m.q6[0], m.q8[0] = 15, 63, -128  # the largest products
    packed = {lib.row_group: (m.packed4(lib.row_group), m.packed6(lib.row_group),
                              m.packed8(lib.row_group)) for lib in (dot, avx2)}
    tile_rows = dot.tile_rows
    if tile_rows is not None:
        dot.set_tile_rows(16)               # the tiles take 16 rows and more here
    try:
        _compare_products(dot, avx2, packed, gen, k)
    finally:
        if tile_rows is not None:
            dot.set_tile_rows(tile_rows)


def _compare_products(dot: NativeKernels, avx2: NativeKernels, packed: dict,
                      gen: torch.Generator, k: int) -> None:
    for t in (*range(1, 10), 16, 17, 40):
        x = torch.randn(t, k, generator=gen) * 3
        x[0, :64] = 100                      # whole groups at +127
        # Each lambda runs within its own iteration, but binding x keeps that
        # true should they ever outlive it.
        for name, run in (("4-bit", lambda lib, x=x: lib.q4_linear(x, *packed[lib.row_group][0])),
                          ("6-bit", lambda lib, x=x: lib.q6_linear(x, *packed[lib.row_group][1])),
                          ("8-bit", lambda lib, x=x: lib.q8_linear(x, *packed[lib.row_group][2]))):
            if not torch.equal(run(dot), run(avx2)):
                raise Unavailable(f"its {name} products of {t} rows differ from the AVX2 "
                                  f"build's")


def check_same_attention(dot: NativeKernels, avx2: NativeKernels) -> None:
    """``dot``'s attention equals ``avx2``'s bit for bit (a build with
    512-bit registers runs its own passes: ``avx2_layer_ops.c``'s
    ATTENTION_512): 7 query heads over one key head (three pairs and one
    alone) of 40 values (two 16-float pieces and an 8-float one), 1 and 6
    rows after 12 slots (up to 18 scores a row: a 16-float piece of them
    and a rest), causal and masked, over a float32 and a float16 cache.
    Raises Unavailable naming the first case that differs."""
    gen = torch.Generator().manual_seed(4)
    heads, kv, d, start = 7, 1, 40, 12
    for t in (1, 6):
        qkv = torch.randn(t, (heads + 2 * kv) * d, generator=gen)
        angles = torch.rand(t, d, generator=gen) * 6
        cos, sin = angles.cos(), angles.sin()
        mask = torch.rand(t, start + t, generator=gen) < 0.7
        mask[:, 0] = True
        for dtype in (torch.float32, torch.float16):
            keys = torch.randn(kv, start + t, d, generator=gen).to(dtype)
            values = torch.randn(kv, start + t, d, generator=gen).to(dtype)
            for rows in (None, mask.to(torch.uint8)):
                got, want = (lib.attention(qkv.clone(), cos, sin, keys.clone(), values.clone(),
                                           start, rows, heads) for lib in (dot, avx2))
                if not torch.equal(got, want):
                    raise Unavailable(
                        f"its attention of {t} rows over a {str(dtype)[6:]} cache"
                        f"{'' if rows is None else ' with a mask'} differs from the AVX2 "
                        "build's")


def check_tiles_in_a_process(kernels: NativeKernels) -> None:
    """An AMX build's tiles run a small product correctly in a process of
    their own (``fr_amx_probe``), before this process runs any: a machine
    that advertises AMX but faults on it (as llama.cpp's AMX kernels fault
    in some virtual machines) ends the probe, not the caller.  Raises
    Unavailable naming what happened; returns where the OS refuses the
    tiles (the build then runs its vpdpbusd passes)."""
    if not kernels.path.is_file():
        raise Unavailable("its tiles can't be tried in a separate process: the library "
                          "was built in a temporary folder and not kept")
    script = ("import ctypes, sys; "
              "sys.exit({1: 0, 0: 0, -1: 3}.get(ctypes.CDLL(sys.argv[1]).fr_amx_probe(), 4))")
    try:
        done = subprocess.run([sys.executable, "-I", "-c", script, str(kernels.path)],
                              capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        raise Unavailable(f"its tiles could not be tried in a separate process ({exc})") from exc
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        raise Unavailable(f"its AMX tiles ended a probe process with {name}")
    if done.returncode == 3:
        raise Unavailable("its AMX tiles computed a probe product wrongly")
    if done.returncode != 0:
        raise Unavailable(f"its AMX tile probe failed (exit {done.returncode}: "
                          f"{done.stderr.decode(errors='replace').strip()[-200:]})")
