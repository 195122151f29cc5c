"""``forerun export eagle3 HEAD DIR``: write an EAGLE-3 head in the layout
vLLM, SGLang and llama.cpp's converter load (``docs/eagle3-files.md``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from forerun.cli.exits import signals_deferred
from forerun.errors import ForerunError, ModelNotFoundError
from forerun.loading.presets import DEFAULT_MODEL

#: The HEAD that names the default preset's shipped head.
SHIPPED = "eagle"


def add_parser(sub) -> None:
    export = sub.add_parser("export", help="write a draft head in a format other engines load")
    esub = export.add_subparsers(dest="export_command", required=True)
    eagle3 = esub.add_parser(
        "eagle3", help="an EAGLE-3 head, as config.json + model.safetensors",
        description="Write an EAGLE-3 head as the folder vLLM (--speculative-config "
                    "'{\"method\": \"eagle3\", \"model\": DIR, ...}') and SGLang "
                    "(--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR) load, "
                    "and llama.cpp's convert_hf_to_gguf.py converts (with --target-model-dir). "
                    "See docs/eagle3-files.md.")
    eagle3.add_argument("head", metavar="HEAD",
                        help=f"a head's folder (forerun's, SpecForge's, EAGLE's or the "
                             f"speculators layout), or '{SHIPPED}' for the one forerun ships "
                             f"for the default preset")
    eagle3.add_argument("out", metavar="DIR", help="the folder to write (made if missing)")
    eagle3.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                        default="bfloat16",
                        help="the weights' dtype (default bfloat16, as published heads; "
                             "float32 keeps forerun's weights bit for bit)")
    eagle3.add_argument("--force", action="store_true",
                        help="replace a config.json or model.safetensors in DIR that forerun "
                             "did not write (by default they are kept and the export refused)")
    eagle3.add_argument("--target-layers", type=int, default=None, metavar="L",
                        help="the target's layer count, for a head whose config names no aux "
                             "layers (vLLM's default (2, L//2, L-3) is then written)")


def run(args: argparse.Namespace) -> int:
    with signals_deferred():
        import torch  # noqa: F401  (the long import; a signal in it is held)
    return cmd_eagle3(args)


def cmd_eagle3(args: argparse.Namespace) -> int:
    from forerun.drafters.eagle.files import load_eagle3, save_eagle3

    if args.target_layers is not None and args.target_layers < 1:
        raise ForerunError("--target-layers must be >= 1")
    if not str(args.out).strip():
        raise ForerunError("DIR is empty; give a folder for the export (an empty path would "
                           "write into the current folder)")
    head = resolve_head(args.head)
    out = Path(args.out).expanduser()
    if out.exists() and head.resolve() in (out.resolve(), out.resolve() / "model.safetensors"):
        raise ForerunError(f"DIR {out} is the head itself; write the export to another folder")
    weights = load_eagle3(head, target_layers=args.target_layers)
    save_eagle3(weights, out, dtype=args.dtype, force=args.force)
    c = weights.config
    sys.stdout.write(
        f"wrote {out / 'config.json'} and {out / 'model.safetensors'} ({args.dtype})\n"
        f"EAGLE-3 head: hidden {c.hidden_size}, {c.num_heads} heads ({c.num_kv_heads} KV), "
        f"draft vocabulary {c.draft_vocab_size} of {c.vocab_size}, aux layers "
        f"{list(c.aux_layers)} (vLLM's numbering)\n")
    target = weights.info.get("target_model") or weights.info.get("base_model")
    if target:
        sys.stdout.write(f"trained for: {target}\n")
    return 0


def resolve_head(value: str) -> Path:
    """HEAD as a path: ``eagle`` is the default preset's shipped head."""
    if value == SHIPPED:
        from forerun.drafters.eagle.files import shipped_head_path

        path = shipped_head_path(DEFAULT_MODEL)
        if path is None:
            raise ForerunError(f"no EAGLE-3 head ships for this preset yet ({DEFAULT_MODEL}); "
                               f"give the folder of a head instead")
        return path
    path = Path(value).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"HEAD {value} is neither '{SHIPPED}' nor an existing folder")
    return path
