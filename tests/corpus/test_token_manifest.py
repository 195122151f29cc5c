"""The token manifest on disk: records round-trip through shards, every
write is whole (a failure midway leaves the previous manifest readable),
a foreign, damaged or unknown manifest is refused naming the file, the
held-out split is fixed, and duplicates are found."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import forerun.corpus.token_manifest as tm
from forerun.corpus.token_manifest import (
    MANIFEST,
    Dedup,
    ManifestError,
    ManifestWriter,
    Record,
    TokenManifest,
    is_held_out,
    rebuild_dedup,
    text_key,
)
from quick import draws

FP = "0123456789abcdef"


def records(n: int, seed: int = 0) -> list[Record]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        tokens = rng.integers(0, 1000, int(rng.integers(20, 90))).astype(np.int32)
        if i % 3:
            query = f"question number {i}?"
            out.append(Record(tokens, "conversation", int(rng.integers(1, 15)), seed=i,
                              query=query, key=text_key(query)))
        else:
            out.append(Record(tokens, "text", 0, source=f"file.py#{i}", key=text_key(f"t{i}")))
    return out


def new(path: Path, shard_tokens: int = 300) -> ManifestWriter:
    return ManifestWriter.create(path, model="tiny", fingerprint=FP, vocab_size=1000,
                                 settings={"seed": 0}, shard_tokens=shard_tokens,
                                 state={"next": 0}, counters={"made": 0})


def same(a: Record, b: Record) -> bool:
    return (a.tokens.tolist() == b.tokens.tolist() and a.meta() == b.meta())


def test_records_round_trip_through_shards_that_close_at_their_size(tmp_path):
    out = tmp_path / "m"
    writer = new(out)
    made = records(25)
    for i, r in enumerate(made):
        writer.add(r)
        writer.state["next"] = i + 1
        if i % 4 == 0:
            writer.flush()
    writer.flush()
    m = TokenManifest.open(out, fingerprint=FP)
    read = list(m)
    assert len(read) == len(m) == 25 and all(same(a, b) for a, b in zip(made, read))
    assert read[1].tensor().dtype.is_floating_point is False
    assert m.data["state"] == {"next": 25} and m.model == "tiny" and m.fingerprint == FP
    conv = [r for r in made if r.kind == "conversation"]
    assert m.counts["conversation"] == {
        "records": len(conv), "tokens": sum(len(r) for r in conv),
        "loss_tokens": sum(len(r) - r.loss_start for r in conv)}
    assert m.counts["text"]["loss_tokens"] == sum(len(r) - 1 for r in made if r.kind == "text")
    shards = m.data["shards"]
    # every shard but the last reached 300 tokens with its last record, not before
    for s in shards[:-1]:
        assert s["tokens"] >= 300 and s["tokens"] - s["records"][-1]["n"] < 300
    assert shards[-1]["tokens"] < 300
    # 4 bytes a token, compressed, and only the shards the manifest names are on disk
    assert {p.name for p in out.iterdir()} == {MANIFEST} | {s["file"] for s in shards}
    assert all(s["file"].endswith(".bin.xz") for s in shards) and m.data["version"] == 2
    assert sum(s["bytes"] for s in shards) == 4 * m.tokens
    assert [(out / s["file"]).stat().st_size for s in shards] == [s["stored"] for s in shards]


def test_the_held_out_split_is_fixed_by_the_tokens_and_covers_every_record_once(tmp_path):
    writer = new(tmp_path / "m", shard_tokens=10_000)
    for r in records(400):
        writer.add(r)
    writer.flush()
    m = TokenManifest.open(tmp_path / "m")
    held = [r.digest for r in m.records("held_out", held_out=0.1)]
    train = [r.digest for r in m.records("train", held_out=0.1)]
    assert sorted(held + train) == sorted(r.digest for r in m)
    assert 20 <= len(held) <= 60
    assert held == [r.digest for r in m.records("held_out", held_out=0.1)]
    assert all(is_held_out(d, 0.1) for d in held) and not any(is_held_out(d, 0.1)
                                                              for d in train)


def test_a_write_that_fails_midway_leaves_the_previous_manifest_readable(tmp_path,
                                                                         monkeypatch):
    out = tmp_path / "m"
    writer = new(out)
    made = records(12)
    for r in made[:5]:
        writer.add(r)
    writer.flush()
    before = [(r.tokens.tolist(), r.meta()) for r in TokenManifest.open(out)]
    real_write = tm._write_bytes

    def half_then_fail(path: Path, data: bytes) -> None:
        real_write(path, data[:len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tm, "_write_bytes", half_then_fail)
    for r in made[5:]:
        writer.add(r)
    with pytest.raises(OSError):
        writer.flush()                          # fails writing a shard
    after = [(r.tokens.tolist(), r.meta()) for r in TokenManifest.open(out)]
    assert after == before
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]

    # the shards written, the manifest's write fails: still the old manifest,
    # and the new shard files are leftovers a resume removes
    calls = []

    def fail_on_manifest(path: Path, data: bytes) -> None:
        calls.append(path)
        if data.startswith(b"{"):
            half_then_fail(path, data)
        else:
            real_write(path, data)

    monkeypatch.setattr(tm, "_write_bytes", fail_on_manifest)
    with pytest.raises(OSError):
        writer.flush()
    assert [(r.tokens.tolist(), r.meta()) for r in TokenManifest.open(out)] == before
    named = {s["file"] for s in TokenManifest.open(out).data["shards"]}
    leftovers = {p.name for p in out.iterdir()} - named - {MANIFEST}
    assert leftovers                              # shards no manifest names
    monkeypatch.setattr(tm, "_write_bytes", real_write)
    resumed = ManifestWriter.resume(out, fingerprint=FP)
    assert {p.name for p in out.iterdir()} == named | {MANIFEST}
    # the resumed writer holds the flushed records, and goes on from them
    assert [(r.tokens.tolist(), r.meta()) for r in resumed.records()] == before
    for r in made[5:]:
        resumed.add(r)
    resumed.flush()
    assert all(same(a, b) for a, b in zip(made, TokenManifest.open(out)))
    assert len(TokenManifest.open(out)) == 12


def test_a_manifest_for_another_tokenizer_is_refused(tmp_path):
    writer = new(tmp_path / "m")
    writer.add(records(1)[0])
    writer.flush()
    for call in (lambda: TokenManifest.open(tmp_path / "m", fingerprint="fedcba9876543210"),
                 lambda: ManifestWriter.resume(tmp_path / "m", fingerprint="fedcba9876543210")):
        with pytest.raises(ManifestError, match="another tokenizer") as err:
            call()
        assert str(tmp_path / "m" / MANIFEST) in str(err.value)
        assert "forerun train data" in str(err.value)


@pytest.mark.parametrize("compress", [True, False], ids=["xz", "raw"])
def test_a_truncated_or_changed_or_missing_shard_is_refused_naming_it(tmp_path, compress):
    writer = new(tmp_path / "m", shard_tokens=10_000)
    writer.compress = compress
    for r in records(5):
        writer.add(r)
    writer.flush()
    shard = tmp_path / "m" / TokenManifest.open(tmp_path / "m").data["shards"][0]["file"]
    data = shard.read_bytes()
    shard.write_bytes(data[:-6])
    with pytest.raises(ManifestError, match="is truncated or changed: it holds") as err:
        TokenManifest.open(tmp_path / "m")
    assert str(shard) in str(err.value) and "build the data again" in str(err.value)
    with pytest.raises(ManifestError, match="is truncated or changed: it holds"):
        ManifestWriter.resume(tmp_path / "m", fingerprint=FP)
    at = len(data) // 2
    shard.write_bytes(data[:at] + bytes([data[at] ^ 1]) + data[at + 1:])
    with pytest.raises(ManifestError, match="changed since it was written"):
        TokenManifest.open(tmp_path / "m")
    opened = TokenManifest.open(tmp_path / "m", verify=False)    # sizes alone: it passes
    if compress:        # and reading the records refuses it
        with pytest.raises(ManifestError, match="changed since it was written"):
            list(opened.records())
    shard.unlink()
    with pytest.raises(ManifestError, match="is missing"):
        TokenManifest.open(tmp_path / "m")


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(version=99), "format version 99"),
    (lambda d: d.update(format="something-else"), "not a forerun token manifest"),
    (lambda d: d.pop("shards"), "lacks a valid 'shards'"),
    (lambda d: d["shards"][0]["records"].pop(), "don't add up"),
    (lambda d: d["shards"][0]["records"][1].update(loss_start=-7), "record 1 of shard .* "
     "a loss_start of -7"),
    (lambda d: d["shards"][0]["records"][0].update(loss_start=10_000), "loss_start of 10000"),
    (lambda d: d["shards"][0]["records"][0].update(kind="poem"), "the kind 'poem'"),
    (lambda d: d["shards"][0]["records"][0].update(n=-3), "a length of -3"),
    (lambda d: d["shards"][0]["records"][0].update(seed="1"), "the seed '1'"),
    (lambda d: d["shards"][0]["records"][0].update(query=5), "query that is not text"),
    (lambda d: d["shards"][0]["records"].__setitem__(0, 7), "not an object"),
    (lambda d: d.update(vocab_size=0), "vocab_size of 0"),
    (lambda d: d.update(vocab_size=10), "outside the vocabulary of 10 ids"),
], ids=["version", "format", "no-shards", "records", "negative-loss-start", "late-loss-start",
        "kind", "length", "seed", "query", "record", "no-vocab", "small-vocab"])
def test_an_unknown_or_inconsistent_manifest_is_refused(tmp_path, edit, message):
    writer = new(tmp_path / "m")
    for r in records(3):
        writer.add(r)
    writer.flush()
    file = tmp_path / "m" / MANIFEST
    data = json.loads(file.read_text())
    edit(data)
    file.write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=message) as err:
        TokenManifest.open(tmp_path / "m")
    assert str(file) in str(err.value)


def test_what_is_not_a_manifest_is_refused(tmp_path):
    with pytest.raises(ManifestError, match="does not exist"):
        TokenManifest.open(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ManifestError, match="holds no manifest.json"):
        TokenManifest.open(tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / MANIFEST).write_text('{"format": "forerun-token-manifest", "ver')
    with pytest.raises(ManifestError, match="can't be read"):
        TokenManifest.open(tmp_path / "bad" / MANIFEST)


def test_a_new_manifest_needs_an_empty_folder(tmp_path):
    new(tmp_path / "m")
    with pytest.raises(ManifestError, match="--resume"):
        new(tmp_path / "m")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(ManifestError, match="not empty"):
        new(tmp_path / "other")


def test_a_record_is_checked():
    with pytest.raises(ValueError, match="loss_start"):
        Record(np.arange(4), "text", 4)
    with pytest.raises(ValueError, match="kind"):
        Record(np.arange(4), "chat", 0)
    with pytest.raises(ValueError, match="non-empty"):
        Record(np.arange(0), "text", 0)


# -- duplicates -----------------------------------------------------------------

def test_duplicates_after_normalising_and_near_duplicate_queries_are_found():
    dedup = Dedup(near=0.7)
    dedup.add("How do I reverse a linked list in Python?")
    assert dedup.check("how do I  reverse a linked list in PYTHON?") == "duplicate"
    assert dedup.check("How do I reverse a linked list in Python, please?") == \
        "near_duplicate"
    assert dedup.check("How do I reverse a linked list in Python, please?",
                       near=False) is None
    assert dedup.check("How do I read a CSV file with pandas?") is None
    assert dedup.check("Explain the borrow checker in Rust.") is None
    dedup.add(None, near=False, key=text_key("def f(): pass"))
    assert dedup.check("def  f():  pass", near=False) == "duplicate"


def test_the_duplicates_of_a_resumed_run_are_those_its_records_hold():
    made = records(9)
    dedup = rebuild_dedup(made, near=0.7)
    for r in made:
        if r.query is not None:
            assert dedup.check(r.query.upper()) == "duplicate"
        else:
            assert dedup.check("", key=r.key, near=False) == "duplicate"


def test_a_flush_that_failed_can_be_done_again(tmp_path, monkeypatch):
    writer = new(tmp_path / "m")
    made = records(12)
    for r in made[:3]:
        writer.add(r)
    writer.flush()
    real_write = tm._write_bytes
    writes = []

    def fail(path: Path, data: bytes) -> None:
        """The first write goes through (a shard), the next fails."""
        writes.append(path)
        if len(writes) > 1:
            raise OSError(28, "No space left on device")
        real_write(path, data)

    for r in made[3:]:
        writer.add(r)
    monkeypatch.setattr(tm, "_write_bytes", fail)
    with pytest.raises(OSError):
        writer.flush()
    assert len(writes) == 2
    monkeypatch.setattr(tm, "_write_bytes", real_write)
    writer.flush()
    read = list(TokenManifest.open(tmp_path / "m"))
    assert len(read) == 12 and all(same(a, b) for a, b in zip(made, read))


def test_any_edit_of_a_manifest_opens_or_is_refused_never_a_crash(tmp_path):
    """Fuzzed: manifest.json with any one value replaced by another of any
    type (or removed), and shards cut anywhere: open() and reading every
    record give records or a ManifestError, nothing else."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from json_edits import edit_values, edited, places

    writer = new(tmp_path / "m", shard_tokens=100)
    for r in records(6):
        writer.add(r)
    writer.flush()
    original = json.loads((tmp_path / "m" / MANIFEST).read_text())
    shards = {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir() if p.name != MANIFEST}

    every = list(places(original))
    values = edit_values()

    @settings(max_examples=draws(300, 60), deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(where=st.sampled_from(every), value=values, cut=st.one_of(st.none(),
                                                                    st.integers(0, 400)))
    def check(where, value, cut):
        data = edited(original, where, value)
        folder = tmp_path / "m"
        (folder / MANIFEST).write_text(json.dumps(data))
        for name, content in shards.items():
            (folder / name).write_bytes(content if cut is None else content[:cut])
        try:
            for verify in (False, True):
                manifest = TokenManifest.open(folder, verify=verify)
                for record in manifest.records():
                    assert len(record) >= 1
                list(manifest.records("train"))
        except ManifestError:
            pass

    check()


def test_raw_shards_of_version_1_read_and_compress_to_the_same_records(tmp_path,
                                                                        monkeypatch):
    """A manifest of raw shards (format version 1, before compression)
    reads as before and resumes raw; compress_shards makes it version 2
    with the same records, and a stop while it writes the manifest leaves
    the raw manifest whole."""
    made = records(12)
    writer = new(tmp_path / "m", shard_tokens=300)
    writer.compress = False
    for r in made:
        writer.add(r)
    writer.flush()
    file = tmp_path / "m" / MANIFEST
    data = json.loads(file.read_text())
    file.write_text(json.dumps({**data, "version": 1}))
    old = TokenManifest.open(tmp_path / "m")
    assert all(s["file"].endswith(".bin") for s in old.data["shards"])
    assert not ManifestWriter.resume(tmp_path / "m", fingerprint=FP).compress

    real_write = tm._write_bytes

    def fail_on_manifest(path, blob):
        if MANIFEST in path.name:
            raise OSError("disk full")
        real_write(path, blob)

    monkeypatch.setattr(tm, "_write_bytes", fail_on_manifest)
    with pytest.raises(OSError):
        tm.compress_shards(tmp_path / "m")
    monkeypatch.setattr(tm, "_write_bytes", real_write)
    still = TokenManifest.open(tmp_path / "m")
    assert still.data["version"] == 1 and all(same(a, b) for a, b in zip(made, still))

    assert tm.compress_shards(tmp_path / "m") == len(old.data["shards"])
    new_m = TokenManifest.open(tmp_path / "m")
    assert new_m.data["version"] == 2
    assert all(s["file"].endswith(".bin.xz") for s in new_m.data["shards"])
    assert not list((tmp_path / "m").glob("*.bin"))
    assert all(same(a, b) for a, b in zip(made, new_m)) and len(list(new_m)) == 12
    assert tm.compress_shards(tmp_path / "m") == 0        # nothing left to do
