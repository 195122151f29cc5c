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
from typing import Sequence

from .errors import MethodUnavailable
from .methods import PEER_GROUPS, BenchContext, BenchMethod, MethodOutput, register_method


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
        self._model = None
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
            ctx.shared[key] = model.to(getattr(ctx.model.decoder, "device", "cpu"))
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

        device = getattr(ctx.model.decoder, "device", "cpu")
        x = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
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

# A child process decodes a 4-token batch: some llama.cpp builds crash (a
# segmentation fault, not an exception) in their repacked CPU kernels, e.g.
# AMX ones on virtual machines that don't enable AMX.
_PROBE = """
import sys
import llama_cpp
from llama_cpp import llama as _llama
if sys.argv[2] == "0":
    _orig = _llama.llama_cpp.llama_model_default_params
    def _params():
        p = _orig()
        p.use_extra_bufts = False
        return p
    _llama.llama_cpp.llama_model_default_params = _params
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, verbose=False)
llm.eval([1, 2, 3, 4])
"""

REPACK_ENV = "FORERUN_BENCH_LLAMA_CPP_REPACK"


def _probe_llama_cpp(path, repack: bool) -> tuple[bool, str]:
    import subprocess
    import sys

    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE, str(path), "1" if repack else "0"],
                              capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return False, "timed out"
    if proc.returncode == 0:
        return True, ""
    tail = (proc.stderr.strip().splitlines() or [""])[-1]
    return False, f"exit status {proc.returncode} {tail}".strip()


class LlamaCppMethod(BenchMethod):
    """llama-cpp-python on the GGUF file itself (quantized weights), with
    torch's thread count; a token loop over ``Llama.generate``.

    Before loading, a child process checks that this llama.cpp build can
    decode a batch on this machine; if it crashes, the weights are loaded
    without llama.cpp's extra (repacked) CPU buffers, which avoids the
    crashing kernels, and the report says so.  ``FORERUN_BENCH_LLAMA_CPP_REPACK``
    (``1`` or ``0``) skips the check and forces the choice.
    """

    engine = "llama.cpp"
    baseline = None
    peer = True
    description = "llama.cpp (llama-cpp-python) on the quantized GGUF"

    def __init__(self, name: str = "llamacpp-plain") -> None:
        self.name = name
        self._llm = None
        self.note = None

    def setup(self, ctx: BenchContext) -> None:
        import os

        llama_cpp = _require("llama_cpp", "llama-cpp-python", "--peer-llama-cpp")
        import torch

        path = ctx.source_file("model")
        if path.is_dir() or path.suffix.lower() != ".gguf":
            raise MethodUnavailable(f"llama.cpp needs a GGUF file; {path} is not one")
        key = "llama.cpp:model"
        if key not in ctx.shared:
            forced = os.environ.get(REPACK_ENV)
            if forced in ("0", "1"):
                repack = forced == "1"
            else:
                repack, why = _probe_llama_cpp(path, True)
                if not repack:
                    ok, why2 = _probe_llama_cpp(path, False)
                    if not ok:
                        raise MethodUnavailable(
                            f"llama.cpp crashes on this machine when decoding ({why}; without "
                            f"repacked weights: {why2})")
                    self.note = (f"llama.cpp's repacked CPU kernels crash on this machine "
                                 f"({why}); loaded with use_extra_bufts=False")
            threads = torch.get_num_threads()
            from llama_cpp import llama as llama_module

            original = llama_module.llama_cpp.llama_model_default_params
            if not repack:
                def params():
                    p = original()
                    p.use_extra_bufts = False
                    return p
                llama_module.llama_cpp.llama_model_default_params = params
            try:
                ctx.shared[key] = llama_cpp.Llama(
                    model_path=str(path), n_ctx=ctx.context_length, n_threads=threads,
                    n_threads_batch=threads, logits_all=False, verbose=False)
            finally:
                llama_module.llama_cpp.llama_model_default_params = original
            ctx.shared[key + ":note"] = self.note
        self._llm = ctx.shared[key]
        self.note = ctx.shared.get(key + ":note")

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
