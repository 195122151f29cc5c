"""What the adaptive drafting policies would make of the bench's prompts at
fixed, measured costs: their choices replayed without timing noise.

    python benchmarks/policy_replay.py --continuations FILE.json \\
        [--predictions FILE.json] [--margins 0,0.05] [--fixed-k 1,2,3] \\
        [--verify-ms 65.5,79.7,84.0,97.3,126.6,141.1,174.1,207.1,211.5] \\
        [--draft-step-ms 24.6] [--draft-read-ms 4.6]

On this shared VM two runs of the same generation differ by 5 to 30%, more
than a policy change moves them, so a policy is compared here on a model of
the machine instead.  Greedy chain speculation is deterministic given what
the draft predicts: a drafted token is accepted exactly when the draft's
argmax, given the committed tokens, is the target's token.  So the target's
greedy answers (``--continuations``, as ``draft_acceptance.py`` keeps them)
and the draft's teacher-forced argmax at every position (``--predictions``,
computed once with the draft model at its default window and kept) say
what every round of any policy accepts.  Each policy then runs as it does
in forerun, its own classes (the chain planner, the lookup-or-draft
planner, prompt lookup's real drafter) on the real token sequences, with a
stand-in for the draft model that proposes what the draft predicted and
charges measured times:

* a target forward of ``T`` positions: ``--verify-ms`` (T = 1, 2, ..; the
  engine's calibration measures the same; a plain step is T = 1);
* a draft feed of ``n`` tokens: ``--draft-step-ms + (n - 1) * --draft-read-ms``
  (a draft step is one token; a catch-up reads the tokens of plain and
  lookup rounds, and the prompt's view on the first draft).

It prints each method's decoding-time speedup over plain steps per category
(prefill excluded: it is the same for every method; the draft's read of the
prompt counts), for every policy margin of ``--margins``
(:data:`forerun.decoding.draft_length.DRAFT_MARGIN`), and for the draft
model at the fixed lengths of ``--fixed-k``.  One planner serves all the
turns of a method, in the bench's order, as in `forerun bench`.

It is a model, not a measurement: it leaves out a round's own overhead and
the target's confidence (a planner learns only from the rounds it drafts,
where forerun's also learn from the target's confidence in the others); the
teacher-forced predictions come from batched feeds; a conversation's second
turn reads its prompt's whole view again, where forerun's draft keeps its
cache from the first.  `forerun bench` measures.  It times nothing, so it
may run beside anything (the models load once, for the answers and the
predictions the files do not hold yet).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from draft_acceptance import continuations, draft_predictions, window_view
from harness import DRAFT, bench_prompts, load_model, model_options, parser

from forerun.decoding.draft_length import ChainPlanner, refine_seconds
from forerun.decoding.drafter import Draft
from forerun.decoding.sampling import SamplingParams, TokenSampler
from forerun.drafters.draft_context import READ_PRIOR, TIMED_READ
from forerun.drafters.draft_window import DEFAULT_DRAFT_WINDOW
from forerun.drafters.lookup_or_draft_planner import LookupOrDraftPlanner
from forerun.drafters.ngram import NgramDrafter


class Clock:
    """The model of the machine: what each forward costs, and the time spent."""

    def __init__(self, verify_ms: list[float], step_ms: float, read_ms: float) -> None:
        self.verify_ms, self.step_ms, self.read_ms = verify_ms, step_ms, read_ms
        self.seconds = 0.0

    def verify(self, t: int) -> float:
        ms = self.verify_ms
        return (ms[t - 1] if t <= len(ms) else ms[-1] * t / len(ms)) / 1000

    def draft_feed(self, n: int) -> float:
        return (self.step_ms + (n - 1) * self.read_ms) / 1000


class ReplayedDraft:
    """The draft model as the policies see it (a chain drafter that reads
    the committed sequence, :class:`~forerun.decoding.drafter.ReadsContext`),
    proposing what the real draft predicted and charging the clock for its
    feeds as :class:`~forerun.drafters.draft_model.DraftModelDrafter` makes
    them: the tokens its cache lacks in one feed, then a token a step."""

    name = "draft"

    def __init__(self, clock: Clock, window: int | None) -> None:
        self.clock, self.window = clock, window
        self.prompt: list[int] = []
        self.output: list[int] = []
        self.predicted: list[int] = []
        self.skipped = 0
        self.held = 0                       # view tokens its cache holds rightly
        self.read_ema: float | None = None

    def turn(self, prompt: list[int], output: list[int], predicted: list[int]) -> None:
        self.prompt, self.output, self.predicted = prompt, output, predicted

    def begin(self, prompt_ids) -> None:
        self.skipped = len(prompt_ids) - len(window_view(list(prompt_ids), self.window))
        self.held = 0

    def step_seconds(self) -> float:
        return self.clock.draft_feed(1)

    def catch_up_seconds(self, sequence, rounds: int) -> float:
        missing = max(0, len(sequence) - self.skipped - self.held - 1)
        if not missing:
            return 0.0
        per_token = self.read_ema if self.read_ema is not None else \
            READ_PRIOR * self.step_seconds()
        return per_token * missing / max(1, rounds)

    def propose(self, sequence, k: int, sampler) -> Draft:
        view = len(sequence) - self.skipped
        todo = max(1, view - self.held)
        seconds = self.clock.draft_feed(todo)
        if todo >= TIMED_READ:
            self.read_ema = refine_seconds(self.read_ema, seconds / todo)
        self.clock.seconds += seconds + (k - 1) * self.clock.draft_feed(1)
        j = len(sequence) - len(self.prompt)      # the output token drafted first
        tokens, right = [], 0
        for i in range(k):
            if j + i >= len(self.output):
                break
            hit = self.predicted[j + i] == self.output[j + i]
            if hit and right == i:
                right += 1
            tokens.append(self.output[j + i] if hit and right > i else -1)
        # fed: the view, then the first k - 1 drafts (right ones stay)
        self.held = view + min(right, k - 1)
        return Draft(tokens)

    def observe(self, sequence, accepted: int) -> None:
        pass

    def settle(self, length: int) -> None:
        pass


def replay(planner, clock: Clock, prompt: list[int], output: list[int],
           max_new_tokens: int | None = None) -> float:
    """Decoding seconds of ``planner`` generating ``output`` after ``prompt``,
    in a generation of at most ``max_new_tokens``."""
    sampler = TokenSampler(SamplingParams(temperature=0.0), seed=0)
    clock.seconds = 0.0
    planner.begin(prompt, max_new_tokens)
    sequence = list(prompt) + output[:1]          # the prefill's token
    while len(sequence) - len(prompt) < len(output):
        tree = planner.draft(sequence, None, 1 << 20, sampler)
        drafts = tree.tokens[1:]
        j = len(sequence) - len(prompt)
        accepted = 0
        while (accepted < len(drafts) and j + accepted < len(output)
               and drafts[accepted] == output[j + accepted]):
            accepted += 1
        clock.seconds += clock.verify(len(tree.tokens))
        sequence.extend(output[j:j + accepted + 1])
        planner.learn(sequence, tree, list(range(accepted + 1)))
    return clock.seconds


def predictions(turns: list[dict], args, path: Path | None) -> list[list[int]]:
    """The draft's teacher-forced argmax on every turn (kept in ``path``)."""
    key = {"turns": [[t["label"], t["turn"], len(t["output"])] for t in turns],
           "window": args.window}
    if path is not None and path.exists():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return saved["predicted"]
    draft = load_model(args, model=args.draft, weights="q4-all")
    out = [draft_predictions(draft, window_view(t["prompt"], args.window), t["output"])[None]
           for t in turns]
    if path is not None:
        path.write_text(json.dumps({"key": key, "predicted": out}))
    return out


