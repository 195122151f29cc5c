"""``forerun chat``: the conversation and its commands on a tiny model
(without a terminal), Ctrl-C, and the whole chat in a real terminal under
tmux."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

import forerun
from forerun.cli.chat import HELP, PROMPT, Chat, shown, stop_on_ctrl_c, talk
from forerun.cli.main import main
from tiny_models import hf_folders

BLOCK = 16   # prefill block of the tiny model here: a short chat spans several


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = hf_folders(tmp_path_factory, (7,), prefix="chat")[0]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FORERUN_CACHE", str(tmp_path_factory.mktemp("chat-cache")))
        loaded = forerun.load(folder, context_length=160, device="cpu", weights="float32",
                              progress=False)
        loaded.decoder.prefill_block = BLOCK
        yield loaded


@contextlib.contextmanager
def never_stopped():
    yield threading.Event()


@contextlib.contextmanager
def stopped_at_once():
    """Ctrl-C pressed as the answer starts: it stops after its first step."""
    cancel = threading.Event()
    cancel.set()
    yield cancel


def chat_of(model, stopper=never_stopped, max_new_tokens=8, system=None, **options) -> Chat:
    return Chat(model, options, max_new_tokens=max_new_tokens, system=system,
                out=io.StringIO(), stopper=stopper)


def said(chat: Chat) -> str:
    out = chat.out
    assert isinstance(out, io.StringIO)
    return out.getvalue()


# -- the conversation ----------------------------------------------------------------

def test_each_turn_extends_the_conversation_and_reuses_its_prefill(model):
    chat = chat_of(model, system="the quick brown fox jumps over the lazy dog")
    assert chat.handle("hello world, the quick brown fox")
    first = chat.last
    assert first is not None and first.text in said(chat), said(chat)
    assert chat.handle("and the lazy dog?")
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user",
                                                  "assistant"]
    assert chat.messages[2]["content"] == first.text
    second = chat.last
    assert second is not None and second.stats.reused_prompt_tokens >= 2 * BLOCK
    # The same turn from a cold cache gives the same answer.
    model.reset_cache()
    cold = model.generate(messages=chat.messages[:4], max_new_tokens=8)
    assert cold.tokens == second.tokens
    chat.handle("/stats")
    assert f"({second.stats.reused_prompt_tokens} reused from the cache)" in said(chat)
    assert "tokens/s" in said(chat) and "prefill:" in said(chat)


def test_stats_of_a_speculative_answer_say_what_was_accepted(model):
    chat = chat_of(model, draft="ngram")
    chat.handle("/stats")
    assert "[no answer yet]" in said(chat)
    chat.handle("the quick brown fox jumps over the lazy dog, the quick brown fox")
    chat.handle("/stats")
    assert "mean accepted tokens per target forward" in said(chat)


def test_commands(model):
    chat = chat_of(model)
    chat.handle("hello")
    assert len(chat.messages) == 2
    assert chat.handle("/reset") and chat.messages == []
    assert "[new conversation]" in said(chat)
    chat.handle("/system Be brief.")
    assert chat.messages == [{"role": "system", "content": "Be brief."}]
    chat.handle("hello")
    assert chat.messages[0]["content"] == "Be brief." and len(chat.messages) == 3
    chat.handle("/reset")
    assert chat.messages == [{"role": "system", "content": "Be brief."}]
    chat.handle("/system")
    assert chat.messages == [] and "[no system message" in said(chat)
    chat.handle("/help")
    assert HELP in said(chat)
    chat.handle("/frobnicate now")
    assert "unknown command /frobnicate" in said(chat) and chat.messages == []
    chat.handle("   ")
    assert chat.messages == []
    chat.handle("//etc/hosts, hello")            # a message that starts with /
    assert chat.messages[0] == {"role": "user", "content": "/etc/hosts, hello"}
    assert chat.handle("/exit") is False
    assert chat.handle("/quit") is False


def test_a_stopped_answer_stays_in_the_conversation(model):
    chat = chat_of(model, stopper=stopped_at_once, max_new_tokens=50, ignore_eos=True)
    chat.handle("hello world")
    assert chat.last is not None and chat.last.finish_reason == "cancelled"
    assert 1 <= len(chat.last.tokens) < 50
    assert "[stopped]" in said(chat)
    assert chat.messages[-1] == {"role": "assistant", "content": chat.last.text}


def test_an_abandoned_answer_is_dropped_and_the_chat_goes_on(model, monkeypatch):
    """A second Ctrl-C (a KeyboardInterrupt inside the generation) drops
    the answer and forgets the cache; the next turn runs as if cold."""
    chat = chat_of(model)
    chat.handle("hello world")
    before = list(chat.messages)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(model.decoder, "feed", interrupted)
    chat.handle("the lazy dog")
    monkeypatch.undo()
    assert "[answer abandoned]" in said(chat)
    assert chat.messages == before and model.decoder.length == 0
    chat.handle("the lazy dog")
    assert chat.last is not None and chat.last.stats.reused_prompt_tokens == 0
    assert len(chat.messages) == 4


def test_a_full_context_is_refused_with_advice(model):
    chat = chat_of(model, max_new_tokens=1000, ignore_eos=True)
    chat.handle("hello")
    answer = chat.last
    assert answer is not None and answer.finish_reason == "length"
    assert f"[the context is full ({model.decoder.context_length} tokens): /reset" \
        in said(chat)
    kept = list(chat.messages)
    chat.handle("the quick brown fox jumps over the lazy dog")
    assert "[the conversation fills the context" in said(chat)
    assert chat.messages == kept                 # the turn was not taken
    chat.handle("/reset")
    chat.handle("hello")
    assert chat.last is not answer


def test_an_answer_cut_at_max_new_tokens_says_so(model):
    chat = chat_of(model, max_new_tokens=3, ignore_eos=True)
    chat.handle("hello")
    assert "[cut at 3 tokens: --max-new-tokens]" in said(chat)


def test_an_error_in_a_turn_is_said_and_the_chat_goes_on(model):
    chat = chat_of(model, top_p=5.0)          # refused by the model, not by the chat
    assert chat.handle("hello")
    assert "forerun: error: " in said(chat) and "top_p" in said(chat)
    assert chat.messages == []


def test_ctrl_c_at_the_prompt_discards_the_line_and_eof_leaves(model):
    chat = chat_of(model)
    lines = iter([KeyboardInterrupt, "hello", EOFError])
    prompts = []

    def read(prompt):
        prompts.append(prompt)
        line = next(lines)
        if isinstance(line, type):
            raise line
        return line

    talk(chat, read)
    assert prompts == [PROMPT] * 3
    assert "(line discarded; /exit or Ctrl-D leaves)" in said(chat)
    assert len(chat.messages) == 2


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signal handlers are set in the main thread")
def test_the_first_ctrl_c_stops_the_answer_and_the_second_abandons_it():
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        pytest.skip("Ctrl-C is ignored in this process")
    with stop_on_ctrl_c() as cancel:
        signal.raise_signal(signal.SIGINT)
        assert cancel.is_set()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    before = signal.getsignal(signal.SIGINT)
    with stop_on_ctrl_c():
        assert signal.getsignal(signal.SIGINT) is not before
    assert signal.getsignal(signal.SIGINT) is before


def test_an_answer_cannot_send_the_terminal_control_sequences():
    assert shown("a\x1b[2Jb\rc\x07\x7f\x9b\td\ne é") == "a^[[2Jb^Mc^G^?\ufffd\td\ne é"


def test_options_are_checked_before_a_model_loads(capsys):
    assert main(["chat", "-m", "/nonexistent", "--temperature", "-1"]) == 1
    err = capsys.readouterr().err
    assert "temperature" in err and "/nonexistent" not in err and "Traceback" not in err
    assert main(["chat", "-m", " "]) == 1
    assert "--model is empty" in capsys.readouterr().err


def test_a_drafter_that_cannot_run_fails_before_the_first_prompt(model, tmp_path):
    """As forerun generate refuses it before any output (a chat once started
    and failed every answer)."""
    from tiny_gguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    for draft in ("nonsense", "eagle:/nonexistent/head"):
        run = subprocess.run([sys.executable, "-m", "forerun.cli.main", "chat", "-m", str(gguf),
                              "--weights", "float32", "-q", "--draft", draft],
                             input="hello\n/exit\n", capture_output=True, text=True,
                             timeout=600)
        assert run.returncode == 1, run.stderr
        assert "forerun: error:" in run.stderr and "Traceback" not in run.stderr
        assert PROMPT.strip() not in run.stdout and "/help lists" not in run.stdout


# -- in a terminal ---------------------------------------------------------------------

TMUX = shutil.which("tmux")
SYSTEM = "You answer questions about the quick brown fox and the lazy dog. " * 5


# Runs a command and writes its exit status to a file (tmux 3.3 does not
# always know a dead pane's status); Ctrl-C reaches the command alone.
STATUS_WRAPPER = """
import signal, subprocess, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
status = subprocess.call(sys.argv[2:],
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
open(sys.argv[1], "w").write(str(status))
"""


class Terminal:
    """A tmux server of the test's own (its socket in ``root``) running one
    command in a 200x50 pane that stays after the command ends."""

    def __init__(self, root, command: list[str], env: dict[str, str]) -> None:
        self.socket = str(root / "tmux.sock")
        self.status_file = root / "status"
        config = root / "tmux.conf"
        config.write_text("set -g remain-on-exit on\nset -g history-limit 10000\n")
        wrapped = [sys.executable, "-c", STATUS_WRAPPER, str(self.status_file), *command]
        self.tmux("-f", str(config), "new-session", "-d", "-s", "chat", "-x", "200",
                  "-y", "50", " ".join(shlex.quote(c) for c in wrapped), env=env)

    def tmux(self, *args: str, env: dict[str, str] | None = None) -> str:
        assert TMUX is not None
        return subprocess.run([TMUX, "-S", self.socket, *args], check=True, text=True,
                              capture_output=True, env=env).stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-J", "-S", "-10000", "-t", "chat")

    def send(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "chat", *keys)

    def wait_for(self, what: str, ready) -> str:
        """The screen once ``ready(screen)`` holds; an error once the chat
        has ended without it, or after minutes (a guard against a hung chat,
        not a timing)."""
        deadline = time.monotonic() + 300
        while True:
            ended = self.status() is not None      # (then the screen is final)
            text = self.screen()
            if ready(text):
                return text
            if ended or time.monotonic() > deadline:
                raise AssertionError(f"no {what} on the screen (exit status "
                                     f"{self.status()}):\n{text}")
            time.sleep(0.05)

    def wait_for_prompt(self, count: int) -> str:
        return self.wait_for(f"prompt number {count}",
                             lambda s: prompts(s) >= count)

    def status(self) -> int | None:
        """The command's exit status once it has ended."""
        try:
            return int(self.status_file.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def close(self) -> None:
        subprocess.run([TMUX, "-S", self.socket, "kill-server"], capture_output=True)


def prompts(screen: str) -> int:
    return sum(line.startswith(PROMPT.rstrip()) for line in screen.splitlines())


@pytest.mark.skipif(TMUX is None, reason="needs tmux")
def test_chat_in_a_terminal(tmp_path):
    """The chat as a user meets it: an answer streams, the second turn
    reuses the first's prefill (/stats), Ctrl-C stops a long answer and the
    session goes on, Ctrl-C at the prompt discards the line, /reset and
    /exit work, and no traceback ever shows."""
    from tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf", overrides={"qwen2.context_length": 4096})
    # (the session's cache: its compiled kernels and converted weights)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # The tiny model's greedy answers run to -n (it never says </s>): long
    # enough to be seen streaming and stopped.
    command = [sys.executable, "-m", "forerun.cli.main", "chat", "-m", str(path), "-q",
               "--weights", "float32", "--draft", "none", "-n", "1500", "--system", SYSTEM]
    term = Terminal(tmp_path, command, env)
    try:
        term.wait_for_prompt(1)
        # A first turn: its answer is printed, then the next prompt.
        term.send("hello world", "Enter")
        term.wait_for_prompt(2)
        term.send("/stats", "Enter")
        screen = term.wait_for("the first /stats", lambda s: "prompt tokens" in s)
        assert "(0 reused from the cache)" in screen
        term.wait_for_prompt(3)
        # The second turn reuses the first one's prefill.
        term.send("the quick brown fox", "Enter")
        term.wait_for_prompt(4)
        term.send("/stats", "Enter")
        screen = term.wait_for("the second /stats",
                               lambda s: s.count("prompt tokens") == 2)
        reused = [int(n) for n in re.findall(r"\((\d+) reused from the cache\)", screen)]
        assert reused[0] == 0 and reused[1] >= 128
        term.wait_for_prompt(5)
        # A long answer, seen while it streams, stopped by Ctrl-C.
        term.send("/system", "Enter")
        term.wait_for_prompt(6)
        term.send("the lazy dog " * 3, "Enter")
        streaming = term.wait_for("the answer streaming", lambda s: answer_started(s, 6))
        assert prompts(streaming) == 6
        term.send("C-c")
        screen = term.wait_for_prompt(7)
        assert "[stopped]" in screen and "[answer abandoned]" not in screen
        # Ctrl-C at the prompt discards the line; the session goes on.
        term.send("half a line")
        term.wait_for("the line typed", lambda s: "half a line" in s)
        term.send("C-c")
        term.wait_for("the line discarded", lambda s: "(line discarded" in s)
        term.wait_for_prompt(8)
        term.send("/reset", "Enter")
        term.wait_for("[new conversation]", lambda s: "[new conversation]" in s)
        term.wait_for_prompt(9)
        term.send("/exit", "Enter")
        term.wait_for("the chat to end", lambda s: term.status() is not None)
        assert term.status() == 0
        assert "Traceback" not in term.screen()
    finally:
        term.close()


def answer_started(screen: str, prompt: int) -> bool:
    """Whether some of the answer to the ``prompt``-th prompt's message is on
    the screen (at least a few characters after the line it was typed on)."""
    lines = screen.rstrip("\n").splitlines()
    typed = [i for i, line in enumerate(lines) if line.startswith(PROMPT.rstrip())]
    if len(typed) < prompt:
        return False
    after = "\n".join(lines[typed[prompt - 1] + 1:])
    return len(after.strip()) >= 20
