"""The conversations ``make_corpus.py`` makes, as jobs for the
:class:`batcher.Batcher`, with ``forerun train data``'s filters and record
format (``docs/training-data.md``):

* **Magpie queries** after the chat template's user prefix, under one of
  the topic system messages in turn or none (temperature 1, top-p 0.99),
  then the target's greedy answer under the template's default system
  prompt (the topic steers the question, never the answer);
* **requests about a document**: a local document (``sources.py``) opens
  the user's message and the target writes the request after it, under a
  system message that asks for that (where what it writes is dropped, one
  of a few plain requests takes its place); then it answers the whole
  message;
* **translations into English** of local non-English text, asked in one of
  a few plain phrasings;
* **follow-ups**: a share of the answered conversations gets a second user
  turn, sampled after the first answer as rendered by the template, and
  its answer; the record is then the two-turn conversation.

Every query passes the filters of ``forerun train data``: it must end its
turn within the budget, have two words or more, no special tokens inside,
not repeat itself (``degenerate``), not overlap a benchmark prompt
(``BenchOverlap``) and not duplicate or nearly duplicate a kept query
(``Dedup``).  An answer must be non-empty and not degenerate; one cut at
the answer budget is kept (as ``train data`` keeps it by default).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from batcher import Batcher, Job

from forerun.corpus.token_manifest import Dedup, ManifestWriter, Record, text_key
from forerun.protocol.token_sequences import common_prefix
from forerun.training.magpie import (
    SENTINEL,
    BenchOverlap,
    degenerate,
    magpie_prefix,
    query_problem,
)

TOPICS = (
    "You are an assistant that translates texts between English, Chinese, French, German "
    "and Spanish.",
    "You are an assistant that summarises the articles, reports and documents the user "
    "pastes into the message.",
    "You are an assistant that solves math word problems step by step.",
    "You are an assistant that answers questions about a document the user provides in the "
    "message.",
    "You are an assistant that answers questions about science, history, geography and "
    "everyday life.",
    "You are an assistant that writes, fixes and explains Python and JavaScript code.",
    "You are a friendly assistant who chats with the user about their plans, hobbies, "
    "work and ideas, and gives advice.",
    "You are an assistant that writes emails, stories, poems, outlines and other texts "
    "the user asks for.",
    None,       # the template's own default system prompt
)
DOCUMENT_SYSTEM = ("The user pastes a document and then asks you to do something with it: "
                   "summarise it, answer a question about it, explain a part of it, or "
                   "extract facts from it.")
#: a document's request where the one the target wrote is dropped (on the
#: H200 run, 1,147 of about 1,360 written requests ran on as more document)
DOCUMENT_ASKS = (
    "Summarise the text above in a few sentences.",
    "What are the main points of this document?",
    "Explain what this describes in simple terms.",
    "List the key facts this text gives.",
    "Write three questions this document answers, and answer them.",
    "What would someone need to know before using what this describes?",
)
TRANSLATE_ASKS = (
    "Translate the following {lang} text into English:\n\n{text}",
    "What does this mean in English?\n\n{text}",
    "{text}\n\nTranslate this into English, please.",
    "Please translate this from {lang} to English:\n{text}",
)


@dataclass
class Settings:
    max_query_tokens: int = 192
    max_request_tokens: int = 96
    max_answer_tokens: int = 512
    query_temperature: float = 1.0
    query_top_p: float = 0.99
    near_duplicate: float = 0.7
    document_share: float = 0.2
    translate_share: float = 0.1
    follow_up_share: float = 0.25

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def share_draw(kind: str, index: int) -> float:
    """A fixed number in [0, 1) for item ``index`` (which items get what)."""
    digest = hashlib.sha256(f"forerun-gpu-corpus:{kind}:{index}".encode()).digest()
    return int.from_bytes(digest[:6], "little") / 2 ** 48


class Conversations:
    """Feeds ``batcher`` with conversations and adds the kept ones to
    ``writer`` (module text).  ``sources``: dicts with ``kind``
    ("document" or "translate"), ``text``, ``lang`` and ``source``."""

    def __init__(self, tokenizer, batcher: Batcher, writer: ManifestWriter,
                 bench: BenchOverlap, settings: Settings, sources: Sequence[dict[str, Any]],
                 *, max_in_flight: int) -> None:
        self.tok = tokenizer
        self.batcher = batcher
        self.writer = writer
        self.bench = bench
        self.s = settings
        self.documents = [d for d in sources if d["kind"] == "document"]
        self.translations = [d for d in sources if d["kind"] == "translate"]
        self.topic_prefixes = [magpie_prefix(tokenizer, t) for t in TOPICS]
        self.document_prefix = magpie_prefix(tokenizer, DOCUMENT_SYSTEM)
        self.end_ids = frozenset(self.topic_prefixes[-1].stop_token_ids)
        eos = tokenizer.eos_token_id
        self.answer_stop = frozenset(self.end_ids | ({eos} if eos is not None else set()))
        self.specials = tokenizer.special_token_ids
        self.dedup = Dedup(settings.near_duplicate)
        self.follow_dedup = Dedup(settings.near_duplicate)
        self.next_item = 0
        self.next_document = 0
        self.next_translation = 0
        self.in_flight = 0
        self.max_in_flight = max_in_flight
        self.admitting = True
        self.counts: Counter[str] = Counter()
        self.tokens: Counter[str] = Counter()

    # -- feeding the batcher ------------------------------------------------------
    def top_up(self) -> bool:
        """Start new items while fewer than ``max_in_flight`` are under way;
        whether anything is under way or was started."""
        while self.admitting and self.in_flight < self.max_in_flight:
            self._start(self.next_item)
            self.next_item += 1
        return self.in_flight > 0

    def _start(self, index: int) -> None:
        draw = share_draw("kind", index)
        s = self.s
        if draw < s.translate_share and self.next_translation < len(self.translations):
            item = self.translations[self.next_translation]
            self.next_translation += 1
            ask = TRANSLATE_ASKS[index % len(TRANSLATE_ASKS)]
            query = ask.format(lang=item["lang"], text=item["text"].strip())
            self._answer(index, "translate", query, query, source=item["source"])
        elif (draw < s.translate_share + s.document_share
              and self.next_document < len(self.documents)):
            item = self.documents[self.next_document]
            self.next_document += 1
            head = item["text"].strip() + "\n\n"
            prompt = list(self.document_prefix.ids) + self.tok.encode(head)
            self._submit(Job(prompt, s.max_request_tokens, s.query_temperature, s.query_top_p,
                             self.end_ids, self._request_done,
                             {"index": index, "head": head, "source": item["source"]}))
        else:
            prefix = self.topic_prefixes[index % len(self.topic_prefixes)]
            self._submit(Job(list(prefix.ids), s.max_query_tokens, s.query_temperature,
                             s.query_top_p, self.end_ids, self._query_done, {"index": index}))

    def _submit(self, job: Job, *, urgent: bool = False) -> bool:
        if not self.batcher.submit(job, urgent=urgent):
            self.counts["dropped_too_long"] += 1
            return False
        self.in_flight += 1
        return True

    def _finished(self) -> None:
        self.in_flight -= 1

    # -- checks -----------------------------------------------------------------
    def _query_problem(self, tokens: list[int], reason: str, text: str) -> str | None:
        problem = query_problem(text, tokens, reason, self.specials)
        if problem is None and self.bench.overlaps(text, query=True):
            return "bench_overlap"
        return problem

    def _text(self, tokens: list[int]) -> str:
        body = tokens[:-1] if tokens and tokens[-1] in self.answer_stop else tokens
        return self.tok.decode(body).strip()

    def _count_drop(self, stage: str, reason: str) -> None:
        self.counts[f"{stage}_dropped_{reason}"] += 1

    # -- the stages ---------------------------------------------------------------
    def _query_done(self, job: Job, tokens: list[int], reason: str) -> None:
        self._finished()
        self.tokens["query"] += len(tokens)
        text = self._text(tokens)
        problem = self._query_problem(tokens, reason, text) or self.dedup.check(text)
        if problem is not None:
            self._count_drop("query", problem)
            return
        self.dedup.add(text)
        self._answer(job.tag["index"], "magpie", text, text)

    def _request_done(self, job: Job, tokens: list[int], reason: str) -> None:
        self._finished()
        self.tokens["query"] += len(tokens)
        request = self._text(tokens)
        if self.bench.overlaps(job.tag["head"]):
            self._count_drop("request", "bench_overlap")
            return
        problem = self._query_problem(tokens, reason, request)
        if problem is not None:      # a plain request instead
            self._count_drop("request", problem)
            self.counts["request_asked_instead"] += 1
            request = DOCUMENT_ASKS[job.tag["index"] % len(DOCUMENT_ASKS)]
        self._answer(job.tag["index"], "document", job.tag["head"] + request, request,
                     source=job.tag["source"])

    def _answer(self, index: int, category: str, message: str, query: str,
                source: str | None = None) -> None:
        messages = [{"role": "user", "content": message}]
        prompt = self._encode(messages)
        tag = {"index": index, "category": category, "messages": messages, "query": query,
               "key": text_key(message), "source": source, "prompt": prompt,
               "first_prompt": len(prompt)}
        if not self._submit(Job(prompt, self.s.max_answer_tokens, 0.0, 1.0, self.answer_stop,
                                self._answer_done, tag), urgent=True):
            self._count_drop("answer", "too_long")

    def _encode(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True)
        return self.tok.encode(text, add_special_tokens=False)

    def _answer_done(self, job: Job, tokens: list[int], reason: str) -> None:
        self._finished()
        tag = job.tag
        self.tokens["answer"] += len(tokens)
        text = self._text(tokens)
        if not text:
            self._count_drop("answer", "empty")
        elif degenerate(tokens):
            self._count_drop("answer", "degenerate")
        turns = len(tag["messages"]) // 2 + 1
        if not text or degenerate(tokens):
            if turns > 1:      # the first turn's record was held back for this one
                self._keep(tag, tag["first_record"])
            return
        record = (tag["prompt"] + tokens, tag["first_prompt"])
        if (turns == 1 and reason == "stop" and self.admitting
                and share_draw("follow", tag["index"]) < self.s.follow_up_share):
            if self._follow_up(tag, text, record):
                return
        if turns > 1 and reason != "stop":
            self.counts["follow_up_answer_cut"] += 1
        self.counts[f"answer_{reason}"] += 1
        self._keep(tag, record)

    def _follow_up(self, tag: dict[str, Any], answer: str,
                   record: tuple[list[int], int]) -> bool:
        messages = tag["messages"] + [{"role": "assistant", "content": answer}]
        rendered = self.tok.apply_chat_template(
            messages + [{"role": "user", "content": SENTINEL}], add_generation_prompt=False)
        at = rendered.find(SENTINEL)
        if at < 0:
            return False
        prompt = self.tok.encode(rendered[:at], add_special_tokens=False)
        job = Job(prompt, self.s.max_query_tokens, self.s.query_temperature, self.s.query_top_p,
                  self.end_ids, self._follow_query_done,
                  {**tag, "messages": messages, "first_record": record})
        return self._submit(job, urgent=True)

    def _follow_query_done(self, job: Job, tokens: list[int], reason: str) -> None:
        self._finished()
        tag = job.tag
        self.tokens["query"] += len(tokens)
        text = self._text(tokens)
        problem = self._query_problem(tokens, reason, text) or self.follow_dedup.check(text)
        if problem is not None:
            self._count_drop("follow_up", problem)
            self._keep(tag, tag["first_record"])
            return
        self.follow_dedup.add(text)
        messages = tag["messages"] + [{"role": "user", "content": text}]
        prompt = self._encode(messages)
        first = self._encode(messages[:1])
        start = common_prefix(prompt, first)
        new = {**tag, "messages": messages, "prompt": prompt, "first_prompt": start}
        if not self._submit(Job(prompt, self.s.max_answer_tokens, 0.0, 1.0, self.answer_stop,
                                self._answer_done, new), urgent=True):
            self._keep(tag, tag["first_record"])

    def _keep(self, tag: dict[str, Any], record: tuple[list[int], int]) -> None:
        tokens, loss_start = record
        turns = sum(m["role"] == "user" for m in tag["messages"])
        self.writer.add(Record(np.array(tokens, dtype=np.int32), "conversation", loss_start,
                               seed=int(tag["index"]), query=tag["query"],
                               source=tag["source"], key=tag["key"]))
        self.counts[f"kept_{tag['category']}"] += 1
        self.counts[f"kept_turns_{turns}"] += 1
        self.tokens[f"kept_{tag['category']}"] += len(tokens)

