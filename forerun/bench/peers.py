"""Other engines side by side with forerun: transformers and llama.cpp.

The peers run as their users run them (llama-cpp-python with its own
defaults; the row set up like forerun's llama.cpp engine is a method of
its own), and each loads its model in ``setup``, before anything is timed.
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
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from forerun.bench.errors import BenchError, MethodUnavailable
from forerun.bench.method import BenchContext, BenchMethod, MethodOutput
from forerun.bench.registry import ENGINE_PEERS, PEER_GROUPS, register_method, register_pattern
from forerun.protocol.token_sequences import common_prefix


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

# llama-cpp-python's README on LlamaPromptLookupDecoding's num_pred_tokens:
# "10 is the default and generally good for gpu, 2 performs better for
# cpu-only machines".  The peer runs on the CPU (n_gpu_layers=0, its default).
LOOKUP_TOKENS = 2
LOOKUP_DEFAULT_TOKENS = 10


class LlamaCppMethod(BenchMethod):
    """llama-cpp-python on the GGUF file itself (quantized weights), a token
    loop over ``Llama.generate``, set up one of three ways (``setup``):

    * ``stock``: as it comes (:func:`~forerun.bench.llama_cpp_reference.stock_llama`),
      what its users get: ``llamacpp-plain``;
    * ``lookup``: the same with llama-cpp-python's own prompt-lookup decoding
      (``LlamaPromptLookupDecoding`` as ``draft_model``), a speculative peer
      whose baseline is ``llamacpp-plain``: ``llamacpp-lookup[-kN]``;
    * ``matched``: set up like forerun's llama.cpp engine
      (:func:`~forerun.bench.llama_cpp_reference.reference_llama`: threads,
      micro-batch, flash attention, q8_0 values, weight buffers), so that
      with ``--engine llama.cpp`` it differs from forerun's plain row only
      by forerun's protocol and decoding loop: ``llamacpp-matched``.

    Each loads its own ``Llama`` in ``setup`` (and runs one token through
    it, so that reading the memory-mapped weights falls there too, not in
    a timed row) and frees it in ``close``.
    """

    engine = "llama.cpp"
    peer = True

    def __init__(self, name: str, mode: str, lookup_tokens: int = LOOKUP_TOKENS) -> None:
        self.name = name
        self.mode = mode   # "stock", "lookup" or "matched"
        self.lookup_tokens = lookup_tokens
        self.baseline = "llamacpp-plain" if mode == "lookup" else None
        self.description = {
            "stock": "llama.cpp (llama-cpp-python with its defaults) on the quantized GGUF",
            "lookup": f"llama.cpp's prompt lookup (llama-cpp-python's "
                      f"LlamaPromptLookupDecoding, num_pred_tokens={lookup_tokens})",
            "matched": "llama.cpp (llama-cpp-python) set up like forerun's llama.cpp engine",
        }[mode]
        self._llm: Any = None        # a llama_cpp.Llama once set up
        # The prompt before_turn left in the cache (None: it was not called).
        self._cached: list[int] | None = None
        self._drafts: _RecordedDrafts | None = None
        self._setup_note: str | None = None
        self.note = None

    def setup(self, ctx: BenchContext) -> None:
        _require("llama_cpp", "llama-cpp-python", "--peer-llama-cpp")
        from forerun.bench.llama_cpp_reference import llama_settings, machine_cores
        from forerun.engines.llama_cpp_engine import cpu_has_amx

        path = ctx.source_file("model")
        if path.is_dir() or path.suffix.lower() != ".gguf":
            raise MethodUnavailable(f"llama.cpp needs a GGUF file; {path} is not one")
        self._llm = self._load(ctx, path)
        self._llm.eval([0])   # the first forward reads the weights: not in a timed row
        self._llm.reset()
        settings = llama_settings(self._llm)
        if self.mode == "matched":
            self.note = f"llama-cpp-python set up like forerun's llama.cpp engine: {settings}"
        else:
            self.note = (f"llama-cpp-python with its defaults, given only n_ctx (the run's), "
                         f"n_threads and n_threads_batch (this machine's {machine_cores()} "
                         f"cores; its own default n_threads is half of them) and "
                         f"verbose=False: {settings}")
            if cpu_has_amx():
                self.note += ("; extra weight buffers off, unlike its default: this CPU "
                              "advertises AMX, whose llama.cpp kernels crash in virtual "
                              "machines that do not allow it")
        if self.mode == "lookup":
            advice = (f"its README's advice for CPU-only machines; its default is "
                      f"{LOOKUP_DEFAULT_TOKENS}: llamacpp-lookup-k{LOOKUP_DEFAULT_TOKENS}"
                      if self.lookup_tokens == LOOKUP_TOKENS
                      else f"its default is {LOOKUP_DEFAULT_TOKENS}")
            self.note += (f"; draft_model=LlamaPromptLookupDecoding(max_ngram_size=2, "
                          f"num_pred_tokens={self.lookup_tokens}) ({advice}) and "
                          f"logits_all=True (without it llama-cpp-python fails once prompt and "
                          f"answer pass n_batch positions; with a draft model it computes every "
                          f"position's logits either way)")
        self._setup_note = self.note

    def _load(self, ctx: BenchContext, path: Path) -> Any:
        from forerun.bench.llama_cpp_reference import reference_llama, stock_llama

        if self.mode == "matched":
            decoder = ctx.model.decoder
            # The engine's settings when the model runs on llama.cpp, else
            # llama.cpp's defaults as the engine would pick them.
            options = dict(decoder.settings.extra) if decoder.engine == "llama.cpp" else {}
            settings = {k: options[k] for k in ("n_threads", "n_batch", "n_ubatch", "flash_attn",
                                                "cache_type_k", "cache_type_v")
                        if k in options}
            return reference_llama(path, context_length=ctx.context_length,
                                   extra_buffers=options.get("extra_buffers"), **settings)
        if self.mode == "lookup":
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            self._drafts = _RecordedDrafts(
                LlamaPromptLookupDecoding(num_pred_tokens=self.lookup_tokens),
                ctx.context_length)
        return stock_llama(path, context_length=ctx.context_length,
                           draft_model=self._drafts)

    def before_turn(self, ctx: BenchContext, previous_prompt_ids: Sequence[int] | None) -> None:
        """A prompt's first turn starts from an empty cache; a later turn
        from the previous turn's prompt in the cache (evaluated here,
        untimed), which ``Llama.generate`` reuses as far as the new prompt
        agrees with it: llama-cpp-python's own prefix matching, what a chat
        with it gets."""
        self._llm.reset()
        self._cached = list(previous_prompt_ids or ())
        if self._cached:
            self._llm.eval(self._cached)

    def generate(self, ctx: BenchContext, prompt_ids: Sequence[int], *, max_new_tokens: int,
                 temperature: float, seed: int) -> MethodOutput:
        """From the cache :meth:`before_turn` left, or an empty one when it
        was not called since the last generation (the warm-up)."""
        llm = self._llm
        if self._cached is None:
            llm.reset()
            self._cached = []
        # What Llama.generate reuses: the cached prompt's common prefix with
        # this one, less one position when that is all of it (its logits
        # are computed again).
        reused = max(0, min(common_prefix(self._cached, prompt_ids), len(prompt_ids) - 1))
        self._cached = None
        llm.set_seed(seed)
        if self._drafts is not None:
            self._drafts.proposals.clear()
        greedy = temperature <= 0
        tokens: list[int] = []
        proposed_before: list[int] = []   # per token: how many drafts came before it
        gen = llm.generate(list(prompt_ids), top_k=1 if greedy else 0, top_p=1.0, min_p=0.0,
                           typical_p=1.0, temp=0.0 if greedy else temperature,
                           repeat_penalty=1.0, reset=True)
        try:
            # Llama.generate does not stop at EOS itself: exactly
            # max_new_tokens tokens.
            for token in gen:
                tokens.append(int(token))
                if self._drafts is not None:
                    proposed_before.append(len(self._drafts.proposals))
                if len(tokens) >= max_new_tokens:
                    break
        finally:
            gen.close()
        stats: dict[str, int] = {"reused_prompt_tokens": reused}
        if self._drafts is not None:
            stats.update(self._drafts.count(tokens, proposed_before))
        return MethodOutput(tokens, stats=stats)

    def conclude(self, rows: Sequence[dict[str, Any]]) -> None:
        """Prompt lookup, greedy: how many prompts and tokens equal
        ``llamacpp-plain``'s (llama.cpp's batched verification need not
        compute exactly the logits of its one-token steps)."""
        checked = [r for r in rows if r.get("mismatch") is not None]
        if self.mode != "lookup" or not checked:
            return
        same = sum(not r["mismatch"] for r in checked)
        total = sum(r["new_tokens"] for r in checked)
        matching = sum(_tokens_before_difference(r) for r in checked)
        share = f" ({matching / total:.0%} of tokens before the first difference)" \
            if same < len(checked) and total else ""
        self.note = (f"{self._setup_note}; greedy: the tokens of llamacpp-plain on {same} of "
                     f"{len(checked)} prompts{share}")

    def close(self) -> None:
        if self._llm is not None:
            self._llm.close()
        self._llm = None
        self._drafts = None


class _RecordedDrafts:
    """A llama-cpp-python draft model that records what the one it wraps
    proposes, as ``Llama.generate`` verifies it (cut where the context
    ends), so that rounds, drafted and accepted tokens can be counted:
    llama-cpp-python counts none of them."""

    def __init__(self, drafter: Any, context_length: int) -> None:
        self.drafter = drafter
        self.context_length = context_length
        self.proposals: list[list[int]] = []

    def __call__(self, input_ids: Any, /, **kwargs: Any) -> Any:
        drafted = self.drafter(input_ids, **kwargs)
        room = max(0, self.context_length - len(input_ids))
        self.proposals.append([int(t) for t in drafted[:room]])
        return drafted

    def count(self, tokens: Sequence[int], proposed_before: Sequence[int]) -> dict[str, int]:
        """``rounds``, ``drafted`` and ``accepted`` of one generation:
        ``proposed_before[i]``, how many proposals came before token ``i``.
        ``Llama.generate`` drafts before each round (the first token comes
        from the prompt's forward), so the tokens after the ``n``-th
        proposal are that round's: its accepted draft tokens (those equal
        to the proposal's, up to the first that is not) and the model's own
        next token."""
        by_round: dict[int, list[int]] = {}
        for token, n in zip(tokens, proposed_before):
            by_round.setdefault(n, []).append(token)
        rounds = drafted = accepted = 0
        for n, committed in by_round.items():
            if n == 0:
                continue   # the prompt's forward: no round
            proposal = self.proposals[n - 1]
            rounds += 1    # as in forerun's stats, an empty proposal's round counts too
            drafted += len(proposal)
            accepted += common_prefix(committed, proposal)
        return {"rounds": rounds, "drafted": drafted, "accepted": accepted}


def _tokens_before_difference(row: dict[str, Any]) -> int:
    """A greedy row's tokens before its first difference from its baseline
    (all of them when it has none)."""
    if not row["mismatch"]:
        return row["new_tokens"]
    first = row["first_mismatch"]
    return sum(t["new_tokens"] for t in row["turns"][:first["turn"] - 1]) + first["position"]


def _llama_lookup_k(match: re.Match) -> BenchMethod:
    k = int(match.group(1))
    if not 1 <= k <= 64:
        raise BenchError(f"{match.group(0)}: num_pred_tokens must lie in 1..64")
    return LlamaCppMethod(match.group(0), "lookup", lookup_tokens=k)


register_method("hf-plain", lambda: TransformersMethod("hf-plain", "plain"),
                "transformers generate (peer; --peer-transformers)")
register_method("hf-assisted", lambda: TransformersMethod("hf-assisted", "assisted"),
                "transformers assisted generation with the draft (peer; --peer-transformers)")
register_method("hf-lookup", lambda: TransformersMethod("hf-lookup", "lookup"),
                "transformers prompt lookup, 10 tokens (peer; --peer-transformers)")
register_method("llamacpp-plain", lambda: LlamaCppMethod("llamacpp-plain", "stock"),
                "llama-cpp-python with its own defaults on the GGUF, threads = the machine's "
                "cores (peer; --peer-llama-cpp)")
register_method("llamacpp-lookup", lambda: LlamaCppMethod("llamacpp-lookup", "lookup"),
                f"llama-cpp-python's prompt lookup decoding, num_pred_tokens={LOOKUP_TOKENS}, "
                f"otherwise as llamacpp-plain (peer; --peer-llama-cpp)")
register_pattern(r"llamacpp-lookup-k(\d+)", _llama_lookup_k, "llamacpp-lookup-kN",
                 "llama-cpp-python's prompt lookup decoding with num_pred_tokens=N (peer)")
register_method("llamacpp-matched", lambda: LlamaCppMethod("llamacpp-matched", "matched"),
                "llama-cpp-python set up like forerun's llama.cpp engine (peer; "
                "--peer-llama-cpp adds it when forerun runs on --engine llama.cpp)")
PEER_GROUPS["transformers"] = ("hf-plain", "hf-assisted", "hf-lookup")
PEER_GROUPS["llama.cpp"] = ("llamacpp-plain", "llamacpp-lookup")
ENGINE_PEERS["llama.cpp"] = ("llamacpp-matched",)
