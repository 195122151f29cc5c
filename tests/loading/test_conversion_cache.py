"""The conversion cache heals: a damaged converted model is rebuilt (never
loaded), a conversion killed at any point leaves no temporary and no
half-written entry, two processes converting the same file share one
result, and entries are keyed by the GGUF's content, not its path."""

from __future__ import annotations

import inspect
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import forerun
from forerun.loading.cache_entry import TMP_MARK, check
from forerun.loading.conversion_cache import convert_gguf, converted_entry
from tiny_gguf import write_tiny_gguf

TESTS = Path(__file__).resolve().parent.parent

# These tests exercise the float32 conversion cache: ask for that weight
# format where load() offers others (q4 and q8 read the GGUF directly).
FLOAT32 = ({"weights": "float32"} if "weights" in inspect.signature(forerun.load).parameters
           else {})

@pytest.fixture(scope="module")
def pristine(gguf_path, tmp_path_factory):
    """The tokens a correctly converted model generates."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FORERUN_CACHE", str(tmp_path_factory.mktemp("pristine-cache")))
        return generate(gguf_path)


def generate(path) -> list[int]:
    model = forerun.load(path, context_length=64, device="cpu", progress=False, **FLOAT32)
    return model.generate(prompt="hello world", max_new_tokens=12, ignore_eos=True).tokens


def temporaries(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if TMP_MARK in p.name or ".tmp" in p.name]


def flip_bytes(path: Path, at: float = 0.5, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    start = int(len(data) * at)
    for i in range(start, min(start + n, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [
    "weights-flipped", "weights-truncated", "config-flipped", "tokenizer-flipped",
    "tokenizer-extra-flipped", "manifest-garbage", "weights-deleted"])
def test_a_damaged_conversion_is_rebuilt_never_used(gguf_path, cache, pristine, damage):
    folder = convert_gguf(gguf_path, progress=False)
    what, how = damage.rsplit("-", 1)
    target = folder / {"weights": "model.safetensors", "config": "config.json",
                       "tokenizer": "tokenizer/tokenizer.json",
                       "tokenizer-extra": "tokenizer/forerun_tokenizer.json",
                       "manifest": "manifest.json"}[what]
    if how == "flipped":
        flip_bytes(target, at=0.6 if what == "weights" else 0.3, n=4 if what != "weights"
                   else 256)
    elif how == "truncated":
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    elif how == "deleted":
        target.unlink()
    else:
        target.write_text("garbage")
    assert check(converted_entry(gguf_path)) is not None
    assert generate(gguf_path) == pristine
    assert check(converted_entry(gguf_path), checksums="all") is None
    assert not temporaries(cache)


def test_entries_are_keyed_by_content(gguf_path, cache, tmp_path):
    """A copy, a move or a touch of the GGUF finds the same entry; other
    content gets its own."""
    first = convert_gguf(gguf_path, progress=False)
    built = (first / "manifest.json").read_text()
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copy(gguf_path, copy)
    os.utime(copy, ns=(0, 10**18))
    assert convert_gguf(copy, progress=False) == first
    assert (first / "manifest.json").read_text() == built          # not converted again
    other = write_tiny_gguf(tmp_path / "other.gguf", seed=9)
    assert convert_gguf(other, progress=False) != first
    assert len([p for p in (cache / "converted").iterdir() if not p.name.startswith(".")]) == 2


CHILD = """
import sys, time
sys.path.insert(0, {tests!r})
from pathlib import Path
import forerun.loading.conversion_cache as conversion
from forerun.loading.conversion_cache import convert_gguf
convert = conversion._convert
def announced(*args):                   # say when this process converts
    print("converting", flush=True)
    return convert(*args)
conversion._convert = announced
print("ready", flush=True)
sys.stdin.readline()
start = time.perf_counter()
convert_gguf(Path({path!r}), progress=False)
print("done", time.perf_counter() - start, flush=True)
"""


def start_child(path: Path, cache: Path) -> subprocess.Popen:
    env = dict(os.environ, FORERUN_CACHE=str(cache))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(tests=str(TESTS), path=str(path))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
        # Signals reach it as they reach a program started from a shell.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert child.stdout.readline().strip() == "ready"
    return child


def test_a_conversion_killed_at_any_point_recovers(gguf_path, cache, pristine):
    """Kill conversions (SIGKILL, SIGTERM, SIGINT) at random points; every
    time the entry is either absent or whole, and the next run converts,
    loads the right weights and leaves no temporary."""
    child = start_child(gguf_path, cache)
    child.stdin.write("go\n")
    child.stdin.flush()
    out, _ = child.communicate(timeout=60)
    duration = float(out.split()[-1])
    rng = random.Random(14)
    signals = [signal.SIGKILL, signal.SIGTERM, signal.SIGINT]
    entry = converted_entry(gguf_path)
    outcomes: list[tuple[str, int, bool]] = []
    # Six kills, and more (up to 24) until one has landed inside a
    # conversion: on a loaded machine a start-up can outlast the measured
    # duration, and six kills all landed before the conversion began.
    while len(outcomes) < 6 or (not any(left for _, _, left in outcomes)
                                and len(outcomes) < 24):
        sig = signals[len(outcomes) % len(signals)]
        # Start each run without the entry, but with what earlier kills left.
        shutil.rmtree(entry.path, ignore_errors=True)
        child = start_child(gguf_path, cache)
        child.stdin.write("go\n")
        child.stdin.flush()
        time.sleep(rng.uniform(0, duration * 1.2))
        child.send_signal(sig)
        out, _ = child.communicate(timeout=60)
        outcomes.append((sig.name, child.returncode, bool(temporaries(cache / "converted"))))
        assert check(converted_entry(gguf_path)) in (None, "missing"), sig
    # Some kills landed inside a conversion (a killed one left a temporary).
    assert any(left for _, _, left in outcomes), outcomes
    assert generate(gguf_path) == pristine
    assert check(converted_entry(gguf_path), checksums="all") is None
    assert not temporaries(cache)


def test_two_processes_converting_at_once_share_one_result(gguf_path, cache):
    children = [start_child(gguf_path, cache) for _ in range(2)]
    for child in children:
        child.stdin.write("go\n")
        child.stdin.flush()
    outputs = []
    for child in children:
        out, _ = child.communicate(timeout=60)
        assert child.returncode == 0 and "done" in out
        outputs.append(out)
    # One converted; the other waited for it and used its result.
    assert sum("converting" in out for out in outputs) == 1, outputs
    entries = [p for p in (cache / "converted").iterdir() if not p.name.startswith(".")]
    assert entries == [converted_entry(gguf_path).path]
    assert check(converted_entry(gguf_path), checksums="all") is None
    assert not temporaries(cache)
