"""A loaded model: :class:`Model` generates and streams text, plain or
speculative, and :class:`GenerationStream` iterates a generation's text."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forerun.api.engine_policy import cost_store, measured_grouping, model_identity, probe_tokens
from forerun.api.method_builder import build_member_method, build_method
from forerun.decoding.plain import PlainDecoding
from forerun.decoding.sampling import SamplingParams
from forerun.drafters.suffix_store import SuffixStore
from forerun.errors import (
    ConfigError,
    ForerunError,
    GenerationConfigError,
    NonFiniteLogitsError,
)
from forerun.generation.batch import run_batch, run_pool
from forerun.generation.exclusive import GenerationLock, Holds
from forerun.generation.params import GenerationParams
from forerun.generation.result import GenerationResult
from forerun.generation.runner import check_request, run_generation, token_ids
from forerun.machine.omp_pool import release_thread_pool
from forerun.protocol.prefix_reuse import PrefixReuse
from forerun.speculation.config import SpeculativeConfig, resolve
from forerun.speculation.options import NAMES

if TYPE_CHECKING:
    from forerun.protocol.grouping_probe import GroupingResult

# Chat end-of-turn tokens that end generation besides the model's EOS, where
# they are special tokens of its tokenizer: the chat templates close each turn
# with one of them (llama.cpp's list, llama-vocab.cpp; Gemma's <end_of_turn>).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>",
                      "<end_of_turn>", "<|end|>", "<|eom_id|>", "<EOT>", "<end_of_utterance>")


class Model:
    """A loaded model: tokenizer, configuration and a decoder engine.

    Build one with :func:`~forerun.api.loader.load`.

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

    **Prompts are read once.**  The model keeps the keys and values of its
    last sequence, and a generation whose prompt starts with the previous
    prompt (a chat's next turn) computes only what is new: it keeps the
    whole prefill blocks the cache holds for it (128 positions on the torch
    engine, ``n_batch`` on llama.cpp; :mod:`forerun.protocol.prefix_reuse`),
    or, where the engine's positions are exact (the torch engine on its
    native CPU kernels), every position it shares with the cache, the
    previous answer's included.
    Prompts are always prefilled in the same aligned blocks, so the output
    is bit for bit that of a cold prefill, for every decoding method.  The
    result's ``stats.reused_prompt_tokens`` says how many prompt tokens came
    from the cache.  ``reuse_prompts = False`` (or ``load(...,
    reuse_prompts=False)``) prefills every prompt whole; :meth:`reset_cache`
    forgets the cached sequence once.
    """

    def __init__(self, name: str, decoder, tokenizer, config, *,
                 source: str | None = None, reuse_prompts: bool = True,
                 load_draft: Callable[[Model, Any], Model] | None = None) -> None:
        self.name = name
        # How a draft model named by a preset or path loads beside this one
        # (forerun.api.loader.load_draft_model, which load() gives).
        self._load_draft = load_draft
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
        #: the draft models this model's methods draft with, in load order
        self.drafts: list[Model] = []
        self._draft_models: dict[str, Model] = {}
        self._draft_lock = threading.Lock()
        self._grouping: GroupingResult | None = None
        self._suffix_store: SuffixStore | None = None
        self.reuse_prompts = reuse_prompts

    def __repr__(self) -> str:
        return (f"Model({self.name!r}, {self.config.architecture}, "
                f"{self.config.num_layers} layers, context {self.decoder.context_length})")

    # -- the cached sequence -------------------------------------------------
    @property
    def reuse_prompts(self) -> bool:
        """Whether a generation keeps the cached prefill blocks of the
        previous prompt it starts with (see :class:`Model`).  Setting it
        takes effect from the next generation's prefill; an engine without
        :class:`~forerun.protocol.prefix_reuse.PrefixReuse` reuses nothing."""
        return isinstance(self.decoder, PrefixReuse) and self.decoder.reuse_prefixes

    @reuse_prompts.setter
    def reuse_prompts(self, on: bool) -> None:
        check_reuse_prompts(on)
        if isinstance(self.decoder, PrefixReuse):
            self.decoder.reuse_prefixes = on

    def reset_cache(self) -> None:
        """Forget the cached sequence: the next generation prefills its whole
        prompt.  Waits for a generation running in another thread (and
        raises :class:`~forerun.errors.ModelBusyError` while a stream of this
        thread is open)."""
        with Holds([self._lock]):
            self.decoder.reset()

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
               ignore_eos: bool = False, cancel=None,
               speculative: SpeculativeConfig | Mapping[str, Any] | None = None,
               **draft_options: Any) -> GenerationStream:
        """Like :meth:`generate`, but returns an iterator of text deltas; its
        ``result`` attribute holds the :class:`GenerationResult` once the
        iteration has ended.

        Every argument is checked here, before anything runs.  The stream
        holds the model from its first ``next()`` until it ends or is
        closed (see :class:`Model`); close a stream you don't finish, or use
        it in a ``with`` block."""
        ids, params, speculative = self._request(
            prompt, messages=messages, prompt_ids=prompt_ids, max_new_tokens=max_new_tokens,
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
            stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, cancel=cancel,
            speculative=speculative, **draft_options)
        method, drafts = self._method(speculative)
        return GenerationStream(self._run(method, drafts, ids, params, cancel))

    def _request(self, prompt, *, messages, prompt_ids, max_new_tokens, temperature, top_k,
                 top_p, min_p, seed, stop, stop_token_ids, ignore_eos, cancel, speculative,
                 **draft_options: Any
                 ) -> tuple[list[int], GenerationParams, SpeculativeConfig]:
        """One request's prompt ids, parameters and speculation, every value
        checked (:meth:`stream`'s arguments)."""
        _refuse_unknown(draft_options)
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
        return ids, params, speculation(speculative, draft_options)

    def generate_batch(self, requests: Sequence[Any], *, parallel: int | None = None,
                       on_result: Callable[[int, GenerationResult], None] | None = None,
                       **common: Any) -> list[GenerationResult]:
        """Generate a completion for each of ``requests``, several at a time
        with their forwards shared (:mod:`forerun.generation.batch`), and
        return the results in the order of ``requests``.

        Each request is a prompt string (raw text, as :meth:`generate`'s
        ``prompt``), a chat (a list of ``{"role", "content"}`` dicts), or a
        dict of :meth:`generate`'s keyword arguments (``prompt``,
        ``messages`` or ``prompt_ids``, and any option for that request
        alone).  ``common`` holds :meth:`generate`'s options for every
        request.  Every request is checked before any runs.

        Each result is what :meth:`generate` would give for that request
        alone, token for token, greedy or sampled with a seed: a batch
        computes each sequence as a forward of its own would (the engine's
        exact groups, measured on this machine), whatever runs beside it.
        ``parallel``: the most sequences decoded together (default: the
        most positions the engine computes exactly in one forward, at most
        the number of requests).  Plain decoding, prompt lookup
        (``draft="ngram"``) and suffix drafting (``draft="suffix"``) run
        batched; the torch engine only.
        ``on_result(index, result)`` is called, on the calling thread, as
        each request ends (a progress bar)."""
        if isinstance(requests, (str, bytes, dict)) or not isinstance(requests, Sequence):
            raise GenerationConfigError(
                f"requests must be a list of prompts, chats or dicts of generate()'s "
                f"arguments, got {type(requests).__name__}")
        prepared = []
        for n, request in enumerate(requests):
            if isinstance(request, str):
                request = {"prompt": request}
            elif isinstance(request, dict):
                request = dict(request)
            elif isinstance(request, Sequence) and not isinstance(request, bytes):
                request = {"messages": request}
            else:
                raise GenerationConfigError(
                    f"request {n} is a {type(request).__name__}; give a prompt string, a "
                    f"list of messages or a dict of generate()'s arguments")
            arguments = {**common, **request}
            _refuse_unknown(arguments)
            values = {**_STREAM_DEFAULTS, **arguments}
            prompt = values.pop("prompt", None)
            try:
                ids, params, config = self._request(prompt, **values)
            except ForerunError as exc:
                exc.args = (f"request {n}: {exc}", *exc.args[1:])
                raise
            if not config.batched:
                raise GenerationConfigError(f"request {n}: {_not_batched(config)}; use "
                                            f"generate() for it")
            prepared.append((ids, params, config, values["cancel"]))
        if not prepared:
            return []

        def job(ids: list[int], params: GenerationParams, config: SpeculativeConfig, cancel):
            return lambda member: _result_of(self._stream_on(member, ids, params, config,
                                                              cancel))

        return self.run_batch([job(*p) for p in prepared], parallel=parallel,
                              configs=[p[2] for p in prepared], on_done=on_result)

    def run_batch(self, jobs: Sequence[Callable[[Any], Any]], *, parallel: int | None = None,
                  configs: Sequence[SpeculativeConfig] = (),
                  on_done: Callable[[int, Any], None] | None = None) -> list[Any]:
        """Run ``jobs`` several at a time, their forwards shared, and return
        their results in order.  A job is a function of a batch member (a
        decoder of its own over this model's weights) that generates on it
        with :meth:`stream_in_batch` as often as it needs (a query, then its
        answer); it runs on a thread of its own.  ``parallel``: the most jobs
        at a time (default: the most positions the engine computes exactly
        in one forward, at most the number of jobs).  ``configs``: the
        speculation configs the jobs use (the verification costs their
        drafting chooses from are read first, here).  ``on_done(index,
        result)``: called on this thread as each job ends.  The first job
        that raises has its error raised once all ended.  A job runs on the
        member of a job that ended before it where there is one, so its
        prompts keep the prefix they share with that job's, as
        :attr:`reuse_prompts` says (a batch's requests with one system
        prompt read it once per slot)."""
        _check_parallel(parallel)
        with Holds([self._lock]):
            self._before_batch(configs)
            if parallel is None:
                parallel = max(1, min(len(jobs), self.decoder.verify_group or 1))
            return run_batch(self.decoder, list(jobs), parallel, on_done=on_done,
                             keep_caches=True)

    def run_pool(self, next_job: Callable[[], tuple[Any, Callable[[Any], Any]] | None], *,
                 parallel: int,
                 on_end: Callable[[Any, Any, BaseException | None], None] | None = None,
                 configs: Sequence[SpeculativeConfig] = ()) -> None:
        """:meth:`run_batch` over jobs taken from a source as slots free up:
        ``next_job()`` gives a ``(key, job)`` pair, or ``None`` when there
        is no more; ``on_end(key, result, error)`` is called as each ends
        (:func:`~forerun.generation.batch.run_pool`).  Both are called on
        this thread, which runs the shared forwards until the source is
        done and every job has ended; a job runs on an ended job's member
        as in :meth:`run_batch`."""
        _check_parallel(parallel)
        with Holds([self._lock]):
            self._before_batch(configs)
            run_pool(self.decoder, next_job, parallel, on_end=on_end, keep_caches=True)

    def _before_batch(self, configs: Sequence[SpeculativeConfig]) -> None:
        """What a batch's members read and never measure: the grouping the
        engine computes exactly, and the costs their drafting chooses by."""
        self.verification_grouping()
        for config in {c.key: c for c in configs if c.speculates}.values():
            self.batch_costs(config)

    def stream_in_batch(self, decoder, prompt: str | None = None, **kwargs: Any
                        ) -> GenerationStream:
        """:meth:`stream` on ``decoder``, a member of a batch of this
        model's sequences (:class:`~forerun.generation.batch.BatchedDecoder`,
        its forwards shared), with plain decoding, prompt lookup or suffix
        drafting (the methods a batch runs: :attr:`SpeculativeConfig.batched`).  It holds no lock
        of the model: the batch owns the forwards.  For prompt lookup and
        suffix drafting,
        :meth:`batch_costs` of the request's config must have been read on
        the engine thread first."""
        _refuse_unknown(kwargs)
        values = {**_STREAM_DEFAULTS, **kwargs}
        ids, params, config = self._request(prompt, **values)
        if not config.batched:
            raise GenerationConfigError(_not_batched(config))
        return self._stream_on(decoder, ids, params, config, values["cancel"])

    def _stream_on(self, decoder, ids: list[int], params: GenerationParams,
                   config: SpeculativeConfig, cancel) -> GenerationStream:
        """A checked request's generation on ``decoder`` (a batch member).
        Prompt lookup chooses its draft lengths from the costs a sequence
        alone measured (:meth:`batch_costs`), never timing forwards inside
        the batch."""
        if config.method == "none":
            method: Any = PlainDecoding(decoder)
        else:
            costs = self._methods.get(("batch-costs", config.key))
            if costs is None:
                raise ConfigError("a batch member's drafting takes the costs "
                                  "batch_costs(config) read on the engine thread; call it "
                                  "there before the batch starts")
            method = build_member_method(self, decoder, config)
            method.use_costs(costs)
        return GenerationStream(self._generation(method, ids, params, cancel))

    def batch_costs(self, config: SpeculativeConfig) -> list[float | None]:
        """The verification costs prompt lookup or suffix drafting
        (``config``) chooses from in a batch: those of this model alone
        (stored per machine, or measured now on a fork of its decoder,
        alone, and stored), read once.  Call it
        on the engine thread before a batch that uses ``config`` starts: its
        members only read them (:meth:`stream_in_batch`)."""
        key = ("batch-costs", config.key)
        costs = self._methods.get(key)
        if costs is None:
            self.verification_grouping()
            alone = self.decoder.fork()
            template: Any = build_member_method(self, alone, config, cost_store(self))
            prompt = probe_tokens(self, 32)
            alone.feed(prompt, last_only=True)
            costs = self._methods[key] = template.measured_costs(prompt[-1])
        return costs

    def _generation(self, method, ids: list[int], params: GenerationParams, cancel):
        try:
            return (yield from run_generation(
                method, self.tokenizer, ids, params, eos_token_ids=self.eos_token_ids,
                cancel=cancel))
        except NonFiniteLogitsError as exc:
            raise NonFiniteLogitsError(f"{self.source}: {exc}") from None

    def _run(self, method, drafts: list[Model], ids: list[int], params: GenerationParams,
             cancel):
        """The generation, holding this model and its draft models."""
        with Holds([self._lock] + [d._lock for d in drafts]):
            try:
                return (yield from self._generation(method, ids, params, cancel))
            finally:
                # Done computing here: the next generation may run on another
                # thread, whose OpenMP pool should be the only one.
                release_thread_pool()

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
        decoding; :mod:`forerun.speculation.config`): a :class:`Model` (or a preset
        name or path, loaded once and kept) sharing this model's tokenizer,
        ``"ngram"`` for prompt lookup (no draft model), ``"suffix"`` for
        prompt lookup and this model's earlier answers
        (:meth:`suffix_store`), ``"medusa"`` for the
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
        tokens per second (:mod:`forerun.drafters.lookup_or_draft_planner`).
        ``draft_lookup``: ``None`` (the default) for wherever it applies, a
        draft model drafting chains of a chosen length in this model's
        thread (no ``draft_k``, tree or ``draft_async``); ``True`` to insist
        on it (an error where it can't apply); ``False`` for the draft model
        alone.

        ``draft_window``: the most prompt tokens a draft model reads, its
        first 4 and last ``draft_window - 4`` of a longer prompt (default
        512, :mod:`forerun.drafters.draft_window`; ``"all"``: the whole
        prompt).  It changes the draft's cost and acceptance, never the
        output.

        ``speculative``: the speculation in one argument, either a dict of
        these options (``speculative={"draft": "ngram", "draft_k": 4}``) or
        a :class:`~forerun.speculation.SpeculativeConfig` already resolved
        from them (:func:`forerun.speculation.resolve`).  The keyword
        arguments ``draft``, ``draft_k``, ... are shorthand for it, routed
        through the same place (:func:`speculation`); give one or the other.
        """
        stream = self.stream(prompt, **kwargs)
        for _ in stream:
            pass
        assert stream.result is not None   # set once the stream is exhausted
        return stream.result

    @property
    def identity(self) -> str:
        """The model as calibration records know it: its name and shape."""
        return model_identity(self)

    def verification_grouping(self) -> GroupingResult:
        """The largest group of positions this model's engine verifies
        exactly on this machine (measured once per machine and engine
        settings, then kept in forerun's cache), applied to the decoder:
        speculative decoding cuts its verifications into groups of at most
        that size, so it stays token-identical to plain decoding."""
        if self._grouping is None:
            result = measured_grouping(self)
            self.decoder.verify_group = result.exact_group
            self._grouping = result
        return self._grouping

    def measured_grouping(self, threads: int | None = None) -> GroupingResult:
        """The grouping probe's result on this machine for verifications on
        ``threads`` threads against plain decoding on the decoder's own
        count (:func:`~forerun.api.engine_policy.measured_grouping`)."""
        return measured_grouping(self, threads)

    def draft_model(self, spec: Any) -> Model:
        """The draft model ``spec`` names (a Model, returned as it is, or a
        preset name or path), loaded on this model's engine the first time
        and kept (:func:`~forerun.api.loader.load_draft_model`)."""
        load_draft_model = self._load_draft
        if load_draft_model is None:
            raise ConfigError(f"{self.name} was not made by forerun.load, which gives a model "
                              f"the way its draft models load; load it with forerun.load")
        if not isinstance(spec, (str, Path)):
            return load_draft_model(self, spec)
        key = str(spec)
        with self._draft_lock:
            loaded = self._draft_models.get(key)
            if loaded is None:
                loaded = self._draft_models[key] = load_draft_model(self, spec)
        return loaded

    def suffix_store(self) -> SuffixStore:
        """What suffix drafting (``draft="suffix"``) remembers of this
        model's earlier requests, shared by all of them (made at first
        use; :meth:`~forerun.drafters.suffix_store.SuffixStore.clear`
        forgets it)."""
        with self._draft_lock:
            if self._suffix_store is None:
                self._suffix_store = SuffixStore()
            return self._suffix_store

    def _method(self, config: SpeculativeConfig):
        """The decoding method for ``config``, and the draft models it uses:
        built once per config (building may load a draft model and measure
        this model), holding this model while it builds."""
        if not config.speculates:
            return build_method(self, config)
        built = self._methods.get(config.key)
        if built is None:
            with Holds([self._lock]):
                built = self._methods.get(config.key)
                if built is None:
                    built = self._methods[config.key] = build_method(self, config)
                    self.drafts.extend(d for d in built[1] if d not in self.drafts)
        return built


def _result_of(stream: GenerationStream) -> GenerationResult:
    """A stream read to its end: its result."""
    for _ in stream:
        pass
    assert stream.result is not None   # set once the stream is exhausted
    return stream.result


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

    def __enter__(self) -> GenerationStream:
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


def _not_batched(config: SpeculativeConfig) -> str:
    return (f"a batch of sequences runs plain decoding, prompt lookup or suffix drafting "
            f"(draft=None, 'ngram' or 'suffix'), not {config.describe()}")


_STREAM_DEFAULTS = {name: p.default
                    for name, p in inspect.signature(Model.stream).parameters.items()
                    if p.kind is inspect.Parameter.KEYWORD_ONLY}


def speculation(speculative: Any, draft_options: Mapping[str, Any]) -> SpeculativeConfig:
    """The one place a request's speculation is decided: ``speculative`` (a
    resolved :class:`SpeculativeConfig`, or a mapping of
    :data:`~forerun.speculation.options.NAMES` to values, resolved here), or
    the same options given as keyword arguments (``draft="ngram"``,
    ``draft_k=4``: the shorthand), never both."""
    shorthand = {k: v for k, v in draft_options.items() if v is not None and v is not False}
    if isinstance(speculative, SpeculativeConfig) or isinstance(speculative, Mapping):
        if shorthand:
            raise GenerationConfigError(
                f"give speculative or the draft options as keyword arguments "
                f"({', '.join(shorthand)}), not both")
        if isinstance(speculative, SpeculativeConfig):
            return speculative
        options = dict(speculative)
    elif speculative is None:
        options = dict(draft_options)
    else:
        raise GenerationConfigError(f"speculative must be a SpeculativeConfig (from "
                                    f"forerun.speculation.resolve) or a dict of speculation "
                                    f"options, got {type(speculative).__name__}")
    # (resolve checks every value itself, and names an unknown option)
    return resolve(options.pop("draft", None), **options)


def _check_parallel(parallel: Any) -> None:
    if parallel is not None and (not isinstance(parallel, int) or isinstance(parallel, bool)
                                 or parallel < 1):
        raise GenerationConfigError(f"parallel must be a positive integer, got {parallel!r}")


def _refuse_unknown(arguments: Mapping[str, Any]) -> None:
    """Refuse, naming them, arguments that are neither ``prompt``, one of
    :meth:`Model.stream`'s keyword arguments nor a speculation option."""
    unknown = {k: v for k, v in arguments.items()
               if k != "prompt" and k not in _STREAM_DEFAULTS and k not in NAMES}
    if unknown:
        raise _unknown_arguments(unknown)


