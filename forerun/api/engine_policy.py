"""What forerun measures about a model's engine on this machine, and where
it keeps it: the largest verification group the engine computes exactly
(the grouping probe), what verifying 1, 2, ... positions costs, and how
many sequences it decodes together cheaply (``forerun serve``'s default
``--parallel``).

All are kept per machine in forerun's cache
(:class:`~forerun.machine.calibration.CalibrationStore`), keyed by the
model's identity and the engine settings that decide its kernels
(:attr:`~forerun.protocol.decoder.EngineSettings.key`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from forerun.machine.calibration import CalibrationStore
from forerun.protocol import grouping_probe
from forerun.protocol.grouping_probe import MAX_GROUP, GroupingResult

if TYPE_CHECKING:
    from forerun.api.model import Model

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


def model_identity(model: Model) -> str:
    """The model as calibration records know it: its name and shape."""
    c = model.config
    return f"{model.name}|{c.architecture}|{c.num_layers}x{c.hidden_size}|{c.vocab_size}"


def probe_tokens(model: Model, n: int) -> list[int]:
    """``n`` token ids of :data:`PROBE_TEXT`, repeated as needed."""
    ids: list[int] = []
    while len(ids) < n:
        ids += model.tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    return ids[:n]


def probe_contexts(model: Model) -> tuple[int, ...]:
    """Cached lengths the grouping probe runs at: a short prompt, and the
    engine's long one (past the lengths where its kernels switch)."""
    room = model.decoder.context_length - 16
    return tuple(sorted({min(32, room), min(model.decoder.probe_context, room)}))


def measured_grouping(model: Model, threads: int | None = None) -> GroupingResult:
    """The grouping probe's result for ``model`` on this machine (kept in
    forerun's cache): for verifications on ``threads`` threads against
    plain decoding on the decoder's own count, when given."""
    decoder = model.decoder
    contexts = probe_contexts(model)
    key = {"model": model_identity(model), **decoder.settings.key,
           "contexts": list(contexts)}
    if threads is not None:
        key["verified_on_threads"] = threads
    store = CalibrationStore("grouping", key, label=f"{model.name}-{decoder.engine}")
    largest = decoder.group_ceiling or MAX_GROUP
    return store.load_or_measure(
        GroupingResult.from_dict,
        lambda: grouping_probe.exact_group_size(
            decoder, probe_tokens(model, max(contexts) + largest), contexts=contexts,
            threads=threads, max_group=largest),
        f"which verification groups {model.name} computes exactly", GroupingResult.to_dict)


def cost_store(model: Model, tag: str = "") -> CalibrationStore:
    """Where the measured verification costs of ``model`` on this machine
    are kept, so the adaptive draft length calibrates once per model,
    engine settings (weight format, threads, options), CPU and context.
    ``tag`` names the method when its costs differ from a chain's
    (``"+tree"``, ``"+draft-tree"``, ``"+async-D+T"``).  ``timing`` names how
    the sizes were timed (interleaved, since costs timed size after size
    could be bent by one slow spell), so curves timed the old way are
    measured again."""
    decoder = model.decoder
    key = {"model": model_identity(model), **decoder.settings.key,
           "context_length": decoder.context_length,
           "verify_group": decoder.verify_group, "method": tag or "chain",
           "timing": "interleaved"}
    return CalibrationStore("costs", key, label=f"{model.name}-{decoder.engine}{tag}")


#: A slot count is the default of ``forerun serve`` while one forward of
#: that many sequences (a position each) costs at most this many times one
#: sequence's: each request then keeps at least 1/1.5 of its speed alone.
PARALLEL_COST = 1.5


def measured_parallel(model: Model) -> dict:
    """How many sequences this machine decodes together at little cost to
    each: one forward of ``R`` sequences, a position each after a 64-token
    prompt, timed for ``R = 1 ..`` the exact verification group (at most
    16), sizes interleaved over rounds, and the largest ``R`` whose forward
    costs at most :data:`PARALLEL_COST` times one position's (kept in
    forerun's cache).  ``{"parallel": R, "ms": {R: milliseconds}}``; 1 on
    an engine that can't batch."""
    import time

    decoder = model.decoder
    if not decoder.capabilities.batch:
        return {"parallel": 1, "ms": {}}
    largest = min(16, model.verification_grouping().exact_group)
    key = {"model": model_identity(model), **decoder.settings.key,
           "verify_group": decoder.verify_group, "largest": largest}
    store = CalibrationStore("parallel", key, label=f"{model.name}-{decoder.engine}")

    def valid(value):
        ok = (isinstance(value, dict) and isinstance(value.get("parallel"), int)
              and 1 <= value["parallel"] <= largest)
        return value if ok else None

    def measure() -> dict:
        prompt = probe_tokens(model, 64)
        members = [decoder] + [decoder.fork() for _ in range(largest - 1)]
        for m in members:
            m.reset()
            m.feed(prompt, last_only=True)
        best = dict.fromkeys(range(1, largest + 1), float("inf"))
        for _ in range(3):
            for r in best:
                start = time.perf_counter()
                decoder.feed_batch([(m, prompt[:1]) for m in members[:r]])
                best[r] = min(best[r], time.perf_counter() - start)
                for m in members[:r]:
                    m.rollback(len(prompt))
        decoder.reset()
        fits = [r for r, s in best.items() if s <= PARALLEL_COST * best[1]]
        return {"parallel": max(fits), "ms": {str(r): round(s * 1000, 2)
                                              for r, s in best.items()}}

    return store.load_or_measure(valid, measure,
                                 f"how many sequences {model.name} decodes together cheaply")


def slot_bytes(model: Model) -> int:
    """Memory one more sequence of ``model`` holds at its whole context: its
    keys and values, in its cache's dtype (the torch engine's: float16
    where forerun's native layers run, else the activations')."""
    c = model.config
    cache = getattr(model.decoder, "cache", None)
    size = cache.keys.element_size() if cache is not None else 4
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * model.decoder.context_length * size


def available_bytes() -> int | None:
    """The memory the system can still give (``MemAvailable``), or None
    where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
