"""Driving a decoding method: validation, stop conditions, streaming, timing
and cancellation.  The same runner serves every method, so they all stop at
the same token."""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Generator, Sequence

from forerun.decoding.base import DecodingMethod
from forerun.decoding.sampling import TokenSampler
from forerun.decoding.stats import GenerationStats
from forerun.errors import ContextLengthError, GenerationConfigError
from forerun.generation.output import Output
from forerun.generation.params import GenerationParams
from forerun.generation.result import GenerationResult

CancelCheck = Callable[[], bool]


def _cancel_check(cancel) -> CancelCheck | None:
    """Accept a callable returning bool or an object with ``is_set()``."""
    if cancel is None:
        return None
    if hasattr(cancel, "is_set"):
        return cancel.is_set
    if callable(cancel):
        return cancel
    raise GenerationConfigError("cancel must be a callable or a threading.Event")


def check_request(target, prompt_ids: Sequence[int], params: GenerationParams,
                  cancel=None) -> list[int]:
    """Validate a request against the ``target`` decoder before anything
    runs, and return the prompt as a list of ints: every setting valid, the
    prompt non-empty token ids of the model, and prompt plus
    ``max_new_tokens`` within the context."""
    params.validate(target.vocab_size)
    prompt = token_ids(prompt_ids, target.vocab_size)
    if not prompt:
        raise GenerationConfigError("the prompt is empty: give at least one token of input")
    needed = len(prompt) + params.max_new_tokens
    if needed > target.context_length:
        raise ContextLengthError(
            f"the prompt has {len(prompt)} tokens and max_new_tokens is "
            f"{params.max_new_tokens}: {needed} positions, but the context holds "
            f"{target.context_length}. Shorten the prompt, lower max_new_tokens, or load "
            f"the model with a larger context_length.")
    _cancel_check(cancel)
    return prompt


def token_ids(values, vocab_size: int, what: str = "prompt_ids") -> list[int]:
    """``values`` (a sequence, array or 1-D tensor of integers) as a list of
    ints in ``0..vocab_size-1``; anything else (floats, bools, strings, ids
    out of range) is a :class:`GenerationConfigError`."""
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
        if getattr(values, "ndim", 1) != 1:
            raise GenerationConfigError(f"{what} must be one-dimensional, got shape "
                                        f"{tuple(getattr(values, 'shape', ()))}")
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple, range)):
        raise GenerationConfigError(
            f"{what} must be a list of token ids, got {type(values).__name__}")
    ids = []
    for t in values:
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            raise GenerationConfigError(f"{what} must hold integers, got {t!r}")
        n = int(t)
        if not 0 <= n < vocab_size:
            raise GenerationConfigError(
                f"{what} holds {t}, which is not a token of this model (ids are "
                f"0..{vocab_size - 1})")
        ids.append(n)
    return ids


def run_generation(method: DecodingMethod, tokenizer, prompt_ids: Sequence[int],
                   params: GenerationParams, *, eos_token_ids: Sequence[int] = (),
                   cancel=None) -> Generator[str, None, GenerationResult]:
    """Yield text deltas as tokens commit; return the :class:`GenerationResult`
    (as the generator's return value)."""
    target = method.target
    prompt = check_request(target, prompt_ids, params, cancel)
    is_cancelled = _cancel_check(cancel)
    stop_ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        stop_ids.update(eos_token_ids)
    output = Output(tokenizer, max_new_tokens=params.max_new_tokens,
                    stop_token_ids=stop_ids, stop=params.stop)
    stats = GenerationStats(prompt_tokens=len(prompt), method=method.name)
    sampler = TokenSampler(params.sampling, params.seed, target.device,
                           text_tokens=min(tokenizer.vocab_size, target.vocab_size))

    start = time.perf_counter()
    rounds = method.run(prompt, sampler, stats, params.max_new_tokens)
    try:
        for tokens in rounds:
            delta = output.add(tokens)
            if delta:
                yield delta
            if output.finished:
                break
            if is_cancelled is not None and is_cancelled():
                delta = output.cancel()
                if delta:
                    yield delta
                break
    finally:
        rounds.close()
        method.settle(len(prompt) + len(output.tokens))
    stats.decode_seconds = max(0.0, time.perf_counter() - start - stats.prefill_seconds
                               - stats.calibration_seconds)
    stats.new_tokens = len(output.tokens)
    return GenerationResult(list(output.tokens), output.text,
                            output.finish_reason or "cancelled", stats)
