"""Training data for a draft head, made by the target model itself: Magpie
conversations and local text, into a token manifest
(:mod:`forerun.corpus.token_manifest`).

**Magpie** (Xu et al. 2024, "Magpie: Alignment Data Synthesis from
Scratch by Prompting Aligned LLMs with Nothing").  An instruct model given
only its chat template's user prefix (the template rendered up to where the
user's text begins, with the default system prompt the template adds)
writes a plausible user request, until its end-of-turn token
(:func:`magpie_prefix`, :meth:`Magpie.query`).  The target then answers
that request through its normal chat template (:meth:`Magpie.answer`).  A
conversation record is the prompt the target read (the chat template with
the request, as :meth:`~forerun.api.model.Model.encode_prompt` renders it)
followed by exactly the tokens it generated, its end-of-turn token
included; its loss starts at the answer.  A draft head trained on it learns
the target's own continuations, on the target's own tokenisation.

**Topics** (``topics``, optional).  Plain Magpie writes what the model
asks most readily, which for a coder model is rarely code, translation or
a summary.  With topics, item ``i``'s query is written after the prefix of
a conversation whose system message is topic ``i mod n`` (say, "You are an
assistant that translates texts between languages."): the request follows
the topic.  The answer is asked as usual, under the template's default
system prompt, so the record is what a user gets.

Queries are sampled (temperature 1, top-p 0.99) with a seed of their own
(:func:`item_seed`: the run's seed and the item's index), answers are
greedy by default; generation goes through forerun's public API only
(``Model.generate``), with speculative decoding for the answers where asked
(greedy output is the same, token for token).

**Filters.**  A query is dropped when it is empty, over-long (it did not
end with an end-of-turn), degenerate (:func:`degenerate`), holds special
tokens, overlaps one of the benchmark prompts (:class:`BenchOverlap`), or
duplicates a kept query exactly or nearly
(:class:`~forerun.corpus.token_manifest.Dedup`); an answer when it is
empty or degenerate, and when it is over-long unless ``keep_cut_answers``
(the default): an answer cut at ``max_answer_tokens`` is still the target's
own text, token for token, which is all a draft head learns from (in the
committed topic runs a sixth of the answers ran to 384 tokens: keeping them
keeps 1.6 times the answer tokens).  Text chunks (``seq_len`` tokens of the
corpus files, in a seeded order) are dropped when short, degenerate,
duplicate or overlapping a benchmark prompt.  Every drop is counted by
reason.

**Documents** (``text_layout="chat"``).  The corpus' chunks are stored as
the target reads them pasted into a chat with a request after them
(:mod:`forerun.training.documents`: prefill distillation, nothing
generated), filtered as text chunks are.

**Runs** (:class:`DataBuilder`).  Conversations and text chunks alternate
so that text makes ``text_share`` of the tokens, until the token budget,
the time budget or a stop request.  Each item's outcome depends only on the
settings, its seed and the records kept before it, and the manifest keeps
where the run stands with every flush: a stopped run resumed later makes
the same records as one that never stopped (on the same machine and engine
settings, whose numerics decide the greedy answers).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import re
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from forerun.corpus.text_files import read_text
from forerun.corpus.token_manifest import (
    Dedup,
    ManifestWriter,
    Record,
    normalise,
    rebuild_dedup,
    text_key,
    words,
)
from forerun.errors import ConfigError, ForerunError, TokenizerError
from forerun.generation.ordered_pool import OrderedPool
from forerun.speculation.config import PLAIN, SpeculativeConfig
from forerun.training.documents import (
    DocumentTemplate,
    document_record,
    document_template,
    line_chunks,
    request_for,
)

#: a user message no template writes by itself: where it lands in the
#: rendered template is where the user's text begins
SENTINEL = "FORERUN-MAGPIE-SENTINEL-7f3a9c"
#: the fewest tokens a text chunk keeps
MIN_CHUNK = 32
#: how corpus chunks are stored (DataSettings.text_layout)
TEXT_LAYOUTS = ("plain", "chat")


class Stopped(Exception):
    """A generation cancelled by a stop request or the time budget: the item
    it belonged to is not counted, and a resumed run makes it again."""


# -- the Magpie prefix ---------------------------------------------------------

@dataclass(frozen=True)
class MagpiePrefix:
    """What a Magpie query is sampled after, and what ends it.

    ``text``: the chat template rendered up to where the user's text
    begins; ``ids``: its tokens.  ``end_text``: what the template writes
    right after the user's text; ``stop_token_ids``: its first token, where
    that is a special token (ChatML's ``<|im_end|>``, Llama 3's
    ``<|eot_id|>``); ``stop``: the text itself otherwise (Llama 2's
    ``[/INST]``)."""

    text: str
    ids: tuple[int, ...]
    end_text: str
    stop_token_ids: tuple[int, ...]
    stop: tuple[str, ...]


def magpie_prefix(tokenizer, system: str | None = None) -> MagpiePrefix:
    """The Magpie prefix of a tokenizer's chat template: a conversation of
    one user message (a sentinel) rendered and cut where the sentinel
    begins, so it includes the system prompt the template adds by default,
    or the ``system`` message (a topic) before it.

    Refused, with a :class:`~forerun.errors.ConfigError`, when there is no
    template, when it can't render a lone user message or does not write
    it, and when it has no user turn: nothing but BOS before the user's
    text, or the same header before an assistant's."""
    if tokenizer.chat_template is None:
        raise ConfigError("the model has no chat template: Magpie prompts an instruct "
                          "model with its template's user prefix; use an instruct model, "
                          "or build text-only data (--text-share 1 with --corpus)")
    rendered = _render(tokenizer, "user", system)
    if rendered is None and system is not None:
        raise ConfigError("the model's chat template can't render a system message before a "
                          "user's: it can't take --topic; leave the topics out")
    if rendered is None:
        raise ConfigError("the model's chat template can't render a conversation of one "
                          "user message, so it has no user turn to prompt; use an instruct "
                          "model with a user turn, or build text-only data (--text-share 1)")
    at = rendered.find(SENTINEL)
    if at < 0:
        raise ConfigError("the model's chat template does not write the user's message: it "
                          "has no user turn to prompt; use an instruct model with a user "
                          "turn, or build text-only data (--text-share 1)")
    head, tail = rendered[:at], rendered[at + len(SENTINEL):]
    bos = tokenizer.bos_token_id
    header = head
    if bos is not None:
        header = header.replace(tokenizer.id_to_token(bos), "")
    if not header.strip():
        raise ConfigError("the model's chat template writes the user's text with nothing "
                          "before it: it has no user turn for Magpie to prompt; use an "
                          "instruct model with a user turn, or build text-only data "
                          "(--text-share 1)")
    assistant = _render(tokenizer, "assistant")
    if assistant is not None and assistant.find(SENTINEL) >= 0 \
            and assistant[:assistant.find(SENTINEL)] == head:
        raise ConfigError("the model's chat template writes a user's and an assistant's "
                          "message alike: it has no user turn for Magpie to prompt; use an "
                          "instruct model, or build text-only data (--text-share 1)")
    ids = tuple(tokenizer.encode(head, add_special_tokens=False))
    end = tokenizer.encode(tail, add_special_tokens=False) if tail else []
    if end and end[0] in tokenizer.special_token_ids:
        return MagpiePrefix(head, ids, tail, (int(end[0]),), ())
    stop = (tail.strip(),) if tail.strip() else ()
    return MagpiePrefix(head, ids, tail, (), stop)