def _unknown_arguments(unknown: dict[str, Any]) -> GenerationConfigError:
    """The error for keyword arguments :meth:`Model.stream` does not take,
    naming the nearest it does."""
    import difflib

    known = [name for name, p in inspect.signature(Model.stream).parameters.items()
             if p.kind is inspect.Parameter.KEYWORD_ONLY] + list(NAMES)
    parts = []
    for name in unknown:
        near = difflib.get_close_matches(name, known, n=1)
        parts.append(f"{name!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    return GenerationConfigError(f"unknown argument{'s' if len(parts) > 1 else ''} "
                                 f"{', '.join(parts)}; the arguments are "
                                 f"{', '.join(['prompt', *known])}")


def check_reuse_prompts(value: Any) -> None:
    """Refuse a ``reuse_prompts`` that is not True or False."""
    if not isinstance(value, bool):
        raise ConfigError(f"reuse_prompts must be True or False, got {value!r}")


def _valid_text(text: str, what: str) -> str:
    """``text``, refused when it holds lone surrogates (bytes that were not
    valid UTF-8, smuggled in by ``surrogateescape``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start:exc.end]
        raise GenerationConfigError(
            f"{_the(what)} not valid UTF-8 text: it holds {bad!r} (bytes that were not "
            f"UTF-8) at "
            f"character {exc.start}; decode it as UTF-8 first (or fix its encoding)") from None
    return text


def _the(what: str) -> str:
    """``"the prompt is"``, ``"the messages are"``."""
    return f"the {what} {'are' if what.endswith('s') else 'is'}"


def _tuple_of(values, what: str) -> tuple:
    """A tuple of ``values`` (a list or tuple); anything else is refused
    with a message naming ``what``."""
    if isinstance(values, (list, tuple)):
        return tuple(values)
    raise GenerationConfigError(f"{what} must be a list, got {type(values).__name__} "
                                f"{values!r}")
