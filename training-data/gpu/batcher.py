"""Continuous batching over :class:`target_on_gpu.Target`'s slots: jobs
(a prompt, a token budget, sampling settings, stop ids) wait in a queue,
join free slots between decoding steps (their prompts read together in one
prefill), and leave when they stop; each finished job's callback may queue
new ones (an answer after a query)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Job:
    prompt: list[int]
    max_new: int
    temperature: float = 0.0
    top_p: float = 1.0
    stop_ids: frozenset[int] = frozenset()
    #: called with (job, tokens, finish_reason: "stop" | "length")
    done: Callable[[Job, list[int], str], None] | None = None
    tag: Any = None
    tokens: list[int] = field(default_factory=list)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           gen: torch.Generator) -> torch.Tensor:
    """One token per row: the argmax where ``temperature`` is 0, else drawn
    from the tempered distribution cut to its ``top_p`` nucleus."""
    out = logits.argmax(-1)
    drawn = torch.nonzero(temperature > 0).flatten()
    if drawn.numel():
        probs = torch.softmax(logits[drawn] / temperature[drawn, None], dim=-1)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        outside = (sorted_p.cumsum(-1) - sorted_p) >= top_p[drawn, None]
        sorted_p = sorted_p.masked_fill(outside, 0.0)
        choice = torch.multinomial(sorted_p, 1, generator=gen)
        out[drawn] = order.gather(1, choice).flatten()
    return out


class Batcher:
    """Runs jobs on ``target``'s slots (module text).  ``urgent`` jobs go
    before the others (answers of queries made, so conversations finish)."""

    def __init__(self, target, *, seed: int = 0, admit_fraction: float = 0.125,
                 prefill_tokens: int = 32768) -> None:
        self.target = target
        self.slots = target.slots
        self.device = target.device
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        self.urgent: deque[Job] = deque()
        self.waiting: deque[Job] = deque()
        self.running: list[Job | None] = [None] * self.slots
        self.positions = [0] * self.slots
        self.admit_at = max(1, int(admit_fraction * self.slots))
        self.prefill_tokens = prefill_tokens
        self.temperature = torch.zeros(self.slots, device=self.device)
        self.top_p = torch.ones(self.slots, device=self.device)
        self.steps = 0
        self.generated = 0
        self.prefilled = 0

    def submit(self, job: Job, *, urgent: bool = False) -> bool:
        """Queue ``job``; False (and nothing queued) when its prompt and
        budget don't fit a slot."""
        if not job.prompt or len(job.prompt) + job.max_new > self.target.max_len:
            return False
        (self.urgent if urgent else self.waiting).append(job)
        return True

    @property
    def busy(self) -> int:
        return sum(j is not None for j in self.running)

    @property
    def queued(self) -> int:
        return len(self.urgent) + len(self.waiting)

    def _admit(self) -> None:
        free = [s for s, j in enumerate(self.running) if j is None]
        if not free or not self.queued or (len(free) < self.admit_at and self.busy):
            return
        take: list[Job] = []
        width = 0
        while free[len(take):] and self.queued:
            queue = self.urgent if self.urgent else self.waiting
            job = queue[0]
            w = max(width, len(job.prompt))
            if take and w * (len(take) + 1) > self.prefill_tokens:
                break
            queue.popleft()
            take.append(job)
            width = w
        slots = free[:len(take)]
        logits = self.target.prefill(slots, [j.prompt for j in take])
        self.prefilled += sum(len(j.prompt) for j in take)
        index = torch.tensor(slots, device=self.device)
        self.temperature[index] = torch.tensor([j.temperature for j in take],
                                               device=self.device)
        self.top_p[index] = torch.tensor([j.top_p for j in take], device=self.device)
        first = sample(logits, self.temperature[index], self.top_p[index], self.gen).tolist()
        for s, job, token in zip(slots, take, first):
            self.running[s] = job
            self.positions[s] = len(job.prompt)
            self._push(s, job, token)

    def _push(self, s: int, job: Job, token: int) -> None:
        job.tokens.append(token)
        self.generated += 1
        reason = None
        if token in job.stop_ids:
            reason = "stop"
        elif len(job.tokens) >= job.max_new or self.positions[s] + 1 >= self.target.max_len:
            reason = "length"
        if reason is not None:
            self.running[s] = None
            if job.done is not None:
                job.done(job, job.tokens, reason)

    def step(self) -> None:
        """Admit what fits, then one decoding step of every running slot."""
        self._admit()
        live = [s for s, j in enumerate(self.running) if j is not None]
        if not live:
            return
        tokens = [0] * self.slots
        for s in live:
            tokens[s] = self.running[s].tokens[-1]
        positions = list(self.positions)
        length = max(positions[s] for s in live) + 1
        logits = self.target.decode(torch.tensor(tokens, device=self.device),
                                    torch.tensor(positions, device=self.device), length)
        chosen = sample(logits, self.temperature, self.top_p, self.gen).tolist()
        self.steps += 1
        for s in live:
            job = self.running[s]
            self.positions[s] += 1
            self._push(s, job, chosen[s])

    def run(self, until: float, *, idle: Callable[[], bool] | None = None) -> str:
        """Step until ``until`` (a ``time.monotonic()`` deadline: "time"), or
        until nothing runs or waits and ``idle()`` (which may queue more)
        returns False ("done")."""
        while time.monotonic() < until:
            if not self.busy and not self.queued and (idle is None or not idle()):
                return "done"
            if idle is not None and self.queued < self.slots:
                idle()
            self.step()
        return "time"
