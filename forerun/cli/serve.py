"""``forerun serve``: the OpenAI-compatible server (:mod:`forerun.server`)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from forerun.cli.options import add_model_options, speculative_config
from forerun.errors import ConfigError, ForerunError
from forerun.loading.presets import DEFAULT_MODEL
from forerun.server import INSTALL_HINT, missing_modules
from forerun.server.prefix_cache import PrefixCache
from forerun.speculation.options import add_speculation_flags

DEFAULT_PORT = 8000
DEFAULT_MAX_QUEUE = 64
DEFAULT_PREFIX_CACHE_MB = 1024


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (needs: pip install 'forerun[server]')",
        description="Serve a model over OpenAI's API (/v1/chat/completions, /v1/completions, "
                    "/v1/models), with speculative decoding and an exact prefix cache.")
    add_model_options(p)
    add_speculation_flags(p, serving=True)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default "
                   "127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"port (default {DEFAULT_PORT}; 0 picks a free one)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 requests")
    p.add_argument("--parallel", type=_parallel, default=None, metavar="N",
                   help="requests decoded together, their forwards shared (plain decoding "
                        "and prompt lookup, the torch engine); default: as many as this "
                        "machine decodes at little cost to each, measured at the first start "
                        "and kept (1 with a draft model or the llama.cpp engine)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="requests that may wait for the engine; more get 503 "
                        f"(default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--prefix-cache-mb", type=float, default=DEFAULT_PREFIX_CACHE_MB,
                   help="memory for saved prompt prefixes, in MB (default "
                        f"{DEFAULT_PREFIX_CACHE_MB}; 0 keeps only the last request's cache)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="reuse no cached prefix: every request prefills its whole prompt")
    p.add_argument("--log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    missing = missing_modules()
    if missing:
        raise ForerunError(f"forerun serve needs the server extra, which is not installed "
                           f"(missing: {', '.join(missing)}); install it with: {INSTALL_HINT}")
    _check_options(args)
    from forerun.server.run import bind

    try:   # before the slow part: a port in use fails early
        sock = bind(args.host, args.port)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}; "
                          f"choose another --port (0 picks a free one) or --host") from None
    try:
        service, description = _build_service(args)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        url = f"http://{shown}:{port}/v1"

        def on_listening() -> None:
            print(f"forerun: serving {description} at {url}", flush=True)

        from forerun.server.run import serve

        logging.basicConfig(level=args.log_level.upper(),
                            format="forerun: %(levelname)s: %(message)s")
        serve(service, sock, on_listening=on_listening, log_level=args.log_level)
    finally:
        sock.close()
    print("forerun: server stopped", file=sys.stderr, flush=True)
    return 0


def _parallel(text: str) -> int:
    """``--parallel``'s value: a positive integer, else argparse's error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _check_options(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must lie in 0..65535, got {args.port}")
    if args.max_queue < 1:
        raise ConfigError(f"--max-queue must be at least 1, got {args.max_queue}")
    if not args.prefix_cache_mb >= 0:
        raise ConfigError(f"--prefix-cache-mb must be >= 0, got {args.prefix_cache_mb}")
    if (args.parallel or 1) > 1 and args.engine == "llama.cpp":
        raise ConfigError(f"--parallel {args.parallel}: the llama.cpp engine decodes one "
                          f"request at a time; use --engine torch, or leave --parallel out")
    if args.api_key is not None and not args.api_key.strip():
        raise ConfigError("--api-key is empty; give a key or leave the option out")


def _build_service(args: argparse.Namespace):
    """Load the model (and its draft model), and assemble the server's parts."""
    import forerun
    from forerun.api.busy_threads import ThreadsForLoad
    from forerun.server.app import Service
    from forerun.server.metrics import Metrics
    from forerun.server.translate import Translator
    from forerun.server.worker import EngineWorker

    config = speculative_config(args)   # before the model loads: a bad option fails at once
    name = args.model or DEFAULT_MODEL
    model = forerun.load(name, engine=args.engine, weights=args.weights,
                         context_length=args.context_length, device=args.device,
                         progress=not args.quiet, kv_cache=args.kv_cache)
    drafts = {}
    if config.uses_draft_model:
        # On the target's engine, with its context (in q4-all beside a quantized target).
        loaded = model.draft_model(config.draft)
        drafts = {config.draft: config.draft, loaded.name: config.draft}
    ids = [model.name] + ([name] if name != model.name else [])
    translator = Translator(model, ids, drafts, config)
    # Build the default drafter now, not on the first request.
    model.generate(prompt_ids=[0], max_new_tokens=1, speculative=config)
    prefix_cache = PrefixCache(model.decoder, limit_bytes=int(args.prefix_cache_mb * 2 ** 20),
                               enabled=not args.no_prefix_cache)
    parallel = _slots(model, config, args.parallel)
    worker_ref: list[EngineWorker] = []
    metrics = Metrics(queue_depth=lambda: worker_ref[0].queue_depth,
                      in_flight=lambda: worker_ref[0].in_flight, prefix_cache=prefix_cache,
                      slots=parallel)

    def on_finish(finished) -> None:
        metrics.observe(finished.result, finished.ttft)

    # The thread counts a busy machine may get, probed now (once per machine).
    threads = ThreadsForLoad(model)
    threads.prepare()
    worker: EngineWorker
    if parallel > 1:
        from forerun.server.batch_worker import BatchWorker

        worker = BatchWorker(model, prefix_cache, max_queue=args.max_queue, parallel=parallel,
                             on_finish=on_finish, threads=threads)
    else:
        worker = EngineWorker(model, prefix_cache, max_queue=args.max_queue,
                              on_finish=on_finish, threads=threads)
    worker_ref.append(worker)
    service = Service(translator, worker, metrics, api_key=args.api_key,
                      created=int(time.time()))
    slots = f", {parallel} requests at a time" if parallel > 1 else ""
    return service, (f"{model.name} ({model.decoder.engine}, draft: {config.describe()}"
                     f"{slots})")


def _slots(model, config, asked: int | None) -> int:
    """The requests the server decodes together: ``asked`` (``--parallel``),
    checked against what batches (the engine, the drafter) and what the
    memory holds, or by default the measured count that fits."""
    from forerun.api.engine_policy import available_bytes, measured_parallel, slot_bytes
    batches = model.decoder.capabilities.batch and config.batched
    if asked == 1 or (asked is None and not batches):
        return 1
    if not model.decoder.capabilities.batch:
        raise ConfigError(f"--parallel {asked}: the {model.decoder.engine} engine decodes "
                          f"one request at a time; use --engine torch, or leave --parallel "
                          f"out")
    if not config.batched:
        raise ConfigError(f"--parallel {asked}: requests decoded together use plain decoding, "
                          f"prompt lookup or suffix drafting, not {config.describe()}; pass "
                          f"--draft ngram, --draft suffix or --draft none, or leave --parallel "
                          f"out")
    each = slot_bytes(model)
    free = available_bytes()
    # The first slot's cache is the model's own, already allocated.
    fits = None if free is None else 1 + int(0.9 * free) // each
    if asked is not None:
        if fits is not None and asked > fits:
            raise ConfigError(
                f"--parallel {asked} needs {(asked - 1) * each / 2**30:.1f} GiB more for the "
                f"keys and values of {asked - 1} more sequences of "
                f"{model.decoder.context_length} positions ({each / 2**20:.0f} MiB each), and "
                f"{(free or 0) / 2**30:.1f} GiB is free: at most --parallel {fits} fits (or lower "
                f"--context-length)")
        model.verification_grouping()
        return asked
    measured = measured_parallel(model)["parallel"]
    return max(1, min(measured, fits if fits is not None else measured))
