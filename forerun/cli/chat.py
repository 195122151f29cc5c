"""``forerun chat``: a multi-turn chat with a model in the terminal.

The conversation is kept as chat messages and rendered with the model's chat
template, so each turn's prompt starts with the previous one and the model
reads only what is new (:attr:`forerun.Model.reuse_prompts`).  Answers stream
as they are generated.

* Commands: ``/stats`` (the last answer's statistics), ``/reset`` (a new
  conversation), ``/system TEXT`` (set the system message and start over;
  ``/system`` alone removes it), ``/help``, ``/exit`` (or Ctrl-D).  A message
  that starts with ``/`` is sent by doubling the slash (``//etc/hosts ...``).
* Ctrl-C during an answer stops it after the step under way; what it said so
  far stays in the conversation.  A second Ctrl-C abandons it at once (in a
  long prompt's prefill, say): the answer is dropped and the model's cache
  forgotten.
* Ctrl-C at the prompt discards the line being typed, as in Python's own
  prompt; it never ends the session (Ctrl-D or ``/exit`` does).
* A conversation that fills the context is not sent; the chat says so and
  suggests ``/reset``.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import IO, TYPE_CHECKING, Any

from forerun.cli.notices import calibration_notices
from forerun.cli.options import (
    add_model_options,
    add_sampling_options,
    check_generation_options,
    load_model,
    speculative_config,
)
from forerun.cli.stats_report import print_model_stats
from forerun.errors import ForerunError
from forerun.speculation.options import add_speculation_flags

if TYPE_CHECKING:
    from forerun.api.model import Model
    from forerun.generation.result import GenerationResult

PROMPT = ">>> "
#: ``--max-new-tokens`` in a chat: the most tokens of one answer (fewer
#: where the context has less room left)
DEFAULT_MAX_NEW_TOKENS = 1024
HELP = """\
/stats         the last answer's statistics (tokens, tokens/s, prefill time, prompt
               tokens reused from the cache, accepted tokens per verification)
/reset         start a new conversation (the system message stays)
/system TEXT   set the system message and start a new conversation (/system alone
               removes it)
/help          this list
/exit          leave (or Ctrl-D)
Ctrl-C stops an answer (press it twice to abandon it at once); the answer so far stays
in the conversation. A message that starts with / is sent as //message."""

#: A context manager around one answer, giving the Event that stops it.
Stopper = Callable[[], contextlib.AbstractContextManager[threading.Event]]


def add_parser(sub) -> None:
    p = sub.add_parser(
        "chat", help="chat with a model in the terminal",
        description="A multi-turn chat in the terminal: answers stream as they are "
                    "generated, and each turn reads only the new part of the conversation. "
                    "Type /help in the chat for its commands. --max-new-tokens is the most "
                    f"tokens of one answer (default {DEFAULT_MAX_NEW_TOKENS}).")
    add_model_options(p)
    add_sampling_options(p)
    add_speculation_flags(p)
    p.add_argument("--system", default=None,
                   help="the system message (/system in the chat changes it)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    p.set_defaults(max_new_tokens=DEFAULT_MAX_NEW_TOKENS)


def run(args: argparse.Namespace) -> int:
    check_generation_options(args)
    speculative = speculative_config(args)
    with calibration_notices(shown=not args.quiet):
        model = load_model(args, progress=not args.quiet)
        if model.tokenizer.chat_template is None:
            raise ForerunError(f"model {model.name} has no chat template, which forerun chat "
                               f"needs; use forerun generate --raw")
        options = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       min_p=args.min_p, seed=args.seed, stop=args.stop,
                       speculative=speculative)
        # The drafter built now (a draft model loaded, heads read), as
        # forerun generate builds it before any output: a --draft that
        # can't run fails before the first prompt, not at every answer.
        model.generate(prompt_ids=[0], max_new_tokens=1, speculative=speculative)
        model.reset_cache()
        chat = Chat(model, options, max_new_tokens=args.max_new_tokens, system=args.system)
        _use_line_editing()
        chat.say(f"forerun chat with {model.name}; /help lists the commands, /exit or "
                 f"Ctrl-D leaves.")
        talk(chat)
    return 0


def talk(chat: Chat, read: Callable[[str], str] = input) -> None:
    """Read lines with ``read`` and hand them to ``chat`` until EOF or
    ``/exit``.  Ctrl-C at the prompt discards the line."""
    while True:
        try:
            line = read(PROMPT)
        except EOFError:
            chat.say("")
            return
        except KeyboardInterrupt:
            chat.say("\n(line discarded; /exit or Ctrl-D leaves)")
            continue
        try:
            if not chat.handle(line):
                return
        except KeyboardInterrupt:   # between answers (an answer handles its own)
            chat.say("\n[interrupted]")


