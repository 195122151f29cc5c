"""Which parts of the torch engine's path give a row the same bits whatever
rows are computed beside it, on a device: what decides whether a verification
group can be exact there (forerun.protocol.grouping_probe).

    python benchmarks/row_invariance.py [--device cuda] [--windows 4] [--timing 20]

It checks, with random data: ``F.linear`` in bfloat16 and float32 at the
1.5B's shapes (rows 2..16 against each row alone), RMSNorm at hidden sizes
256 and 1,536, and attention of one query sliced from several against the
same query alone; then a tiny random Qwen2 model in bfloat16 and float32
(forerun's engine, built in the script, no weights needed): for each group
size 2..16, on how many of ``--windows`` token windows at 7 context lengths
its logits differ from one-position forwards.  On an NVIDIA H200 (torch
2.11) the bfloat16 engine differed on 1 to 10 of 28 windows, though every
``F.linear`` shape was row-invariant (results in
``benchmarks/results/2026-11-25-h200-verification-groups.txt``), which is
why the torch engine now runs every short forward off the CPU at
``PADDED_ROWS`` rows; the engine is checked both ways, padded (as it
runs) and unpadded.  ``--timing N`` times forwards of 1 to 16 positions of
a network of Qwen2.5-1.5B's shapes, padded and unpadded.  Needs ``transformers`` (to build the
tiny model) and the tests folder on the path, as the tests have it.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from harness import ROOT, interleaved, machine_line, median_ms, parser, timed

from forerun.engines.torch_engine import TorchDecoder
from forerun.engines.transformer import PADDED_ROWS, Transformer, rms_norm
from forerun.protocol.model_config import ModelConfig


def differing_rows(run, one, trials: int = 3) -> list[int]:
    """Row counts m in 2..16 whose rows ``run(x[:m])`` differ from
    ``one(x[i:i+1])``."""
    bad = set()
    for _ in range(trials):
        x = run.make()
        alone = torch.cat([one(x[i:i + 1]) for i in range(16)])
        bad |= {m for m in range(2, 17) if not torch.equal(run(x[:m]), alone[:m])}
    return sorted(bad)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--timing", type=int, default=0, metavar="REPEATS",
                   help="also time forwards of a network of the 1.5B's shapes, padded and not")
    args = p.parse_args()
    dev = args.device
    gen = torch.Generator().manual_seed(0)
    print(machine_line(f"device {dev}"))
    for dtype in (torch.bfloat16, torch.float32):
        for k, n in ((1536, 2048), (1536, 8960), (8960, 1536), (1536, 151936)):
            w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dev, dtype)

            def run(x, w=w):
                return F.linear(x, w)
            run.make = lambda k=k, dtype=dtype: torch.randn(16, k, generator=gen).to(dev, dtype)
            print(f"linear {dtype} {k}x{n}: rows differing {differing_rows(run, run)}")
    for h in (256, 1536):
        weight = torch.randn(h, generator=gen).to(dev)

        def norm(x, weight=weight):
            return rms_norm(x, weight, 1e-6)
        norm.make = lambda h=h: torch.randn(16, h, generator=gen).to(dev)
        print(f"rms_norm {h}: rows differing {differing_rows(norm, norm, trials=20)}")
    differ = 0
    for _ in range(20):
        qs = torch.randn(16, 4, 64, generator=gen).to(dev).transpose(0, 1)
        k = torch.randn(2, 64, 64, generator=gen).to(dev)
        v = torch.randn(2, 64, 64, generator=gen).to(dev)
        for i in range(16):
            a = F.scaled_dot_product_attention(qs[:, i:i + 1][None], k[:, :40][None],
                                               v[:, :40][None], enable_gqa=True)
            b = F.scaled_dot_product_attention(qs[:, i:i + 1].clone()[None], k[:, :40][None],
                                               v[:, :40][None], enable_gqa=True)
            differ += not torch.equal(a, b)
    print(f"attention, a query sliced from 16 against it alone: {differ} of 320 differ")

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import hf_model

    hf = hf_model("qwen2", seed=5, hidden_size=256, intermediate_size=768)
    config = ModelConfig.from_hf(hf.config.to_dict())
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    contexts = (8, 16, 24, 32, 64, 100, 160)
    for fmt, padded in (("bfloat16", True), ("float32", True), ("bfloat16", False),
                        ("float32", False)):
        network = Transformer(config, state, device=dev, weights_format=fmt)
        network.layer_ops = None              # torch's operators, as off the CPU
        network.padded_rows = PADDED_ROWS if padded else None
        d = TorchDecoder(network, 256, config.eos_token_ids)
        counts: dict[int, int] = {}
        tokens_gen = torch.Generator().manual_seed(1)
        for context in contexts:
            for _ in range(args.windows):
                toks = torch.randint(3, 250, (context + 16,), generator=tokens_gen).tolist()
                d.reset()
                d.feed(toks[:context], last_only=True)
                reference = torch.cat([d.feed([t]).logits for t in toks[context:]])
                for size in range(2, 17):
                    d.rollback(context)
                    if not torch.equal(d.feed(toks[context:context + size]).logits,
                                       reference[:size]):
                        counts[size] = counts.get(size, 0) + 1
        rows = f"padded to {network.padded_rows} rows" if network.padded_rows else "unpadded"
        print(f"engine {fmt}, {rows}: group sizes differing (of {len(contexts) * args.windows} "
              f"windows each): {dict(sorted(counts.items())) or 'none'}")
    if args.timing:
        step_times(dev, args.timing)


def step_times(dev: str, repeats: int) -> None:
    """ms per forward of T positions of a network of Qwen2.5-1.5B's shapes
    (random bfloat16 weights, 256 positions of context), padded to
    PADDED_ROWS rows and unpadded, alternating."""
    config = ModelConfig.from_hf({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536,
        "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
        "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True})
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes = {"model.embed_tokens.weight": (151936, 1536), "model.norm.weight": (1536,)}
    for n in range(28):
        p = f"model.layers.{n}."
        shapes.update({p + "input_layernorm.weight": (1536,),
                       p + "post_attention_layernorm.weight": (1536,),
                       p + "self_attn.q_proj.weight": (1536, 1536),
                       p + "self_attn.k_proj.weight": (256, 1536),
                       p + "self_attn.v_proj.weight": (256, 1536),
                       p + "self_attn.q_proj.bias": (1536,), p + "self_attn.k_proj.bias": (256,),
                       p + "self_attn.v_proj.bias": (256,),
                       p + "self_attn.o_proj.weight": (1536, 1536),
                       p + "mlp.gate_proj.weight": (8960, 1536),
                       p + "mlp.up_proj.weight": (8960, 1536),
                       p + "mlp.down_proj.weight": (1536, 8960)})
    state = {name: torch.randn(shape, generator=gen, device=dev, dtype=torch.bfloat16) * 0.02
             for name, shape in shapes.items()}
    network = Transformer(config, state, device=dev, weights_format="bfloat16")
    network.layer_ops = None
    del state
    decoder = TorchDecoder(network, 512)
    decoder.feed(list(range(1000, 1256)), last_only=True)
    base = decoder.length
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)

    def forward(t: int, padded: bool) -> float:
        network.padded_rows = PADDED_ROWS if padded else None
        decoder.rollback(base)
        sync()
        return timed(lambda: (decoder.feed(list(range(2000, 2000 + t))), sync()))

    spent = interleaved({(t, padded): (lambda t=t, padded=padded: forward(t, padded))
                         for t in (1, 2, 4, 8, 16) for padded in (True, False)}, repeats)
    decoder.rollback(base)
    print(f"1.5B-shaped network, bfloat16, random weights, 256 positions of context, "
          f"median of {repeats} forwards, ms (padded to {PADDED_ROWS} rows / unpadded):")
    for t in (1, 2, 4, 8, 16):
        a, b = median_ms(spent[(t, True)]), median_ms(spent[(t, False)])
        print(f"  T={t:>2}: {a:7.2f} / {b:7.2f}")


if __name__ == "__main__":
    main()
