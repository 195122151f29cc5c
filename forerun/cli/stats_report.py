"""What ``--stats`` prints after a generation (``forerun generate``, and
``/stats`` in ``forerun chat``): what ran the model and its draft, the
timings, the drafting counters, how asynchronous drafting did."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forerun.protocol.decoder import EngineSettings


def print_model_stats(model, result, out) -> None:
    """:func:`print_stats` of a generation of ``model``, with what ran it
    and its draft model."""
    drafts = [d for d in model.drafts if d is not model]
    print_stats(result, out, model.decoder.settings,
                drafts[-1].decoder.settings if drafts else None)


def print_stats(result, out, settings: EngineSettings | None = None,
                draft_settings: EngineSettings | None = None) -> None:
    s = result.stats
    lines = [engine_line(settings)] if settings else []
    if draft_settings:
        lines.append(engine_line(draft_settings, "draft engine"))
    lines += [f"method: {s.method}",
             f"finish reason: {result.finish_reason}",
             f"prompt tokens: {s.prompt_tokens} ({s.reused_prompt_tokens} reused from the "
             f"cache)",
             f"new tokens: {s.new_tokens}",
             f"prefill: {s.prefill_seconds:.3f} s"]
    if s.calibration_seconds:
        lines.append(f"calibration: {s.calibration_seconds:.3f} s (this machine's "
                     f"verification costs, measured once and stored)")
    lines.append(f"decode: {s.decode_seconds:.3f} s ({s.tokens_per_second:.2f} tokens/s)")
    if s.rounds:
        hist = " ".join(f"{k}:{v}" for k, v in sorted(s.accepted_histogram.items()))
        lines += [f"rounds: {s.rounds}",
                  f"drafted: {s.drafted}, accepted: {s.accepted} "
                  f"(acceptance rate {s.acceptance_rate:.3f})",
                  f"mean accepted tokens per target forward: {s.mean_accepted_tokens:.2f}",
                  f"accepted-length histogram: {hist}",
                  f"time: drafting {s.draft_seconds:.3f} s, verifying {s.verify_seconds:.3f} s, "
                  f"other {s.other_seconds:.3f} s"]
        if s.asynchronous:
            lines += async_lines(s)
        if s.verify_group == 1:
            lines.append("verification: one position per forward (no grouping of positions "
                         "is exact on this machine's kernels; speculative decoding stays "
                         "exact but gains little)")
        elif s.verify_group is not None:
            lines.append(f"verification: up to {s.verify_group} positions per forward "
                         f"(the largest exact group measured on this machine)")
    out.write("\n".join(lines) + "\n")


def engine_line(settings: EngineSettings, label: str = "engine") -> str:
    """What ran the model (or, under another ``label``, its draft model):
    engine, device, weight format and kernels, threads."""
    from forerun.engines.linear import QUANTIZED_FORMATS

    line = f"{label}: {settings.engine} on {settings.device}"
    if settings.weights is not None:
        line += f", weights {settings.weights}"
        if settings.kernels == "native":
            line += f" (forerun's native kernels, {settings.instruction or 'avx2'})"
        elif settings.kernels is not None and settings.weights in QUANTIZED_FORMATS:
            line += " (torch's kernels)"
    n = settings.threads
    return line + f", {n} thread{'' if n == 1 else 's'}"


def async_lines(s) -> list[str]:
    """What --stats says about asynchronous drafting: the split, the
    overlap, the discarded drafts, and whether it paid."""
    hidden = s.overlap_seconds / s.drafter_seconds if s.drafter_seconds > 0 else 0.0
    lines = [f"asynchronous drafting: draft on {s.draft_threads} thread(s), model on "
             f"{s.target_threads}; the drafter drafted for {s.drafter_seconds:.3f} s, "
             f"{s.overlap_seconds:.3f} s of it hidden behind verification ({hidden:.0%}); "
             f"the model waited {s.wait_seconds:.3f} s for proposals; {s.discarded} drafted "
             f"tokens discarded (drafted from a rejected context)"]
    if s.async_pays is not None:
        plan = (f"synchronous drafting with k={s.sync_draft_length}" if s.sync_draft_length
                else "plain decoding")
        verdict = "pays" if s.async_pays else "does not pay"
        lines.append(f"asynchronous drafting {verdict} on this machine: "
                     f"{s.async_tokens_per_second:.2f} tokens/s over waiting and verifying, "
                     f"against {s.sync_tokens_per_second:.2f} estimated for {plan} from "
                     f"this machine's measured costs")
    elif s.drafted < 1:
        lines.append("asynchronous drafting: no verdict: it drafted nothing")
    return lines