class Chat:
    """A conversation with ``model``: its messages, the options of every
    answer (``options``: :meth:`~forerun.Model.stream`'s sampling and
    speculation arguments), and the last answer's result.  Everything it
    says goes to ``out``; ``stopper`` gives each answer the Event that stops
    it (default: Ctrl-C, :func:`stop_on_ctrl_c`)."""

    def __init__(self, model: Model, options: dict[str, Any], *, max_new_tokens: int,
                 system: str | None = None, out: IO[str] | None = None,
                 stopper: Stopper | None = None) -> None:
        self.model = model
        self.options = options
        self.max_new_tokens = max_new_tokens
        self.system = system or None
        self.out = out if out is not None else sys.stdout
        self.stopper = stopper or stop_on_ctrl_c
        self.messages: list[dict[str, str]] = self._new_conversation()
        self.last: GenerationResult | None = None

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def handle(self, line: str) -> bool:
        """Act on one line: a command, or a message to answer.  False when
        the chat should end."""
        text = line.strip()
        if not text:
            return True
        if text.startswith("/") and not text.startswith("//"):
            return self.command(text)
        if text.startswith("//"):
            text = text[1:]
        try:
            self.ask(text)
        except ForerunError as exc:
            self.say(f"forerun: error: {exc}")
        return True

    def command(self, text: str) -> bool:
        """Run a ``/command``; False for ``/exit``."""
        name, _, argument = text.partition(" ")
        if name in ("/exit", "/quit"):
            return False
        if name == "/help":
            self.say(HELP)
        elif name == "/reset":
            self.messages = self._new_conversation()
            self.say("[new conversation]")
        elif name == "/system":
            self.system = argument.strip() or None
            self.messages = self._new_conversation()
            self.say("[system message set; new conversation]" if self.system
                     else "[no system message; new conversation]")
        elif name == "/stats":
            self.print_stats()
        else:
            self.say(f"[unknown command {name}: /help lists the commands; a message that "
                     f"starts with / is sent as //message]")
        return True

    def ask(self, text: str) -> None:
        """Answer ``text`` in the conversation, streaming the answer to
        ``out``; the turn joins the conversation once answered (stopped
        answers included)."""
        messages = self.messages + [{"role": "user", "content": text}]
        ids = self.model.encode_prompt(messages=messages)
        context = self.model.decoder.context_length
        room = context - len(ids)
        if room < 1:
            self.say(f"[the conversation fills the context ({len(ids)} tokens of "
                     f"{context}): /reset starts a new one]")
            return
        limit = min(self.max_new_tokens, room)
        try:
            with self.stopper() as cancel:
                with self.model.stream(prompt_ids=ids, max_new_tokens=limit, cancel=cancel,
                                       **self.options) as stream:
                    for delta in stream:
                        self.out.write(shown(delta))
                        self.out.flush()
        except KeyboardInterrupt:
            # Stopped anywhere, a prefill's block included: start the next
            # prompt from an empty cache rather than from half a step.
            self.model.reset_cache()
            self.say("\n[answer abandoned]")
            return
        result = stream.result
        assert result is not None   # the stream ran to its end
        self.out.write("\n")
        self.last = result
        self.messages = messages + [{"role": "assistant", "content": result.text}]
        if result.finish_reason == "cancelled":
            self.say("[stopped]")
        elif result.finish_reason == "length" and limit < self.max_new_tokens:
            self.say(f"[the context is full ({context} tokens): /reset starts a new "
                     f"conversation]")
        elif result.finish_reason == "length":
            self.say(f"[cut at {limit} tokens: --max-new-tokens]")

    def print_stats(self) -> None:
        if self.last is None:
            self.say("[no answer yet]")
            return
        print_model_stats(self.model, self.last, self.out)
        self.out.flush()

    def _new_conversation(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}] if self.system else []


# Control characters but newline and tab: an answer can't move the cursor,
# clear the screen or send the terminal escape sequences.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def shown(text: str) -> str:
    """``text`` as the chat prints it: control characters other than
    newline and tab in caret notation (``^[`` for ESC), C1 ones as U+FFFD."""
    def caret(match: re.Match) -> str:
        code = ord(match.group())
        if code < 0x20:
            return "^" + chr(code + 0x40)
        return "^?" if code == 0x7F else "\ufffd"

    return _CONTROL.sub(caret, text)


@contextlib.contextmanager
def stop_on_ctrl_c() -> Iterator[threading.Event]:
    """While in it, the first Ctrl-C sets the Event it gives (the answer
    stops after the step under way) and a second raises KeyboardInterrupt
    (it stops at once).  Outside the main thread, or where Ctrl-C is
    ignored, Ctrl-C is left as it is."""
    cancel = threading.Event()
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is signal.SIG_IGN):
        yield cancel
        return

    def on_ctrl_c(signum, frame) -> None:
        if cancel.is_set():
            raise KeyboardInterrupt
        cancel.set()

    previous = signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        yield cancel
    finally:
        signal.signal(signal.SIGINT, previous)


def _use_line_editing() -> None:
    """Line editing and history at the prompt, where Python has readline."""
    try:
        import readline  # noqa: F401  (importing it is what makes input() use it)
    except ImportError:
        pass