def main() -> None:
    p = model_options(parser(__doc__), draft=DRAFT)
    p.add_argument("--limit", type=int, default=3, help="prompts per category")
    p.add_argument("--categories", default=None)
    p.add_argument("-n", type=int, default=128, help="new tokens per turn")
    p.add_argument("--continuations", type=Path, required=True)
    p.add_argument("--predictions", type=Path, default=None)
    p.add_argument("--window", type=int, default=DEFAULT_DRAFT_WINDOW)
    p.add_argument("--verify-ms", default="65.5,79.7,84.0,97.3,126.6,141.1,174.1,207.1,211.5")
    p.add_argument("--draft-step-ms", type=float, default=24.6)
    p.add_argument("--draft-read-ms", type=float, default=4.6)
    p.add_argument("--margins", default="0,0.05",
                   help="the policies' margins to compare (DRAFT_MARGIN)")
    p.add_argument("--fixed-k", default="",
                   help="also the draft model at these fixed lengths, e.g. 1,2,3 (no policy)")
    args = p.parse_args()
    verify_ms = [float(v) for v in args.verify_ms.split(",")]

    prompts = bench_prompts(args.limit, args.categories)
    target = load_model(args)
    turns = continuations(target, prompts, args.n, args.continuations)
    del target
    predicted = predictions(turns, args, args.predictions)
    categories = list(dict.fromkeys(t["category"] for t in turns))

    print(f"verify ms {verify_ms}, draft step {args.draft_step_ms} ms, read "
          f"{args.draft_read_ms} ms a token, window {args.window}")
    header = "| method | margin | " + " | ".join(categories) + " | overall |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    fixed = [f"draft-k{k}" for k in args.fixed_k.split(",") if k.strip()]
    for margin in (float(m) for m in args.margins.split(",")):
        for method in ("ngram", "draft", "draft-lookup", *fixed):
            plain, spent = defaultdict(float), defaultdict(float)
            # One planner for every turn, in the bench's order, as a method
            # object of `forerun bench` (its estimates carry over).
            clock = Clock(verify_ms, args.draft_step_ms, args.draft_read_ms)
            draft = ReplayedDraft(clock, args.window)
            if method == "ngram":
                planner = ChainPlanner(NgramDrafter())
            elif method == "draft":
                planner = ChainPlanner(draft)
            elif method.startswith("draft-k"):
                planner = ChainPlanner(draft, k=int(method[len("draft-k"):]))
            else:
                planner = LookupOrDraftPlanner(draft, NgramDrafter())
            policy = planner.policy
            policy.margin = margin
            policy.costs.seconds[1:] = [clock.verify(i)
                                        for i in range(1, len(policy.costs.seconds))]
            for t, pred in zip(turns, predicted):
                draft.turn(t["prompt"], t["output"], pred)
                spent[t["category"]] += replay(planner, clock, t["prompt"], t["output"], args.n)
                plain[t["category"]] += clock.verify(1) * (len(t["output"]) - 1)
            cells = [f"{plain[c] / spent[c]:.3f}x" for c in categories]
            overall = sum(plain.values()) / sum(spent.values())
            print(f"| {method} | {margin:g} | " + " | ".join(cells) + f" | {overall:.3f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
