"""The Python API: load a model, generate text, stream it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from forerun.errors import ConfigError, GenerationConfigError, NonFiniteLogitsError
from forerun.generation.exclusive import GenerationLock, Holds
from forerun.generation.params import GenerationParams
from forerun.generation.result import GenerationResult
from forerun.generation.runner import check_request, run_generation, token_ids
from forerun.api.load_arguments import check_load_arguments, memory_error, parse_device, resolve_device
from forerun.decoding.sampling import SamplingParams

DEFAULT_CONTEXT_LENGTH = 4096
ENGINES = ("torch", "llama.cpp")
# Other spellings of the llama.cpp engine that load() accepts.
_ENGINE_ALIASES = {"llamacpp": "llama.cpp", "llama_cpp": "llama.cpp", "llama-cpp": "llama.cpp"}

# Chat end-of-turn tokens that end generation besides the model's EOS: the
# chat templates of the supported families close each turn with one of them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")

# Real text for the grouping probe: prose and code, as prompts hold.
PROBE_TEXT = (
    "Speculative decoding lets a small model propose several tokens that the large "
    "model checks in one forward pass. def binary_search(items, target):\n"
    "    lo, hi = 0, len(items) - 1\n    while lo <= hi:\n        mid = (lo + hi) // 2\n"
    "        if items[mid] == target:\n            return mid\n"
    "        if items[mid] < target:\n            lo = mid + 1\n        else:\n"
    "            hi = mid - 1\n    return -1\n"
    "The committee met on Tuesday to review the budget, and agreed to fund the new "
    "library, the repairs to the bridge, and three scholarships for local students. ")


class Model:
    """A loaded model: tokenizer, configuration and a decoder engine.

    Build one with :func:`load`.

    One generation at a time: a generation holds the model (its cache, its
    decoding methods, and the draft models it uses) from its first token
    until it ends; a stream holds it from its first ``next()`` until it is
    exhausted, closed (``stream.close()``, or leaving a ``with`` block) or
    garbage-collected.  A generation started meanwhile in **another
    thread** waits until the model is free, so threads may share a model
    and get exactly their serial outputs.  One started in the **same
    thread** (a second stream while the first is still open) raises
    :class:`~forerun.errors.ModelBusyError` instead of waiting for itself.
    A closed or collected stream never touches the model again.
    """

    def __init__(self, name: str, decoder, tokenizer, config, *,
                 source: str | None = None) -> None:
        self.name = name
        #: the model file or folder, named in errors about its output
        self.source = source or name
        self._lock = GenerationLock(name)
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.config = config
        eos = set(decoder.eos_token_ids)
        for text in END_OF_TURN_TOKENS:
            tid = tokenizer.token_to_id(text)
            if tid is not None and tid in tokenizer.special_token_ids:
                eos.add(tid)
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos))
        self._methods: dict = {}
        self.drafts: list[Model] = []
        self._grouping = None

    def __repr__(self) -> str:
        return (f"Model({self.name!r}, {self.config.architecture}, "
                f"{self.config.num_layers} layers, context {self.decoder.context_length})")

    # -- prompts -----------------------------------------------------------
    def encode_prompt(self, prompt: str | None = None, *,
                      messages: Sequence[dict[str, Any]] | None = None,
                      prompt_ids: Sequence[int] | None = None) -> list[int]:
        """Token ids for exactly one of: raw text ``prompt`` (BOS added when
        the model asks for it), chat ``messages`` (rendered with the model's
        chat template plus the assistant prompt), or ``prompt_ids``."""
        given = [x is not None for x in (prompt, messages, prompt_ids)]
        if sum(given) != 1:
            raise GenerationConfigError(
                "give exactly one of prompt (raw text), messages (chat) or prompt_ids")
        if prompt_ids is not None:
            return token_ids(prompt_ids, self.decoder.vocab_size)
        if messages is not None:
            if isinstance(messages, (str, bytes, dict)) or not isinstance(messages,
                                                                          Sequence):
                raise GenerationConfigError(
                    f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got "
                    f"{type(messages).__name__}")
            text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
            return self.tokenizer.encode(_valid_text(text, "messages"),
                                         add_special_tokens=False)
        if not isinstance(prompt, str):
            raise GenerationConfigError(f"prompt must be a string, got {type(prompt).__name__}")
        return self.tokenizer.encode(_valid_text(prompt, "prompt"), add_special_tokens=True)

    # -- generation --------------------------------------------------------
    def stream(self, prompt: str | None = None, *, messages=None, prompt_ids=None,
               max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
               stop: Sequence[str] | str = (), stop_token_ids: Sequence[int] = (),
               ignore_eos: bool = False, cancel=None, draft=None,
               draft_k: int | None = None, draft_async: bool = False,
               draft_threads: int | None = None, target_threads: int | None = None,
               draft_tree: bool = False, tree_nodes: int | None = None,
               draft_lookup: bool | None = None) -> "GenerationStream":
        """Like :meth:`generate`, but returns an iterator of text deltas; its
        ``result`` attribute holds the :class:`GenerationResult` once the
        iteration has ended.

        Every argument is checked here, before anything runs.  The stream
        holds the model from its first ``next()`` until it ends or is
        closed (see :class:`Model`); close a stream you don't finish, or use
        it in a ``with`` block."""
        ids = self.encode_prompt(prompt, messages=messages, prompt_ids=prompt_ids)
        if isinstance(stop, str):
            stop = (stop,)
        params = GenerationParams(
            max_new_tokens=max_new_tokens,
            sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                    min_p=min_p),
            seed=seed, stop=_tuple_of(stop, "stop"),
            stop_token_ids=tuple(token_ids(
                sorted(stop_token_ids) if isinstance(stop_token_ids, (set, frozenset))
                else stop_token_ids, self.decoder.vocab_size, "stop_token_ids")),
            ignore_eos=ignore_eos)
        ids = check_request(self.decoder, ids, params, cancel)
        if draft_k is not None and (not isinstance(draft_k, int) or isinstance(draft_k, bool)
                                    or draft_k < 1):
            raise GenerationConfigError(f"draft_k must be a positive integer (or None to "
                                        f"choose it every round), got {draft_k!r}")
        split = async_split(draft, draft_async, draft_threads, target_threads)
        tree = tree_options(draft, draft_k, draft_tree, tree_nodes, split)
        lookup = lookup_option(draft, draft_lookup, draft_k, tree, split)
        method, drafts = self._method(draft, draft_k, split, tree, lookup)
        return GenerationStream(self._run(method, drafts, ids, params, cancel))

    def _run(self, method, drafts: list["Model"], ids: list[int], params: GenerationParams,
             cancel):
        """The generation, holding this model and its draft models."""
        with Holds([self._lock] + [d._lock for d in drafts]):
            try:
                return (yield from run_generation(
                    method, self.tokenizer, ids, params, eos_token_ids=self.eos_token_ids,
                    cancel=cancel))
            except NonFiniteLogitsError as exc:
                raise NonFiniteLogitsError(f"{self.source}: {exc}") from None

    def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        """Generate a completion.

        Exactly one of ``prompt`` (raw text), ``messages`` (a chat: a list of
        ``{"role", "content"}`` dicts, rendered with the chat template) or
        ``prompt_ids``.  ``temperature=0`` is greedy decoding; ``top_k``,
        ``top_p`` and ``min_p`` filter the sampled distribution; ``seed`` fixes
        the random draws.  Generation ends at an end-of-sequence token, a
        ``stop_token_ids`` token, a ``stop`` string (cut from the text), after
        ``max_new_tokens``, or when ``cancel`` (a callable or Event) turns true.

        ``draft`` turns on speculative decoding (``None`` or ``"none"``: plain
        decoding; :mod:`forerun.drafters.registry`): a :class:`Model` (or a preset
        name or path, loaded once and kept) sharing this model's tokenizer,
        ``"ngram"`` for prompt lookup (no draft model), ``"medusa"`` for the
        Medusa heads forerun ships for this preset (``"medusa:PATH"`` for
        other heads; tree verification, ``draft_k`` fixes the tree's node
        count), or any
        :class:`~forerun.decoding.drafter.Drafter` object.
        ``draft_k`` fixes the draft length; by default it is chosen every
        round from measured costs.  The output is the same as without a
        draft: token for token when greedy, in distribution when sampling.

        ``draft_async=True`` runs a draft model in a thread of its own,
        drafting ahead while this model verifies
        (:mod:`forerun.drafters.async_speculative`), on ``draft_threads``
        CPU threads (default 1) while this model runs on ``target_threads``
        (default: its own count less the draft's, at least 1).  The output is
        the same as synchronous drafting's; the stats say whether it paid.

        ``draft_tree=True`` has a draft model draft a token tree by its own
        probabilities, verified in one forward with a tree attention mask
        (:mod:`forerun.drafters.draft_model_tree`; the torch engine); its node
        budget is chosen every round from measured costs, or fixed by
        ``tree_nodes`` (which also implies ``draft_tree``).  With Medusa
        heads, ``tree_nodes`` fixes the tree's node count.  ``draft_k``
        keeps meaning a chain of that length.

        A draft model drafts beside prompt lookup by default: each round
        drafts by looking the last tokens up in the prompt and the text so
        far, or with the draft model, whichever is expected to commit more
        tokens per second; the draft model then reads at most the first and
        last 256 tokens of a long prompt
        (:mod:`forerun.drafters.lookup_or_draft_planner`).  ``draft_lookup``:
        ``None`` (the default) for wherever it applies, a draft model
        drafting chains of a chosen length in this model's thread (no
        ``draft_k``, tree or ``draft_async``); ``True`` to insist on it (an
        error where it can't apply); ``False`` for the draft model alone.
        """
        stream = self.stream(prompt, **kwargs)
        for _ in stream:
            pass
        return stream.result

    def _method(self, draft=None, draft_k: int | None = None,
                split: tuple[int | None, int | None] | None = None,
                tree: int | bool = False, lookup: bool = False):
        """The decoding method for ``draft``, and the draft models it uses.
        ``split``: ``(draft_threads, target_threads)`` for asynchronous
        drafting, ``None`` for synchronous.  ``tree``: what
        :func:`tree_options` made of the tree arguments.  ``lookup``: prompt
        lookup beside the draft model (:func:`lookup_option`).  A new method is
        built holding this model (building may load a draft model and
        measure this one)."""
        from forerun.decoding.plain import PlainDecoding
        from forerun.drafters.registry import draft_kind

        if draft_kind(draft) == "none":
            if draft_k is not None:
                raise GenerationConfigError("draft_k needs a draft (draft=...)")
            return PlainDecoding(self.decoder), []
        key = (draft if isinstance(draft, str) else id(draft), draft_k, split, tree, lookup)
        built = self._methods.get(key)
        if built is None:
            with Holds([self._lock]):
                built = self._methods.get(key)
                if built is None:
                    known = len(self.drafts)
                    nodes = None if isinstance(tree, bool) else tree
                    if split is not None:
                        method = self._build_async(draft, draft_k, *split)
                    elif lookup:
                        method = self._build_lookup_or_draft(draft)
                    elif tree is not False and draft_kind(draft) == "model":
                        method = self._build_draft_tree(draft, nodes)
                    else:   # a chain, or Medusa's tree (nodes: its node count)
                        method = self._build_speculative(draft, nodes or draft_k)
                    built = self._methods[key] = (method, self.drafts[known:])
        return built

    def _build_async(self, draft, draft_k: int | None, draft_threads: int | None,
                     target_threads: int | None):
        """Speculative decoding with a draft model drafting in its own thread,
        on ``draft_threads`` (default 1) while this model runs on
        ``target_threads`` (default: its thread count less the draft's)."""
        from forerun.drafters.async_speculative import AsyncSpeculativeDecoding
        from forerun.drafters.async_draft import AsyncDraftModelDrafter

        asked = target_threads
        draft_threads = draft_threads or 1
        own = self.decoder.threads
        target_threads = target_threads or max(1, own - draft_threads)
        drafter = AsyncDraftModelDrafter(self._draft_decoder(draft), threads=draft_threads)
        group = self.verification_grouping().exact_group
        if target_threads != own:
            # Exact only where verifying on target_threads gives plain
            # decoding's logits on the model's own count: measured.
            probe = self._measured_grouping(target_threads)
            if probe.exact_group == 0 and asked is not None:
                raise ConfigError(
                    f"target_threads={asked}: on {target_threads} thread(s) this model's "
                    f"engine computes other logits than on its own {own} "
                    f"({probe.describe()}), so speculative decoding would not be "
                    f"token-identical to plain decoding; leave target_threads out (the "
                    f"model then keeps its {own} threads) or use another weight format")
            if probe.exact_group == 0:
                target_threads = own
            else:
                group = min(group, probe.exact_group)
        method = AsyncSpeculativeDecoding(self.decoder, drafter, k=draft_k,
                                          target_threads=target_threads, verify_group=group)
        method.cost_store = cost_store(self, f"+async-{draft_threads}+{target_threads}")
        method.reference_store = cost_store(self)
        method.measure_reference(self._probe_tokens(1)[0])
        return method

    def _build_draft_tree(self, draft, nodes: int | None):
        """A draft model drafting trees (EAGLE-2 style), ``nodes`` fixed or
        chosen every round."""
        from forerun.decoding.draft_tree_planner import DraftTreePlanner
        from forerun.decoding.speculative import SpeculativeDecoding
        from forerun.drafters.draft_model_tree import DraftModelTreeDrafter

        drafter = DraftModelTreeDrafter(self._draft_decoder(draft))
        self.verification_grouping()
        method = SpeculativeDecoding(self.decoder, planner=DraftTreePlanner(drafter,
                                                                            nodes=nodes))
        method.cost_store = cost_store(self, "+draft-tree")
        return method

    def _build_lookup_or_draft(self, draft):
        """Prompt lookup and a draft model, each round drafting with the one
        expected to pay more (:mod:`forerun.drafters.lookup_or_draft_planner`)."""
        from forerun.drafters.lookup_or_draft_planner import LOOKUP_DRAFT_WINDOW, LookupOrDraftPlanner
        from forerun.decoding.speculative import SpeculativeDecoding
        from forerun.drafters.draft_model import DraftModelDrafter

        model = DraftModelDrafter(self._draft_decoder(draft), window=LOOKUP_DRAFT_WINDOW)
        self.verification_grouping()
        method = SpeculativeDecoding(self.decoder, planner=LookupOrDraftPlanner(model))
        method.cost_store = cost_store(self)
        return method

    def _build_speculative(self, draft, draft_k: int | None):
        from forerun.decoding.speculative import SpeculativeDecoding
        from forerun.drafters.medusa import medusa_drafter
        from forerun.drafters.registry import chain_drafter, draft_kind

        if draft_kind(draft) == "medusa":
            # Medusa heads draft a tree; draft_k fixes its node count.
            from forerun.decoding.tree_speculative import TreeSpeculativeDecoding

            self.verification_grouping()
            method = TreeSpeculativeDecoding(self.decoder, medusa_drafter(self, draft),
                                             nodes=draft_k)
            method.cost_store = cost_store(self, "+tree")
            return method
        drafter = chain_drafter(draft, self._draft_decoder)
        self.verification_grouping()
        method = SpeculativeDecoding(self.decoder, drafter, k=draft_k)
        method.cost_store = cost_store(self)
        return method

    @property
    def identity(self) -> str:
        """The model as calibration records know it: its name and shape."""
        c = self.config
        return (f"{self.name}|{c.architecture}|{c.num_layers}x{c.hidden_size}|"
                f"{c.vocab_size}")

    def verification_grouping(self) -> "GroupingResult":
        """The largest group of positions this model's engine verifies
        exactly on this machine (measured once per machine and engine
        settings, then kept in forerun's cache), applied to the decoder:
        speculative decoding cuts its verifications into groups of at most
        that size, so it stays token-identical to plain decoding."""
        if self._grouping is None:
            result = self._measured_grouping()
            self.decoder.verify_group = result.exact_group
            self._grouping = result
        return self._grouping

    def _measured_grouping(self, threads: int | None = None) -> "GroupingResult":
        """The grouping probe's result for this model on this machine (kept
        in forerun's cache): for verifications on ``threads`` threads
        against plain decoding on the decoder's own count, when given."""
        from forerun.machine.calibration import CalibrationStore
        from forerun.protocol.grouping_probe import MAX_GROUP, GroupingResult, exact_group_size

        decoder = self.decoder
        contexts = self._probe_contexts()
        key = {"model": self.identity, **decoder.settings, "contexts": list(contexts)}
        if threads is not None:
            key["verified_on_threads"] = threads
        store = CalibrationStore("grouping", key, label=f"{self.name}-{decoder.engine}")
        largest = decoder.group_ceiling or MAX_GROUP
        return store.load_or_measure(
            GroupingResult.from_dict,
            lambda: exact_group_size(decoder, self._probe_tokens(max(contexts) + largest),
                                     contexts=contexts, threads=threads, max_group=largest),
            f"which verification groups {self.name} computes exactly", GroupingResult.to_dict)

    def _probe_contexts(self) -> tuple[int, ...]:
        """Cached lengths the grouping probe runs at: a short prompt, and the
        engine's long one (past the lengths where its kernels switch)."""
        room = self.decoder.context_length - 16
        return tuple(sorted({min(32, room), min(self.decoder.probe_context, room)}))

    def _probe_tokens(self, n: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < n:
            ids += self.tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
        return ids[:n]

    def _draft_decoder(self, draft):
        """The decoder a draft model (a Model, preset name or path) drafts
        with: its own, or a fork of this model's when it drafts for itself."""
        from forerun.drafters.registry import load_draft_model

        draft = load_draft_model(self, draft)
        if draft.decoder is self.decoder and not draft.decoder.capabilities.fork:
            raise ConfigError(f"{self.name} can't draft for itself: the {self.decoder.engine} "
                              f"engine can't give it a second cache (capabilities.fork)")
        self.drafts.append(draft)   # keep the draft model alive with its method
        # A model drafting for itself needs a cache of its own.
        return draft.decoder.fork() if draft.decoder is self.decoder else draft.decoder


def async_split(draft, draft_async, draft_threads, target_threads
                ) -> tuple[int | None, int | None] | None:
    """``(draft_threads, target_threads)`` for asynchronous drafting, ``None``
    for synchronous: the checked ``draft_async``, ``draft_threads`` and
    ``target_threads`` arguments of :meth:`Model.stream` for ``draft``; every
    wrong combination is a GenerationConfigError."""
    if not isinstance(draft_async, bool):
        raise GenerationConfigError(f"draft_async must be True or False, got {draft_async!r}")
    for name, value in (("draft_threads", draft_threads), ("target_threads", target_threads)):
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise GenerationConfigError(f"{name} must be a positive integer, got {value!r}")
        if not draft_async:
            raise GenerationConfigError(f"{name} applies to asynchronous drafting: add "
                                        f"draft_async=True (--draft-async)")
    if not draft_async:
        return None
    from forerun.drafters.registry import draft_kind

    if draft_kind(draft) != "model":
        raise GenerationConfigError(
            f"draft_async needs a draft model (a Model, preset or path sharing the "
            f"tokenizer), got draft={draft!r}: prompt lookup and Medusa heads cost little "
            f"to draft and have no model to run in a thread of its own")
    return draft_threads, target_threads


def tree_options(draft, draft_k, draft_tree, tree_nodes, split) -> int | bool:
    """What the tree arguments of :meth:`Model.stream` ask for: ``False``
    (no tree, or the drafter's own tree), ``True`` (a draft-model tree of
    a chosen size) or a node count; every wrong combination is a
    GenerationConfigError."""
    from forerun.drafters.registry import draft_kind

    if not isinstance(draft_tree, bool):
        raise GenerationConfigError(f"draft_tree must be True or False, got {draft_tree!r}")
    if tree_nodes is not None and (not isinstance(tree_nodes, int)
                                   or isinstance(tree_nodes, bool) or tree_nodes < 1):
        raise GenerationConfigError(f"tree_nodes must be a positive integer, got "
                                    f"{tree_nodes!r}")
    if not draft_tree and tree_nodes is None:
        return False
    kind = draft_kind(draft)
    if kind == "medusa" and not draft_tree:
        if draft_k is not None:
            raise GenerationConfigError("give the Medusa tree's node count once: tree_nodes "
                                        "(--tree-nodes) or draft_k (--draft-k)")
        return tree_nodes
    if kind != "model":
        raise GenerationConfigError(
            f"draft_tree/tree_nodes need a draft model (a Model, preset or path) or Medusa "
            f"heads, got draft={draft!r}")
    if draft_k is not None:
        raise GenerationConfigError("draft_k drafts a chain of that length; for a tree give "
                                    "tree_nodes (--tree-nodes) instead")
    if split is not None:
        raise GenerationConfigError("asynchronous drafting drafts chains; drop draft_async "
                                    "or draft_tree/tree_nodes")
    return True if tree_nodes is None else tree_nodes


def lookup_option(draft, draft_lookup, draft_k, tree, split) -> bool:
    """Whether :meth:`Model.stream` drafts with prompt lookup beside a
    draft model: ``draft_lookup`` as given (``True`` or ``False``), or,
    for ``None``, wherever it applies (see :func:`lookup_applies`).  An
    explicit ``True`` where it can't apply, and any other value, is a
    GenerationConfigError naming the conflict."""
    from forerun.drafters.registry import draft_kind

    if draft_lookup is not None and not isinstance(draft_lookup, bool):
        raise GenerationConfigError(f"draft_lookup must be True, False or None (where it "
                                    f"applies), got {draft_lookup!r}")
    if draft_lookup is None:
        return lookup_applies(draft, draft_k, tree, split)
    if not draft_lookup:
        return False
    if draft_kind(draft) != "model":
        raise GenerationConfigError(
            f"draft_lookup (--draft-lookup) adds prompt lookup to a draft model (a Model, "
            f"preset or path), got draft={draft!r}; for prompt lookup alone use "
            f"draft='ngram'")
    if draft_k is not None:
        raise GenerationConfigError("draft_lookup chooses each round's drafter and length "
                                    "from measured costs; drop draft_k (--draft-k)")
    if tree is not False or split is not None:
        raise GenerationConfigError("draft_lookup drafts chains in the model's own thread; "
                                    "drop draft_tree/tree_nodes and draft_async")
    return True


def lookup_applies(draft, draft_k, tree, split) -> bool:
    """Whether prompt lookup goes beside ``draft`` by default: for a draft
    model drafting chains of a chosen length in the model's own thread
    (no ``draft_k``, no tree, no asynchronous ``split``).  Over the bench's
    21 prompts (AMD EPYC, AVX2; the 1.5B Qwen target in q4 and its 0.5B
    draft, greedy), the pair ran 5.7% and 9.9% faster than the draft model
    alone in two runs, and 22-31% faster on RAG."""
    from forerun.drafters.registry import draft_kind

    return draft_kind(draft) == "model" and draft_k is None and tree is False \
        and split is None


def cost_store(model: "Model", tag: str = "") -> "CalibrationStore":
    """Where the measured verification costs of ``model`` on this machine
    are kept, so the adaptive draft length calibrates once per model,
    engine settings (weight format, threads, options), CPU and context.
    ``timing`` names how the sizes were timed (interleaved, since costs
    timed size after size could be bent by one slow spell), so curves
    timed the old way are measured again."""
    from forerun.machine.calibration import CalibrationStore

    decoder = model.decoder
    key = {"model": model.identity, **decoder.settings,
           "context_length": decoder.context_length,
           "verify_group": decoder.verify_group, "method": tag or "chain",
           "timing": "interleaved"}
    return CalibrationStore("costs", key, label=f"{model.name}-{decoder.engine}{tag}")


class GenerationStream:
    """Iterator of text deltas; ``result`` is set when it is exhausted.

    The stream holds its model from the first ``next()`` until it is
    exhausted or closed; :meth:`close` (or leaving a ``with`` block) ends it
    early and frees the model."""

    def __init__(self, gen) -> None:
        self._gen = gen
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        return self

    def __enter__(self) -> "GenerationStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the generation now (its model is free again); further
        ``next()`` calls raise StopIteration.  ``result`` stays None."""
        self._gen.close()

    def __next__(self) -> str:
        try:
            return next(self._gen)
        except StopIteration as stop:
            self.result = stop.value
            raise


def load(model: str | Path = "qwen2.5-coder-1.5b", *, engine: str = "torch",
         context_length: int | None = None, device: str | torch.device | None = None,
         dtype: torch.dtype = torch.float32, progress: bool = True,
         engine_options: dict[str, Any] | None = None, weights: str = "auto") -> Model:
    """Load a model by preset name, ``.gguf`` path or Hugging Face folder.

    ``context_length`` sets the KV cache size (default: the model's own limit,
    capped at 4096 positions); ``device`` defaults to CUDA, then MPS, then the
    CPU.  The first load of a GGUF model converts it into forerun's cache
    (``$FORERUN_CACHE``, default ``~/.cache/forerun``).

    ``engine="llama.cpp"`` runs a GGUF file (a preset or a path) with
    llama.cpp instead, on the CPU and with its quantized weights (nothing is
    converted; ``dtype`` does not apply).  It needs llama-cpp-python
    (``pip install 'forerun[llama]'``).  ``engine_options`` go to
    :class:`~forerun.engines.llama_cpp_engine.LlamaCppDecoder`: ``n_threads``,
    ``n_threads_batch``, ``n_batch``, ``flash_attn``, ``extra_buffers``.

    ``weights`` is the PyTorch engine's weight format: ``"float32"``,
    ``"bfloat16"``, ``"q8"`` (int8, a scale per row), ``"q4"`` (4-bit groups
    of 32; a GGUF's Q4_K/Q4_0/Q4_1 and Q6_K tensors keep their own values,
    its other 5-to-8-bit ones become int8), ``"q4-all"`` (every matrix in 4-bit
    groups, the 5-to-8-bit ones requantized: the format draft models run
    in, never picked by ``auto``), or ``"auto"``: for a GGUF file, the
    fastest of these on this machine, measured once per machine and model
    shape; for a Hugging Face folder, float32 (quantizing a float model is
    left to an explicit ``bfloat16``/``q8``/``q4``).  The
    quantized formats read the GGUF directly, with no float32 conversion
    cache.  See :mod:`forerun.engines.linear`.
    """
    from forerun.engines.linear import check_format

    weights = check_format(weights)
    check_load_arguments(model, context_length=context_length, dtype=dtype,
                         progress=progress, engine_options=engine_options)
    engine = _ENGINE_ALIASES.get(engine, engine) if isinstance(engine, str) else engine
    if not isinstance(engine, str) or engine not in ENGINES:
        raise ConfigError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if engine == "llama.cpp":
        from forerun.engines.llama_cpp_engine import import_llama_cpp
        from forerun.loading.load import load_gguf_files

        import_llama_cpp()   # EngineUnavailableError before any file is read
        if weights != "auto":
            raise ConfigError(f"weights={weights!r} applies to the torch engine; the "
                              f"llama.cpp engine runs the GGUF file's own quantization")
        if device is not None and parse_device(device).type != "cpu":
            raise ConfigError(
                f"the llama.cpp engine runs on the CPU; device {str(device)!r} is not "
                f"supported (drop --device, or use engine='torch')")
        files = load_gguf_files(model, progress=progress)
    else:
        if engine_options:
            raise ConfigError(f"engine_options apply to the llama.cpp engine, not to "
                              f"{engine!r}; got {', '.join(engine_options)}")
        device = resolve_device(device)   # before the seconds a conversion takes
        files, weights = _torch_model_files(model, weights, dtype, device, progress)
    config = files.config
    if context_length is None:
        context_length = min(config.max_position_embeddings, DEFAULT_CONTEXT_LENGTH)
    if context_length > config.max_position_embeddings:
        raise ConfigError(
            f"context_length {context_length} exceeds the model's limit of "
            f"{config.max_position_embeddings} positions")
    if engine == "llama.cpp":
        from forerun.engines.llama_cpp_engine import ENGINE_OPTIONS, LlamaCppDecoder

        options = dict(engine_options or {})
        unknown = sorted(set(options) - set(ENGINE_OPTIONS))
        if unknown:
            raise ConfigError(f"unknown llama.cpp engine option(s) {', '.join(unknown)}; "
                              f"the options are {', '.join(ENGINE_OPTIONS)}")
        decoder = LlamaCppDecoder(files.gguf_path, context_length=context_length,
                                  eos_token_ids=config.eos_token_ids, **options)
        return Model(files.name, decoder, files.tokenizer, config, source=_source(files, model))
    from forerun.engines.torch_engine import TorchDecoder
    from forerun.engines.transformer import Transformer

    try:
        if files.weights is None:   # a GGUF in q4, q8 or q4-all: the packed network
            from forerun.loading.load import _known_digest
            from forerun.loading.packed_cache import packed_network

            network = packed_network(files.gguf_path, config, weights, device,
                                     digest=_known_digest(model), progress=progress)
        else:
            network = Transformer(config, files.weights, dtype=dtype, device=device,
                                  weights_format=weights)
        if network.weights_format == "q8" and network.int8_layers():
            # (q4's int8 parts, a GGUF's 6-bit matrices, prefilled slower
            # this way on the AMD EPYC, and the timing is of int8 blocks.
            # forerun's native layers need no choice: their one kernel
            # prefilled the 1.5B at 66 tok/s in q8 there, against 41-44.)
            from forerun.engines.prefill_kernel import choose_prefill_kernel

            network.set_prefill_kernel(choose_prefill_kernel(files.name, config, device).kernel)
        decoder = TorchDecoder(network, context_length, config.eos_token_ids)
    except (RuntimeError, MemoryError) as exc:
        if not memory_error(exc):
            raise
        raise ConfigError(f"not enough memory on {device} for {files.name} with a context of "
                          f"{context_length} positions: load it with a smaller "
                          f"context_length (--context-length)") from exc
    return Model(files.name, decoder, files.tokenizer, config, source=_source(files, model))


def _torch_model_files(model, weights: str, dtype: torch.dtype, device: torch.device,
                       progress: bool):
    """The files of ``model`` for the torch engine in weight format
    ``weights`` (``"auto"`` resolved here), and that format.  A GGUF in a
    quantized format (q4, q8, q4-all) comes with ``weights`` None: its
    network is built from the GGUF itself, or read from the packed-weight
    cache (:mod:`forerun.loading.packed_cache`); other models come through
    the float32 conversion cache."""
    from forerun.engines.linear import QUANTIZED_FORMATS
    from forerun.loading.load import load_gguf_files, load_model_files, resolve_spec

    path = resolve_spec(model, progress=progress)
    is_gguf = not path.is_dir() and path.suffix.lower() == ".gguf"
    if dtype != torch.float32 and weights == "auto":   # an explicit activation dtype
        weights = "bfloat16" if dtype == torch.bfloat16 else "float32"
    if not is_gguf:
        # A float model keeps its precision unless asked otherwise.
        return load_model_files(model, progress=progress), \
            "float32" if weights == "auto" else weights
    if weights == "auto" or weights in QUANTIZED_FORMATS:
        # The header (config, tokenizer) alone; the weights read lazily.
        files = load_gguf_files(model, engine="torch", progress=progress)
        if weights == "auto":
            weights = choose_weights(files.name, files.config, device).format
        if weights in QUANTIZED_FORMATS:
            files.weights = None   # built from the GGUF or the packed cache by load()
            return files, weights
    return load_model_files(model, progress=progress), weights


def choose_weights(name: str, config, device: torch.device):
    """The weight format ``weights="auto"`` picks for a model of ``config``'s
    shape on ``device``: stored per machine, else measured
    (:mod:`forerun.engines.format_choice`)."""
    from forerun.machine.calibration import CalibrationStore
    from forerun.engines.format_choice import FormatChoice, choose_format, time_formats

    if device.type == "cpu":
        candidates = ("q4", "q8", "bfloat16", "float32")
    else:   # forerun's int4/int8 layers run dequantized off the CPU
        candidates = ("bfloat16", "float32")
    key = {"hidden": config.hidden_size, "intermediate": config.intermediate_size,
           "candidates": list(candidates), "device": str(device),
           "threads": torch.get_num_threads(), "torch": torch.__version__}
    store = CalibrationStore("weights", key, label=f"{name}-{device.type}")

    def measure() -> FormatChoice:
        ms = time_formats(config, candidates, device)
        return FormatChoice(choose_format(ms), ms)

    return store.load_or_measure(lambda d: FormatChoice.from_dict(d, candidates), measure,
                                 f"the fastest weight format for {name}", FormatChoice.to_dict)


def _source(files, spec) -> str:
    """The file or folder a model was read from, for error messages."""
    return str(files.gguf_path) if files.gguf_path is not None else str(spec)


def _valid_text(text: str, what: str) -> str:
    """``text``, refused when it holds lone surrogates (bytes that were not
    valid UTF-8, smuggled in by ``surrogateescape``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start:exc.end]
        raise GenerationConfigError(
            f"the {what} is not valid UTF-8 text: it holds {bad!r} (bytes that were not "
            f"UTF-8) at "
            f"character {exc.start}; decode it as UTF-8 first (or fix its encoding)") from None
    return text


def _tuple_of(values, what: str) -> tuple:
    """A tuple of ``values`` (a list or tuple); anything else is refused
    with a message naming ``what``."""
    if isinstance(values, (list, tuple)):
        return tuple(values)
    raise GenerationConfigError(f"{what} must be a list, got {type(values).__name__} "
                                f"{values!r}")