def doomed_tokens(specials: Collection[int], prefix: MagpiePrefix,
                  eos_token_ids: Collection[int]) -> frozenset[int]:
    """The special tokens after which a query is dropped whatever follows:
    every one but what ends its turn (``prefix``'s stop token) and the
    model's end of text.  A query with one inside is dropped
    ("special_tokens" if its turn ends, "too_long" if it never does), so
    its generation stops at the first one: the tokens after it were thrown
    away (on the 1.5B, 187 of 4,935 query tokens in 48 queries).  The kept
    queries, and so the records, are the same."""
    return frozenset(specials) - set(prefix.stop_token_ids) - set(eos_token_ids)


def _render(tokenizer, role: str, system: str | None = None) -> str | None:
    messages = [{"role": role, "content": SENTINEL}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    except TokenizerError:
        return None


# -- quality filters -----------------------------------------------------------

def item_seed(seed: int, index: int) -> int:
    """The sampling seed of item ``index`` of a run seeded ``seed``."""
    digest = hashlib.sha256(f"forerun-magpie:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def degenerate(tokens: Sequence[int], *, n: int = 4, min_distinct: float = 0.4) -> bool:
    """Whether ``tokens`` repeat themselves: fewer than ``min_distinct`` of
    its ``n``-grams are distinct (a loop, a line over and over).  Sequences
    under 24 tokens are never judged so."""
    if len(tokens) < 24:
        return False
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) < min_distinct


def query_problem(text: str, tokens: Sequence[int], finish_reason: str,
                  specials: Collection[int], doomed: Collection[int] = ()) -> str | None:
    """Why a sampled query (its stripped ``text`` and ``tokens``, its end
    token last) is dropped, or None: it did not end its turn ("too_long"),
    has special tokens inside or was stopped by one of ``doomed``
    (:func:`doomed_tokens`: "special_tokens"), has fewer than two words
    ("empty"), or repeats itself ("degenerate")."""
    if finish_reason != "stop":
        return "too_long"
    if any(t in specials for t in tokens[:-1]) or (tokens and tokens[-1] in doomed):
        return "special_tokens"
    if len(words(text)) < 2:
        return "empty"
    if degenerate(tokens):
        return "degenerate"
    return None


class BenchOverlap:
    """Benchmark prompts that training data must not contain: a text
    overlaps one when it shares ``ngram`` consecutive words with it (case
    and Unicode forms aside), and a query also when the word bigrams it
    shares with one make at least ``similar`` of the larger of the two
    bigram sets (a paraphrase)."""

    def __init__(self, texts: Iterable[str], *, ngram: int = 8, similar: float = 0.5) -> None:
        self.ngram = ngram
        self.similar = similar
        self._grams: set[tuple[str, ...]] = set()
        self._bigrams: list[set[tuple[str, ...]]] = []
        digest = hashlib.sha256()
        for text in texts:
            digest.update(text.encode("utf-8") + b"\0")
            w = [word for word, _, _ in _spans(text)]
            self._grams.update(zip(*(w[i:] for i in range(ngram))))
            self._bigrams.append(set(zip(w, w[1:])))
        self.count = len(self._bigrams)
        #: identifies the prompt set (a resumed run must filter by the same)
        self.digest = digest.hexdigest()[:16]

    def overlaps(self, text: str, *, query: bool = False,
                 span: tuple[int, int] | None = None) -> bool:
        """Whether ``text`` overlaps a prompt; with ``span`` (character
        offsets), only the word runs that reach into ``text[span[0]:span[1]]``
        count (a chunk given with its neighbours' text around it, so that a
        prompt's words split between two chunks are found in both)."""
        found = _spans(text)
        n = self.ngram
        for i in range(len(found) - n + 1):
            gram = tuple(word for word, _, _ in found[i:i + n])
            if gram in self._grams and (span is None or (
                    found[i][1] < span[1] and found[i + n - 1][2] > span[0])):
                return True
        if not query:
            return False
        w = [word for word, _, _ in found]
        mine = set(zip(w, w[1:]))
        if len(mine) < 3:
            return False
        return any(len(mine & b) >= self.similar * max(len(mine), len(b))
                   for b in self._bigrams)


def _spans(text: str) -> list[tuple[str, int, int]]:
    """The words of ``text`` (runs of letters and digits), each normalised
    (:func:`~forerun.corpus.token_manifest.normalise`), with its
    character offsets in ``text``."""
    out = []
    for m in re.finditer(r"\w+", text):
        for word in re.findall(r"\w+", normalise(m.group())):
            out.append((word, m.start(), m.end()))
    return out


# -- synthesis -----------------------------------------------------------------

class ChatModel(Protocol):
    """What Magpie needs of a model: :class:`forerun.api.model.Model`."""

    name: str
    tokenizer: Any
    decoder: Any
    eos_token_ids: tuple[int, ...]

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Any: ...

    def run_pool(self, next_job: Callable[[], Any], *, parallel: int,
                 on_end: Callable[[Any, Any, BaseException | None], None] | None = None
                 ) -> None: ...

    def stream_in_batch(self, decoder: Any, prompt: str | None = None, **kwargs: Any
                        ) -> Any: ...

    def encode_prompt(self, prompt: str | None = None, *, messages: Any = None,
                      prompt_ids: Any = None) -> list[int]: ...


@dataclass(frozen=True)
class DataSettings:
    """What decides the data a run makes (a resumed run must have the same;
    :meth:`differences`)."""

    seed: int = 0
    query_temperature: float = 1.0
    query_top_p: float = 0.99
    max_query_tokens: int = 192
    answer_temperature: float = 0.0
    max_answer_tokens: int = 384
    #: the answers' speculative decoding (it changes nothing when greedy)
    answer_draft: str = "none"
    seq_len: int = 2048
    text_share: float = 0.0
    near_duplicate: float = 0.7
    corpus: tuple[str, ...] = ()
    #: the corpus' files and sizes (files added, removed or resized change it)
    corpus_digest: str = ""
    #: prompt files besides forerun's benchmark whose prompts are kept out
    exclude_prompts: tuple[str, ...] = ()
    bench_digest: str = ""
    #: system messages that steer the queries, taken in turn (module text)
    topics: tuple[str, ...] = ()
    #: keep an answer cut at max_answer_tokens (module text); manifests made
    #: before this setting existed dropped them (:meth:`from_json`)
    keep_cut_answers: bool = True
    #: how a corpus chunk is stored: "plain" text (loss on every token), or
    #: "chat": a document in a user message followed by a request about it,
    #: as the target reads it before answering (module documents)
    text_layout: str = "plain"
    #: the most chunks taken from one corpus file, its first ones (0: all):
    #: a few long files would otherwise make most of the text
    max_file_chunks: int = 0

    def validate(self) -> None:
        """Raise :class:`~forerun.errors.ConfigError` naming the first bad value."""
        def positive(name: str, value: int) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, "
                                  f"got {value!r}")

        positive("max_query_tokens", self.max_query_tokens)
        positive("max_answer_tokens", self.max_answer_tokens)
        if self.seq_len < MIN_CHUNK:
            raise ConfigError(f"--seq-len must be at least {MIN_CHUNK}, got {self.seq_len}")
        for name in ("query_temperature", "answer_temperature"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be 0 or more, got "
                                  f"{getattr(self, name)}")
        if self.query_temperature == 0:
            raise ConfigError("--query-temperature must be above 0: greedy queries would "
                              "all be the same one")
        if not 0 < self.query_top_p <= 1:
            raise ConfigError(f"--query-top-p must lie in (0, 1], got {self.query_top_p}")
        if not 0 <= self.text_share <= 1:
            raise ConfigError(f"--text-share must lie in 0..1, got {self.text_share}")
        if not 0 < self.near_duplicate <= 1:
            raise ConfigError(f"--near-duplicate must lie in (0, 1], got "
                              f"{self.near_duplicate}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ConfigError(f"--seed must be an integer in 0..2**63-1, got {self.seed!r}")
        if not isinstance(self.max_file_chunks, int) or self.max_file_chunks < 0:
            raise ConfigError(f"--max-file-chunks must be 0 (no limit) or a positive integer, "
                              f"got {self.max_file_chunks!r}")
        if self.text_layout not in TEXT_LAYOUTS:
            raise ConfigError(f"--text-layout must be one of {', '.join(TEXT_LAYOUTS)}, got "
                              f"{self.text_layout!r}")
        for topic in self.topics:
            if not isinstance(topic, str) or not topic.strip():
                raise ConfigError(f"--topic must be a non-empty system message, got {topic!r}")

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["corpus"] = list(self.corpus)
        out["exclude_prompts"] = list(self.exclude_prompts)
        out["topics"] = list(self.topics)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DataSettings:
        names = {f.name for f in fields(cls)}
        known = {k: v for k, v in data.items() if k in names}
        for name in ("corpus", "exclude_prompts", "topics"):
            if name in known:
                known[name] = tuple(known[name])
        known.setdefault("keep_cut_answers", False)     # what such a manifest did
        return cls(**known)

    def differences(self, saved: DataSettings) -> list[str]:
        """``name: saved -> this`` for each setting that differs from
        ``saved`` and changes the data (the draft only when answers are
        sampled)."""
        out = []
        for f in fields(self):
            if f.name == "answer_draft" and self.answer_temperature == 0:
                continue
            mine, theirs = getattr(self, f.name), getattr(saved, f.name)
            if mine != theirs:
                out.append(f"{f.name}: {theirs!r} in the manifest, {mine!r} now")
        return out


@dataclass
class Outcome:
    """One generation's result for the data: its text and tokens, or why
    it was dropped; its time and token count."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)
    dropped: str | None = None
    seconds: float = 0.0
    #: an answer cut at max_answer_tokens, kept (keep_cut_answers)
    cut: bool = False


class Magpie:
    """Synthesises queries (:meth:`query`) and answers them (:meth:`answer`)
    with ``model``; ``cancel`` (a callable) stops a generation midway
    (:class:`Stopped`)."""

    def __init__(self, model: ChatModel, settings: DataSettings, *,
                 answer_speculative: SpeculativeConfig = PLAIN,
                 cancel: Callable[[], bool] | None = None) -> None:
        self.model = model
        self.settings = settings
        self.prefix = magpie_prefix(model.tokenizer)
        self.topic_prefixes = [magpie_prefix(model.tokenizer, t) for t in settings.topics]
        self.answer_speculative = answer_speculative
        self.cancel = cancel
        self._specials = model.tokenizer.special_token_ids
        # (every prefix of a template ends its turn alike)
        self._doomed = doomed_tokens(self._specials, self.prefix, model.eos_token_ids)

    def query(self, seed: int, index: int = 0) -> Outcome:
        """A user request sampled after the Magpie prefix (of item
        ``index``'s topic, where there are topics)."""
        start = time.perf_counter()
        r = self.model.generate(**self._query_request(seed, index), cancel=self.cancel)
        return self._query_outcome(r, time.perf_counter() - start)

    def _query_request(self, seed: int, index: int) -> dict[str, Any]:
        s = self.settings
        prefix = (self.topic_prefixes[index % len(self.topic_prefixes)]
                  if self.topic_prefixes else self.prefix)
        return dict(prompt_ids=list(prefix.ids), max_new_tokens=s.max_query_tokens,
                    temperature=s.query_temperature, top_p=s.query_top_p, seed=seed,
                    stop=list(prefix.stop),
                    stop_token_ids=[*prefix.stop_token_ids, *sorted(self._doomed)],
                    speculative=PLAIN)

    def _query_outcome(self, r: Any, seconds: float) -> Outcome:
        out = Outcome(text=r.text.strip(), tokens=list(r.tokens), seconds=seconds)
        if r.finish_reason == "cancelled":
            raise Stopped
        out.dropped = query_problem(out.text, out.tokens, r.finish_reason, self._specials,
                                    self._doomed)
        return out

    def item_on(self, member: Any, seed: int, index: int,
                keepable: Callable[[Outcome], list[int] | None]
                ) -> tuple[Outcome, Outcome | None]:
        """Item ``index``'s query generated on ``member`` (a batch member,
        ``Model.run_pool``), and its answer where ``keepable(query)`` gives
        the prompt a run could keep it with: what :meth:`query` and
        :meth:`answer` make, token for token.  Answers are generated plainly
        (the same tokens as any drafter gives: answers are greedy where a
        drafter is allowed), since in a batch of many sequences drafted
        positions cost nearly what whole steps do.  ``seconds`` are left 0
        (the batch's wall time is shared out by its caller)."""
        r = self._on(member, self._query_request(seed, index))
        q = self._query_outcome(r, 0.0)
        prompt = keepable(q)
        if prompt is None:
            return q, None
        request = {**self._answer_request(prompt, seed), "speculative": PLAIN}
        return q, self._answer_outcome(self._on(member, request), prompt, 0.0)

    def _on(self, member: Any, request: dict[str, Any]) -> Any:
        stream = self.model.stream_in_batch(member, cancel=self.cancel, **request)
        for _ in stream:
            pass
        return stream.result

    def prompt(self, query: str) -> list[int] | None:
        """The tokens of ``query`` in the chat template, as the target reads
        them; ``None`` where they leave no room for a whole answer."""
        prompt = self.model.encode_prompt(messages=[{"role": "user", "content": query}])
        if len(prompt) + self.settings.max_answer_tokens > self.model.decoder.context_length:
            return None
        return prompt

    def answer(self, prompt: list[int], seed: int) -> Outcome:
        """The target's answer to ``prompt`` (:meth:`prompt`): its tokens,
        the end-of-turn token included where it ended by then (``cut``:
        it did not, and ``keep_cut_answers`` keeps it)."""
        start = time.perf_counter()
        r = self.model.generate(**self._answer_request(prompt, seed), cancel=self.cancel)
        return self._answer_outcome(r, prompt, time.perf_counter() - start)

    def _answer_request(self, prompt: list[int], seed: int) -> dict[str, Any]:
        s = self.settings
        return dict(prompt_ids=prompt, max_new_tokens=s.max_answer_tokens,
                    temperature=s.answer_temperature, seed=seed,
                    speculative=self.answer_speculative)

    def _answer_outcome(self, r: Any, prompt: list[int], seconds: float) -> Outcome:
        s = self.settings
        out = Outcome(text=r.text.strip(), tokens=list(r.tokens), prompt=prompt,
                      seconds=seconds)
        if r.finish_reason == "cancelled":
            raise Stopped
        out.cut = r.finish_reason == "length" and s.keep_cut_answers
        if r.finish_reason != "stop" and not out.cut:
            out.dropped = "too_long"
        elif not out.text:
            out.dropped = "empty"
        elif degenerate(out.tokens):
            out.dropped = "degenerate"
        return out


# -- a run -----------------------------------------------------------------------

def new_counters() -> dict[str, Any]:
    """What a run counts, by stage: made, kept, dropped by reason."""
    return {
        "queries": {"made": 0, "kept": 0, "dropped": dict.fromkeys(
            ("too_long", "empty", "special_tokens", "degenerate", "bench_overlap",
             "duplicate", "near_duplicate"), 0)},
        "answers": {"made": 0, "kept": 0, "cut": 0, "dropped": dict.fromkeys(
            ("too_long", "empty", "degenerate"), 0)},
        "text": {"files": 0, "skipped_files": 0, "made": 0, "kept": 0,
                 "dropped": dict.fromkeys(("short", "degenerate", "bench_overlap",
                                           "duplicate"), 0)},
    }


def new_state() -> dict[str, Any]:
    """Where a run stands: the next conversation item, the next file and
    chunk of the corpus, whether the corpus is used up, whether the run
    reached its budget."""
    return {"next_item": 0, "next_file": 0, "next_chunk": 0, "corpus_done": False,
            "complete": False}


def ordered_files(files: Sequence[Path], seed: int) -> list[Path]:
    """The corpus files in a seeded order (folders mixed)."""
    return sorted(files, key=lambda f: hashlib.sha256(f"{seed}:{f}".encode()).hexdigest())


def corpus_digest(files: Sequence[Path]) -> str:
    """Identifies the corpus: its files' paths and sizes, in order."""
    h = hashlib.sha256()
    for f in files:
        try:
            size = f.stat().st_size
        except OSError:
            size = -1
        h.update(f"{f}\0{size}\0".encode())
    return h.hexdigest()[:16]


@dataclass
class RunReport:
    """What one invocation did: why it stopped (``"budget"``, ``"time"``,
    ``"signal"``, ``"corpus"``), its seconds, the query and answer tokens
    it generated and their seconds (items a stop cut short left out), and
    its first kept queries."""

    stopped: str = ""
    seconds: float = 0.0
    query_tokens: int = 0
    query_seconds: float = 0.0
    answer_tokens: int = 0
    answer_seconds: float = 0.0
    records: int = 0
    examples: list[str] = field(default_factory=list)

    @property
    def answer_tokens_per_second(self) -> float:
        return self.answer_tokens / self.answer_seconds if self.answer_seconds else 0.0


class DataBuilder:
    """Fills a manifest (``writer``) with conversations made by ``model``
    and chunks of ``files`` (see the module), until it holds
    ``max_tokens`` tokens, ``max_seconds`` have passed, or ``stop`` is set;
    flushing at least every ``checkpoint_seconds`` and when it ends.  After
    ``give_up_after`` conversation items in a row that kept nothing, it
    stops with an error: the model does not make usable data."""

    def __init__(self, model: ChatModel, writer: ManifestWriter, settings: DataSettings, *,
                 files: Sequence[Path] = (), bench: BenchOverlap | None = None,
                 answer_speculative: SpeculativeConfig = PLAIN, max_tokens: int,
                 max_seconds: float | None = None, checkpoint_seconds: float = 30.0,
                 stop: threading.Event | None = None, progress: bool = False,
                 give_up_after: int = 200, parallel: int = 1) -> None:
        if max_tokens < 1:
            raise ConfigError(f"--max-tokens must be a positive integer, got {max_tokens}")
        if max_seconds is not None and not max_seconds > 0:
            raise ConfigError(f"--max-seconds must be above 0, got {max_seconds}")
        if not isinstance(parallel, int) or isinstance(parallel, bool) or parallel < 1:
            raise ConfigError(f"--parallel must be a positive integer, got {parallel!r}")
        self.parallel = parallel
        # Items made ahead by a batch (parallel > 1): each the query, and
        # the answer where the query may be kept.
        self._pool: OrderedPool[tuple[Outcome, Outcome | None]] | None = None
        # The records kept so far, read by the pool's items as they run.
        self._dedup_lock = threading.Lock()
        # This run's conversation items and the tokens they kept: how many
        # more items the budget wants (_items_wanted).
        self._items_made = 0
        self._items_kept_tokens = 0
        self.model = model
        self.writer = writer
        self.settings = settings
        self.files = ordered_files(files, settings.seed)
        self.bench = bench or BenchOverlap(())
        self.max_tokens = max_tokens
        self.max_seconds = max_seconds
        self.checkpoint_seconds = checkpoint_seconds
        self.stop = stop or threading.Event()
        self.progress = progress
        self.give_up_after = give_up_after
        self._fruitless = 0       # conversation items in a row that kept nothing
        self.state = writer.state
        self.counters = writer.counters
        self.counters["answers"].setdefault("cut", 0)   # (manifests older than the count)
        self._deadline: float | None = None
        self._magpie: Magpie | None = None
        self._answer_speculative = answer_speculative
        self._chunks: tuple[int, list[list[int]]] | None = None
        #: the kind of the corpus' records: plain text or chat-wrapped documents
        self.text_kind = "document" if settings.text_layout == "chat" else "text"
        self._document_template: DocumentTemplate | None = None
        self.dedup: Dedup = rebuild_dedup(writer.records(), settings.near_duplicate)
        tok = model.tokenizer
        self._bos = ([tok.bos_token_id] if tok.add_bos_token and tok.bos_token_id is not None
                     else [])

    @property
    def magpie(self) -> Magpie:
        if self._magpie is None:
            self._magpie = Magpie(self.model, self.settings,
                                  answer_speculative=self._answer_speculative,
                                  cancel=self._cancelled)
        return self._magpie

    def _cancelled(self) -> bool:
        return self.stop.is_set() or (self._deadline is not None
                                      and time.monotonic() >= self._deadline) or (
            self._pool is not None and self._pool.closed)

    def run(self) -> RunReport:
        """Make records until a budget or a stop request ends the run; the
        manifest is flushed whatever ended it (an error included), but for a
        second Ctrl-C or SIGTERM, which keeps what the last checkpoint
        flushed."""
        from tqdm import tqdm

        report = RunReport()
        start = time.monotonic()
        if self.max_seconds is not None:
            self._deadline = start + self.max_seconds
        last_flush = start
        bar = tqdm(total=self.max_tokens, initial=min(self.writer.tokens, self.max_tokens),
                   unit="tok", unit_scale=True, desc="training data", smoothing=0.1,
                   disable=not self.progress, dynamic_ncols=True)
        try:
            while True:
                before = self.writer.tokens
                if before >= self.max_tokens:
                    report.stopped = "budget"
                    self.state["complete"] = True
                    break
                if self._cancelled():
                    report.stopped = "signal" if self.stop.is_set() else "time"
                    break
                try:
                    if self._wants_text():
                        if not self._text_step(report):
                            continue
                    elif self.settings.text_share >= 1:
                        report.stopped = "corpus"
                        self.state["complete"] = True
                        break
                    else:
                        self._conversation_step(report)
                except Stopped:
                    report.stopped = "signal" if self.stop.is_set() else "time"
                    break
                bar.update(min(self.writer.tokens, self.max_tokens) - min(before,
                                                                          self.max_tokens))
                bar.set_postfix_str(self._postfix(), refresh=False)
                if time.monotonic() - last_flush >= self.checkpoint_seconds:
                    self.writer.flush()
                    last_flush = time.monotonic()
        except Exception:
            # raised between items (an item is counted only once whole): what
            # was made is consistent, and kept where it can be written
            with contextlib.suppress(Exception):
                self._finish(report, start, "error")
            raise
        finally:
            bar.close()
            if self._pool is not None:
                self._pool.close()
        self._finish(report, start, report.stopped)
        return report

    def _finish(self, report: RunReport, start: float, stopped: str) -> None:
        report.seconds = time.monotonic() - start
        self.writer.note_run({"stopped": stopped, "seconds": round(report.seconds, 3),
                              "records": report.records,
                              "query_tokens": report.query_tokens,
                              "query_seconds": round(report.query_seconds, 3),
                              "answer_tokens": report.answer_tokens,
                              "answer_seconds": round(report.answer_seconds, 3)})
        self.writer.flush()

    def _postfix(self) -> str:
        c = self.writer.counts
        dropped = sum(sum(v["dropped"].values()) for v in self.counters.values())
        left = ("" if self._deadline is None else
                f", {max(0.0, self._deadline - time.monotonic()):.0f} s left")
        text = c["text"]["records"] + c["document"]["records"]
        return (f"{c['conversation']['records']} conversations, {text} "
                f"{'documents' if self.text_kind == 'document' else 'text'}, "
                f"{dropped} dropped{left}")

    def _wants_text(self) -> bool:
        if not self.files or self.state["corpus_done"]:
            return False
        share = self.settings.text_share
        return share >= 1 or (self.writer.counts[self.text_kind]["tokens"]
                              < share * self.writer.tokens)

    # -- conversations ---------------------------------------------------------

    def _conversation_step(self, report: RunReport) -> None:
        """Make item ``next_item``: its query, filtered, and its answer; count
        it and keep its record only once both are done (a :class:`Stopped`
        leaves nothing changed)."""
        index = self.state["next_item"]
        seed = item_seed(self.settings.seed, index)
        q, answer = (self._made_ahead(index) if self.parallel > 1
                     else (self.magpie.query(seed, index), None))
        report.query_seconds += q.seconds
        report.query_tokens += len(q.tokens)
        reason = q.dropped
        if reason is None and self.bench.overlaps(q.text, query=True):
            reason = "bench_overlap"
        if reason is None:
            with self._dedup_lock:
                reason = self.dedup.check(q.text)
        prompt = self.magpie.prompt(q.text) if reason is None else None
        if reason is None and prompt is None:
            reason = "too_long"      # no room left in the context for an answer
        a = None
        if prompt is not None and reason is None:
            a = answer if answer is not None else self.magpie.answer(prompt, seed)
        if a is not None:
            report.answer_seconds += a.seconds
            report.answer_tokens += len(a.tokens)
        kept = reason is None and a is not None and a.dropped is None
        if kept:     # the record first: if it can't be added, nothing is counted
            assert a is not None
            record = Record(np.array(a.prompt + a.tokens, dtype=np.int32), "conversation",
                            len(a.prompt), seed=seed, query=q.text, key=text_key(q.text))
            self.writer.add(record)
            with self._dedup_lock:
                self.dedup.add(q.text, key=record.key)
            self._items_kept_tokens += len(record.tokens)
            report.records += 1
            if len(report.examples) < 3:
                report.examples.append(q.text)
        queries = self.counters["queries"]
        queries["made"] += 1
        if reason is not None:
            queries["dropped"][reason] += 1
        else:
            assert a is not None
            queries["kept"] += 1
            answers = self.counters["answers"]
            answers["made"] += 1
            if a.dropped is not None:
                answers["dropped"][a.dropped] += 1
            else:
                answers["kept"] += 1
                answers["cut"] += a.cut
        self.state["next_item"] = index + 1
        self._items_made += 1
        self._fruitless = 0 if kept else self._fruitless + 1
        if self._fruitless >= self.give_up_after:
            raise ForerunError(
                f"the last {self._fruitless} conversations were all dropped (queries "
                f"{_drops(self.counters['queries'])}; answers "
                f"{_drops(self.counters['answers'])}, over the whole run): {self.model.name} "
                f"does not make usable Magpie data with these settings (an instruct model "
                f"is needed; --max-query-tokens and --max-answer-tokens bound the lengths)")

    def _made_ahead(self, index: int) -> tuple[Outcome, Outcome | None]:
        """Item ``index`` as the batch made it (:class:`OrderedPool`, started
        at the first item this run makes): its query, and its answer where
        the query could be kept when it was made.  Which are kept is decided
        item by item, in order, by :meth:`_conversation_step`, exactly as in
        a run of one item at a time: a query that duplicates a record kept
        before it was made is not answered, and every other one is (kept
        records only grow, so a query new then may turn out a duplicate of
        an item kept since, never the other way round; its answer is then
        dropped).  The batch's wall time is shared out by tokens made."""
        if self._pool is None:
            magpie = self.magpie

            def keepable(q: Outcome) -> list[int] | None:
                if q.dropped is not None or self.bench.overlaps(q.text, query=True):
                    return None
                with self._dedup_lock:
                    if self.dedup.check(q.text) is not None:
                        return None
                return magpie.prompt(q.text)

            def make(member: Any, n: int) -> tuple[Outcome, Outcome | None]:
                return magpie.item_on(member, item_seed(self.settings.seed, n), n, keepable)

            def run(next_job: Any, on_end: Any) -> None:
                self.model.run_pool(next_job, parallel=self.parallel, on_end=on_end)

            self._pool = OrderedPool(run, make, index, self._items_wanted)
            self._pool.start()
        (q, a), seconds = self._pool.take(index)
        made = [o for o in (q, a) if o is not None]
        per_token = seconds / max(1, sum(len(o.tokens) for o in made))
        for o in made:
            o.seconds = per_token * len(o.tokens)
        return q, a

    def _items_wanted(self) -> int | None:
        """About how many more conversation items the token budget needs,
        with half as many again to spare (``None`` until a batch of items
        has been taken): the pool starts no item past them, since it would
        be made in vain.  An estimate bounds only what is made ahead, never
        what is kept."""
        if self._items_made < self.parallel or not self._items_kept_tokens:
            return None
        share = 1.0 - self.settings.text_share if self.files else 1.0
        left = max(0, self.max_tokens - self.writer.tokens) * share
        return math.ceil(1.5 * left * self._items_made / self._items_kept_tokens)

    # -- text ------------------------------------------------------------------

    def _file_chunks(self, index: int) -> list[list[int]]:
        """The chunks of file ``index`` (cached for the next chunk's call);
        an unreadable file has none."""
        if self._chunks is not None and self._chunks[0] == index:
            return self._chunks[1]
        text = read_text(self.files[index])
        chunks: list[list[int]] = []
        if text is not None and text.strip():
            ids = self.model.tokenizer.encode(text, add_special_tokens=False)
            if self.text_kind == "document":
                template = self.document_template
                chunks = line_chunks(ids, template.budget, template.line_ends)
            else:
                step = self.settings.seq_len - len(self._bos)
                chunks = [self._bos + ids[i:i + step] for i in range(0, len(ids), step)]
        self._chunks = (index, chunks)
        return chunks

    @property
    def document_template(self) -> DocumentTemplate:
        """How the chat template wraps a document (text_layout "chat")."""
        if self._document_template is None:
            self._document_template = document_template(self.model, self.magpie.prefix.ids,
                                                         self.settings.seq_len, MIN_CHUNK)
        return self._document_template

    def _text_step(self, report: RunReport) -> bool:
        """Take the next chunk of the corpus (kept or dropped); False once
        the corpus is used up."""
        state, counters = self.state, self.counters["text"]
        while state["next_file"] < len(self.files):
            index = state["next_file"]
            chunks = self._file_chunks(index)
            if state["next_chunk"] == 0:
                counters["files" if chunks else "skipped_files"] += 1
            most = self.settings.max_file_chunks or len(chunks)
            if state["next_chunk"] < min(len(chunks), most):
                break
            state["next_file"], state["next_chunk"] = index + 1, 0
        else:
            state["corpus_done"] = True
            self._chunks = None
            return False
        at = state["next_chunk"]
        chunk = chunks[at]
        decode = self.model.tokenizer.decode
        text = decode(chunk, skip_special_tokens=True)
        before = decode(chunks[at - 1], skip_special_tokens=True) if at else ""
        after = (decode(chunks[at + 1], skip_special_tokens=True) if at + 1 < len(chunks)
                 else "")
        key = text_key(text)
        reason = ("short" if len(chunk) < MIN_CHUNK else
                  "degenerate" if degenerate(chunk) else
                  "bench_overlap" if self.bench.overlaps(
                      before + text + after, span=(len(before), len(before) + len(text)))
                  else self.dedup.check(text, near=False, key=key))
        if reason is None:
            path = self.files[state["next_file"]]
            source = f"{path}#{at}"
            if self.text_kind == "document":
                request = request_for(path, self.settings.seed, state["next_file"], at)
                ids, loss_start = document_record(self.model, self.document_template, text,
                                                  request)
                record = Record(np.array(ids, dtype=np.int32), "document", loss_start,
                                query=request, source=source, key=key)
            else:
                record = Record(np.array(chunk, dtype=np.int32), "text", 0, source=source,
                                key=key)
            self.writer.add(record)
            self.dedup.add(None, near=False, key=key)
            report.records += 1
        counters["made"] += 1
        if reason is not None:
            counters["dropped"][reason] += 1
        else:
            counters["kept"] += 1
        state["next_chunk"] += 1
        return True


def _drops(counter: dict[str, Any]) -> str:
    """``"made 10, dropped: too_long 7, empty 3"``"""
    parts = [f"{k} {v}" for k, v in counter["dropped"].items() if v]
    return f"made {counter['made']}, dropped: {', '.join(parts) or 'none'}"
