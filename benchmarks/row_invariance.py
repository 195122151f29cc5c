"""Which parts of the torch engine's path give a row the same bits whatever
rows are computed beside it, on a device: what decides whether a verification
group can be exact there (forerun.engines.grouping_probe).

    python benchmarks/row_invariance.py [--device cuda] [--windows 4]

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
why the torch engine promises no grouping off the CPU
(``TorchDecoder.group_ceiling``).  Needs ``transformers`` (to build the
tiny model) and the tests folder on the path, as the tests have it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from forerun.config import ModelConfig  # noqa: E402
from forerun.engines.torch_engine import TorchDecoder  # noqa: E402
from forerun.engines.transformer import Transformer, rms_norm  # noqa: E402


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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--windows", type=int, default=4)
    args = p.parse_args()
    dev = args.device
    gen = torch.Generator().manual_seed(0)
    print(f"device {dev}, torch {torch.__version__}")
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

    from tiny_models import hf_model

    hf = hf_model("qwen2", seed=5, hidden_size=256, intermediate_size=768)
    config = ModelConfig.from_hf(hf.config.to_dict())
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    contexts = (8, 16, 24, 32, 64, 100, 160)
    for fmt in ("bfloat16", "float32"):
        d = TorchDecoder(Transformer(config, state, device=dev, weights_format=fmt), 256,
                         config.eos_token_ids)
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
        print(f"engine {fmt}: group sizes differing (of {len(contexts) * args.windows} "
              f"windows each): {dict(sorted(counts.items())) or 'none'}")


if __name__ == "__main__":
    main()
