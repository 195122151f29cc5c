"""Other engines side by side with forerun: transformers and llama.cpp.

Each peer runs the same prompt token ids.  Its speedup is measured against
forerun's plain decoding in the same run; its own plain decoding is a row
too.  A peer generates exactly as many new tokens as forerun's plain
decoding did on the same turn, ignoring end-of-sequence tokens, so both do
the same work.  Its greedy tokens are not required to equal forerun's
(different numerics: llama.cpp even runs the quantized weights), but how
many of them match is reported.

Packages are imported in ``setup``: a missing one skips the peer with a
message, it doesn't stop the run.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from forerun.bench.errors import MethodUnavailable
from forerun.bench.method import BenchContext, BenchMethod, MethodOutput
from forerun.bench.registry import PEER_GROUPS, register_method


def _require(module: str, package: str, flag: str):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MethodUnavailable(
            f"{package} is not installed ({exc}); {flag} needs it: pip install {package}"
        ) from None


# -- transformers --------------------------------------------------------------

class TransformersMethod(BenchMethod):
    """``transformers`` ``generate`` on the same dequantized float32 weights
    (loaded from the model's GGUF with ``gguf_file=``, or its folder)."""

    engine = "transformers"
    peer = True

    def __init__(self, name: str, mode: str) -> None:
        self.name = name
        self.mode = mode   # "plain", "assisted" or "lookup"
        self.baseline = None if mode == "plain" else "hf-plain"
        self.description = {
            "plain": "transformers generate",
            "assisted": "transformers assisted generation (assistant_model = the draft)",
            "lookup": "transformers prompt lookup (prompt_lookup_num_tokens=10)"}[mode]
        self._model: Any = None   # a transformers model once set up
        self._extra: dict = {}

    @staticmethod
    def _load(ctx: BenchContext, which: str):
        key = f"transformers:{which}"
        if key not in ctx.shared:
            torch = importlib.import_module("torch")
            transformers = _require("transformers", "transformers", "--peer-transformers")
            transformers.logging.set_verbosity_error()
            if not ctx.progress:
                transformers.logging.disable_progress_bar()
            path = ctx.source_file(which)
            if path.is_dir():
                args, kwargs = (str(path),), {}
            else:
                args, kwargs = (str(path.parent),), {"gguf_file": path.name}
            model = transformers.AutoModelForCausalLM.from_pretrained(
                *args, dtype=torch.float32, **kwargs).eval()
            ctx.shared[key] = model.to(ctx.model.decoder.device)
        return ctx.shared[key]

    def setup(self, ctx: BenchContext) -> None:
        _require("transformers", "transformers", "--peer-transformers")
        self._model = self._load(ctx, "model")
        if self.mode == "assisted":
            if ctx.draft_source is None:
                raise MethodUnavailable("hf-assisted needs a draft: pass --draft PRESET|PATH")
            self._extra = {"assistant_model": self._load(ctx, "draft")}
        elif self.mode == "lookup":
            self._extra = {"prompt_lookup_num_tokens": 10}

    def generate(self, ctx: BenchContext, prompt_ids: Sequence[int], *, max_new_tokens: int,
                 temperature: float, seed: int) -> MethodOutput:
        import torch

        device = ctx.model.decoder.device
        x = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
        sampling: dict[str, object]
        if temperature > 0:
            torch.manual_seed(seed)
            sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        else:
            sampling = dict(do_sample=False, temperature=None, top_k=None, top_p=None)
        with torch.inference_mode():
            # eos_token_id=None: exactly max_new_tokens tokens, like the
            # other rows (forerun's plain decoding set the count).
            out = self._model.generate(x, attention_mask=torch.ones_like(x),
                                       max_new_tokens=max_new_tokens, eos_token_id=None,
                                       pad_token_id=0, repetition_penalty=1.0,
                                       **sampling, **self._extra)
        return MethodOutput(out[0, len(prompt_ids):].tolist())

    def close(self) -> None:
        self._model = None
        self._extra = {}


# -- llama.cpp -----------------------------------------------------------------

def _llama_flash_enabled() -> int:
    import llama_cpp

    return llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED


class LlamaCppMethod(BenchMethod):
    """llama-cpp-python on the GGUF file itself (quantized weights), a token
    loop over ``Llama.generate``.

    It is set up exactly like forerun's llama.cpp engine
    (:func:`~forerun.bench.llama_cpp_reference.reference_llama`): the same
    threads, micro-batch size, flash attention and weight buffers, so that
    with ``--engine llama.cpp`` the two rows differ only by forerun's
    protocol and decoding loop.  When the run's model is on the torch engine,
    the engine's defaults are used.
    """

    engine = "llama.cpp"
    baseline = None
    peer = True
    description = "llama.cpp (llama-cpp-python) on the quantized GGUF"

    def __init__(self, name: str = "llamacpp-plain") -> None:
        self.name = name
        self._llm: Any = None   # a llama_cpp.Llama once set up
        self.note = None

    def setup(self, ctx: BenchContext) -> None:
        _require("llama_cpp", "llama-cpp-python", "--peer-llama-cpp")
        from forerun.bench.llama_cpp_reference import reference_llama
        from forerun.engines.llama_cpp_engine import CACHE_TYPES

        path = ctx.source_file("model")
        if path.is_dir() or path.suffix.lower() != ".gguf":
            raise MethodUnavailable(f"llama.cpp needs a GGUF file; {path} is not one")
        key = "llama.cpp:model"
        if key not in ctx.shared:
            decoder = ctx.model.decoder
            # The engine's settings when the model runs on llama.cpp, else
            # llama.cpp's defaults as the engine would pick them.
            options = dict(decoder.settings.extra) if decoder.engine == "llama.cpp" else {}
            settings = {k: options[k] for k in ("n_threads", "n_batch", "n_ubatch", "flash_attn",
                                                "cache_type_k", "cache_type_v")
                        if k in options}
            extra = options.get("extra_buffers")
            ctx.shared[key] = reference_llama(path, context_length=ctx.context_length,
                                              extra_buffers=extra, **settings)
        self._llm = ctx.shared[key]
        llm = self._llm
        params = llm.context_params
        flash = params.flash_attn_type == _llama_flash_enabled()
        names = {v: k for k, v in CACHE_TYPES.items()}
        self.note = (f"llama-cpp-python set up like forerun's llama.cpp engine: "
                     f"n_ubatch={params.n_ubatch}, flash attention {'on' if flash else 'off'}, "
                     f"{names.get(params.type_k, params.type_k)} keys, "
                     f"{names.get(params.type_v, params.type_v)} values, "
                     f"{params.n_threads} threads")

    def generate(self, ctx: BenchContext, prompt_ids: Sequence[int], *, max_new_tokens: int,
                 temperature: float, seed: int) -> MethodOutput:
        llm = self._llm
        llm.reset()          # no reuse of an earlier prompt's cache: every row prefills
        llm.set_seed(seed)
        greedy = temperature <= 0
        tokens: list[int] = []
        gen = llm.generate(list(prompt_ids), top_k=1 if greedy else 0, top_p=1.0, min_p=0.0,
                           typical_p=1.0, temp=0.0 if greedy else temperature,
                           repeat_penalty=1.0, reset=True)
        try:
            # Llama.generate does not stop at EOS itself: exactly
            # max_new_tokens tokens.
            for token in gen:
                tokens.append(int(token))
                if len(tokens) >= max_new_tokens:
                    break
        finally:
            gen.close()
        return MethodOutput(tokens)

    def close(self) -> None:
        self._llm = None


register_method("hf-plain", lambda: TransformersMethod("hf-plain", "plain"),
                "transformers generate (peer; --peer-transformers)")
register_method("hf-assisted", lambda: TransformersMethod("hf-assisted", "assisted"),
                "transformers assisted generation with the draft (peer; --peer-transformers)")
register_method("hf-lookup", lambda: TransformersMethod("hf-lookup", "lookup"),
                "transformers prompt lookup, 10 tokens (peer; --peer-transformers)")
register_method("llamacpp-plain", LlamaCppMethod,
                "llama.cpp decoding of the GGUF (peer; --peer-llama-cpp)")
PEER_GROUPS["transformers"] = ("hf-plain", "hf-assisted", "hf-lookup")
PEER_GROUPS["llama.cpp"] = ("llamacpp-plain",)
