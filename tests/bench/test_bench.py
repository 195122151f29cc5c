"""The benchmark harness on tiny models: prompt files, the interleaved loop,
multi-turn prompts, token checks, failures, peers and the report files."""

import importlib.util
import io
import json
import sys

import pytest

from forerun.bench import (
    BenchError,
    BenchMethod,
    BenchSettings,
    ForerunMethod,
    MethodOutput,
    load_prompts,
    print_report,
    run_bench,
    select_prompts,
    write_reports,
)
from forerun.bench.prompts import DEFAULT_PROMPTS
from forerun.cli.main import main
from forerun.errors import ForerunError
from forerun.machine.output_files import OutputPathError

from .conftest import PROMPTS

CATEGORIES = {"conversation", "translation", "summarization", "qa", "math", "rag", "code"}


def settings(**kw):
    base = dict(methods=("plain",), max_new_tokens=6, warmup=1, progress=False)
    base.update(kw)
    return BenchSettings(**base)


def bench(tiny, prompts=None, **kw):
    model, draft, folder, draft_folder = tiny
    kw.setdefault("model", str(folder))
    kw.setdefault("draft", str(draft_folder))
    prompts = select_prompts(load_prompts_from(PROMPTS)) if prompts is None else prompts
    return run_bench(settings(**kw), model=model, draft=draft, prompts=prompts,
                     log=lambda m: None)


def load_prompts_from(objs):
    from forerun.bench.prompts import _parse

    return [_parse(o, "test") for o in objs]


def rows_of(report, method):
    return [r for r in report.rows if r["method"] == method]


# -- prompt files --------------------------------------------------------------

def test_shipped_prompt_set():
    prompts = load_prompts()
    assert prompts == load_prompts(DEFAULT_PROMPTS)
    assert len(prompts) >= 70
    assert {p.category for p in prompts} == CATEGORIES
    for p in prompts:
        assert p.turns and all(t.strip() for t in p.turns)
    assert all(len(p.turns) == 2 for p in prompts if p.category == "conversation")
    # Long inputs where the category calls for them.
    for category in ("summarization", "rag"):
        assert min(len(p.turns[0]) for p in prompts if p.category == category) > 1500
    assert sum(len(p.turns[0]) > 1500 for p in prompts if p.category == "code") >= 4
    assert len({p.question_id for p in prompts}) == len(prompts)


def test_spec_bench_file(tmp_path):
    path = tmp_path / "question.jsonl"
    lines = [{"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."],
              "reference": ["ignored"]},
             {"question_id": 82, "category": "writing", "turns": ["Write a haiku."]},
             {"question_id": 91, "category": "math_reasoning", "turns": ["What is 2+2?"]}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    prompts = load_prompts(path)
    assert [p.question_id for p in prompts] == [81, 82, 91]
    assert prompts[0].turns == ("Write a poem.", "Shorter.")
    assert prompts[0].category == "writing"
    assert [p.question_id for p in select_prompts(prompts, limit=1)] == [81, 91]
    assert [p.question_id for p in select_prompts(prompts, ["math_reasoning"])] == [91]
    with pytest.raises(BenchError, match="no prompts in category nope.*writing"):
        select_prompts(prompts, ["nope"])


@pytest.mark.parametrize("line, message", [
    ("not json", "line 2: not valid JSON"),
    ('{"question_id": 2, "category": "x"}', "line 2: 'turns' must be"),
    ('{"question_id": 2, "category": "x", "turns": []}', "line 2: 'turns' must be"),
    ('{"question_id": 1, "category": "x", "turns": ["a"]}', "appears twice"),
])
def test_bad_prompt_files(tmp_path, line, message):
    path = tmp_path / "q.jsonl"
    path.write_text('{"question_id": 1, "category": "x", "turns": ["a"]}\n' + line + "\n")
    with pytest.raises(BenchError, match=message):
        load_prompts(path)
    with pytest.raises(BenchError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl")


# -- the loop ------------------------------------------------------------------

class Spy(BenchMethod):
    """Plain decoding that records the prompts it was given."""

    def __init__(self, corrupt=False):
        self.calls = []
        self.corrupt = corrupt

    def generate(self, ctx, prompt_ids, **kw):
        self.calls.append(list(prompt_ids))
        out = ForerunMethod("plain").generate(ctx, prompt_ids, **kw)
        if self.corrupt:
            out.tokens[-1] = (out.tokens[-1] + 1) % 300
        return out


def test_speculative_methods_match_plain(tiny):
    report = bench(tiny, methods=("plain", "draft", "draft-k2"))
    assert [m for m in report.methods] == ["plain", "draft", "draft-k2"]
    assert all(i["status"] == "ok" for i in report.methods.values())
    assert len(report.rows) == 3 * len(PROMPTS)
    assert not report.mismatches()
    for r in rows_of(report, "draft-k2"):
        assert r["status"] == "ok" and r["mismatch"] is False
        assert r["rounds"] > 0 and r["mean_accepted_tokens"] >= 1
        assert 0 <= r["acceptance_rate"] <= 1
    overall = report.summary["by_temperature"][0]["methods"]
    assert overall["plain"]["overall"]["speedup"] == pytest.approx(1.0)
    assert overall["draft-k2"]["overall"]["speedup"] > 0
    assert set(overall["draft"]["categories"]) == {"qa", "chat"}


def test_asynchronous_drafting_methods_match_plain_and_say_whether_they_paid(tiny):
    report = bench(tiny, methods=("plain", "draft-async", "draft-async-k2-1+1"))
    assert all(i["status"] == "ok" for i in report.methods.values())
    assert not report.mismatches()
    for name in ("draft-async", "draft-async-k2-1+1"):
        rows = rows_of(report, name)
        assert rows and all(r["status"] == "ok" and r["mismatch"] is False for r in rows)
        note = report.methods[name]["note"]
        # Generations that drafted nothing get no verdict (issue 42).
        idle = sum(not t.get("drafted") for r in rows for t in r["turns"])
        judged = sum(len(r["turns"]) for r in rows) - idle
        assert (f"no verdict on {idle} generation" in note) == (idle > 0), note
        if judged:
            assert note.startswith("asynchronous drafting paid in ")
            assert f"of {judged} generations" in note
        else:
            assert note.startswith("asynchronous drafting: no verdict")
    assert "1 thread(s)" in report.methods["draft-async-k2-1+1"]["description"]
    for bad, message in (("draft-async-k0", "draft length"), ("draft-async-0+1", "positive")):
        with pytest.raises(BenchError, match=message):
            settings(methods=(bad,)).validate()


def test_greedy_runs_are_reproducible(tiny):
    """A second greedy run gives every row the same tokens, turn by turn."""
    def tokens(report):
        return {(r["question_id"], r["method"]): [t["tokens"] for t in r["turns"]]
                for r in report.rows}

    first = bench(tiny, methods=("plain", "draft", "ngram"))
    second = bench(tiny, methods=("plain", "draft", "ngram"))
    assert tokens(first) == tokens(second)
    assert all(t for turns in tokens(first).values() for t in turns)


def test_multi_turn_uses_plain_answer(tiny, registry):
    spy = Spy()
    registry("spy", lambda: spy)
    model = tiny[0]
    report = bench(tiny, methods=("plain", "spy"), warmup=0)
    plain = next(r for r in rows_of(report, "plain") if r["question_id"] == 3)
    assert len(plain["turns"]) == 2
    first_answer = model.tokenizer.decode(plain["turns"][0]["tokens"])
    # Calls: prompts 1, 2, then both turns of prompt 3.
    assert len(spy.calls) == 4
    turn2 = model.tokenizer.decode(spy.calls[3])
    expected = model.encode_prompt(messages=[
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": model.generate(
            prompt_ids=spy.calls[2], max_new_tokens=6).text},
        {"role": "user", "content": "the lazy dog"}])
    assert spy.calls[3] == expected
    assert "hello" in turn2 and "the lazy dog" in turn2
    assert first_answer.replace("</s>", "") in turn2
    spy_row = next(r for r in rows_of(report, "spy") if r["question_id"] == 3)
    assert spy_row["new_tokens"] == sum(t["new_tokens"] for t in spy_row["turns"])
    assert spy_row["mismatch"] is False


def test_every_method_prefills_first_turns_whole_and_reuses_the_same_prefix_later(
        tiny, monkeypatch):
    """Fair to every method: a prompt's first turn is prefilled whole, and
    a later turn reuses the previous turn's blocks, whichever method ran
    just before (each would otherwise find the last one's cache)."""
    model = tiny[0]
    monkeypatch.setattr(model.decoder, "prefill_block", 4)   # blocks in a short prompt
    report = bench(tiny, methods=("plain", "ngram", "draft-k2"))
    assert not report.mismatches()
    for row in report.rows:
        assert row["turns"][0]["reused_prompt_tokens"] == 0, row["method"]
    later = {r["method"]: r["turns"][1]["reused_prompt_tokens"] for r in report.rows
             if r["question_id"] == 3}
    first_prompt = model.encode_prompt(messages=[{"role": "user", "content": "hello"}])
    assert set(later) == {"plain", "ngram", "draft-k2"}
    assert len(set(later.values())) == 1
    assert 0 < later["plain"] <= len(first_prompt)
    assert "prompt_reuse" in report.notes


def test_mismatch_is_flagged(tiny, registry, capsys):
    registry("wrong", lambda: Spy(corrupt=True))
    report = bench(tiny, methods=("plain", "wrong"))
    bad = report.mismatches()
    assert len(bad) == len(PROMPTS) and {r["method"] for r in bad} == {"wrong"}
    assert bad[0]["first_mismatch"]["turn"] == 1
    agg = report.summary["by_temperature"][0]["methods"]["wrong"]["overall"]
    assert agg["mismatches"] == len(PROMPTS)
    out = io.StringIO()
    print_report(report, out)
    assert "TOKEN MISMATCH" in out.getvalue() and "wrong differs from plain" in out.getvalue()
    assert "TOKEN MISMATCH" in capsys.readouterr().err


def test_sampling_skips_token_check(tiny, registry):
    registry("wrong", lambda: Spy(corrupt=True))
    report = bench(tiny, methods=("plain", "wrong"), temperatures=(0.0, 0.8), seed=7)
    hot = [r for r in report.rows if r["temperature"] == 0.8]
    assert hot and all(r["mismatch"] is None for r in hot)
    assert len(report.summary["by_temperature"]) == 2


class Broken(BenchMethod):
    def __init__(self, where):
        self.where = where
        self.calls = 0

    def setup(self, ctx):
        if self.where == "setup":
            raise ForerunError("cannot set up the broken method")

    def generate(self, ctx, prompt_ids, **kw):
        self.calls += 1
        if self.where == "generate":
            raise ForerunError("the broken method refuses")
        if self.where == "bug" and self.calls == 3:   # after the warm-up and prompt 1
            raise RuntimeError("a bug")
        return ForerunMethod("plain").generate(ctx, prompt_ids, **kw)


def test_failing_methods_are_reported(tiny, registry):
    for where in ("setup", "generate", "bug"):
        registry(f"broken-{where}", lambda where=where: Broken(where))
    model, _, folder, _ = tiny
    report = run_bench(settings(model=str(folder), methods=(
        "plain", "broken-setup", "broken-generate", "broken-bug", "draft"), warmup=1),
        model=model, prompts=load_prompts_from(PROMPTS), log=lambda m: None)
    methods = report.methods
    assert methods["plain"]["status"] == "ok"
    assert methods["broken-setup"]["status"] == "failed"
    assert "cannot set up" in methods["broken-setup"]["message"]
    assert methods["broken-generate"]["status"] == "failed"
    assert "refuses" in methods["broken-generate"]["message"]
    # No draft given and none by default: a clear message.
    assert methods["draft"]["status"] == "failed"
    assert "no draft model" in methods["draft"]["message"]
    # A crash on some prompts: those rows fail, the others count.
    bug_rows = rows_of(report, "broken-bug")
    assert methods["broken-bug"]["status"] == "ok"
    assert any(r["status"] == "failed" and "RuntimeError" in r["error"] for r in bug_rows)
    assert all(r["status"] == "ok" for r in rows_of(report, "plain"))
    out = io.StringIO()
    print_report(report, out)
    assert "broken-generate: FAILED" in out.getvalue()


def test_ngram_method_runs_or_fails_cleanly(tiny):
    report = bench(tiny, methods=("plain", "ngram"))
    info = report.methods["ngram"]
    assert info["status"] in ("ok", "failed")
    if info["status"] == "failed":
        assert "ngram" in info["message"]
    else:
        assert not report.mismatches()


def test_suffix_method_never_drafts_a_prompts_own_earlier_answer(tiny):
    """A prompt asked again (the warm-up's, every prompt at the next
    temperature) clears the model's suffix store first; new prompts draft
    from the earlier ones' answers."""
    from forerun.bench.method import BenchContext
    from forerun.bench.methods import ForerunMethod

    model = tiny[0]
    store = model.suffix_store()
    store.clear()
    ctx = BenchContext(model)
    method = ForerunMethod("suffix", draft="suffix")
    method.setup(ctx)
    first, second = ([5, 6, 7, 8, 9], [20, 21, 22])
    method.generate(ctx, first, max_new_tokens=6, temperature=0.0, seed=0)
    one = len(store)
    method.generate(ctx, second, max_new_tokens=6, temperature=0.0, seed=0)
    assert len(store) > one                                  # both kept
    method.generate(ctx, first, max_new_tokens=6, temperature=0.0, seed=0)
    assert len(store) == one                                 # cleared, then this one
    report = bench(tiny, methods=("plain", "suffix"), temperatures=(0.0, 0.0))
    assert report.methods["suffix"]["status"] == "ok" and not report.mismatches()
    store.clear()


@pytest.mark.parametrize("name, method, draft", [
    ("eagle", "eagle", "eagle"),
    ("eagle-tree:/heads/h", "eagle-tree", "eagle:/heads/h"),
    ("eagle-lookup", "eagle-lookup", "eagle"),
    ("eagle-lookup:/heads/h", "eagle-lookup", "eagle:/heads/h"),
    ("medusa", "medusa", "medusa"),
    ("medusa:/heads/m.safetensors", "medusa", "medusa:/heads/m.safetensors"),
])
def test_head_methods_name_their_shape_and_head(name, method, draft):
    from forerun.bench.registry import make_method
    from forerun.speculation.config import resolve

    made = make_method(name)
    config = resolve(made.draft, **made.options)
    assert (config.method, config.draft, made.name) == (method, draft, name)


def test_unknown_method_and_bad_settings():
    with pytest.raises(BenchError, match="unknown method 'turbo'.*draft-kN"):
        settings(methods=("turbo",)).validate()
    with pytest.raises(BenchError, match="draft length"):
        settings(methods=("draft-k99",)).validate()
    with pytest.raises(BenchError, match="temperatures"):
        settings(temperatures=(-1.0,)).validate()


# -- peers ---------------------------------------------------------------------

def test_missing_peer_packages_are_skipped(tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    report = bench(tiny, peer_transformers=True, peer_llama_cpp=True)
    for name in ("hf-plain", "hf-assisted", "hf-lookup"):
        assert report.methods[name]["status"] == "skipped"
        assert "transformers is not installed" in report.methods[name]["message"]
    assert report.methods["llamacpp-plain"]["status"] == "skipped"
    assert "llama-cpp-python is not installed" in report.methods["llamacpp-plain"]["message"]
    assert report.methods["plain"]["status"] == "ok"
    assert {r["method"] for r in report.rows} == {"plain"}
    out = io.StringIO()
    print_report(report, out)
    assert "hf-plain: SKIPPED: transformers is not installed" in out.getvalue()


def test_transformers_peers(tiny):
    report = bench(tiny, peer_transformers=True, peer_llama_cpp=True)
    for name in ("hf-plain", "hf-assisted", "hf-lookup"):
        assert report.methods[name]["status"] == "ok", report.methods[name]
        for r, p in zip(rows_of(report, name), rows_of(report, "plain")):
            assert r["status"] == "ok"
            assert r["new_tokens"] == p["new_tokens"]   # the same work as forerun plain
            assert r["plain_match"] is not None
    # Same float32 weights: transformers' greedy tokens are forerun's.
    agg = report.summary["by_temperature"][0]["methods"]["hf-plain"]["overall"]
    assert agg["plain_match"] > 0.5 and agg["speedup"] > 0
    # A folder is no GGUF: llama.cpp is skipped (or missing).
    assert report.methods["llamacpp-plain"]["status"] == "skipped"


class VirtualClock:
    """The runner's clock, moved only by the methods below: a row's wall
    time says which of their calls fell inside its timed section."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


class TimedMethod(BenchMethod):
    """Loading takes ``load`` virtual seconds (in ``setup``, or in the first
    generation when ``lazy``), each generation one more."""

    engine = "fake"
    baseline = None

    def __init__(self, clock, *, peer, load, lazy=False):
        self.clock, self.peer, self.load, self.lazy = clock, peer, load, lazy
        self.loaded = False

    def _load(self):
        self.clock.now += self.load
        self.loaded = True

    def setup(self, ctx):
        if not self.lazy:
            self._load()

    def generate(self, ctx, prompt_ids, *, max_new_tokens, **kw):
        if not self.loaded:
            self._load()
        self.clock.now += 1.0
        return MethodOutput([5] * max_new_tokens)


def test_a_peer_s_time_leaves_out_every_model_s_loading(tiny, registry, monkeypatch):
    """A peer loads in setup, outside every timed section; a method of
    forerun's that loads lazily (here in its first generation, with no
    warm-up) counts its loading in its own row, never in a peer's."""
    from forerun.bench import runner

    clock = VirtualClock()
    monkeypatch.setattr(runner, "time", clock)
    registry("slow-peer", lambda: TimedMethod(clock, peer=True, load=1000.0))
    registry("lazy", lambda: TimedMethod(clock, peer=False, load=500.0, lazy=True))
    report = bench(tiny, methods=("plain", "lazy", "slow-peer"), warmup=0)
    peer_turns = [t for r in rows_of(report, "slow-peer") for t in r["turns"]]
    assert len(peer_turns) == sum(len(p["turns"]) for p in PROMPTS)
    assert all(t["wall_seconds"] == 1.0 for t in peer_turns)
    # The clock sees what the timed section holds: the lazy load, once.
    lazy_turns = [t["wall_seconds"] for r in rows_of(report, "lazy") for t in r["turns"]]
    assert lazy_turns == [501.0] + [1.0] * (len(lazy_turns) - 1)


def test_peers_need_the_loaded_models_file(tiny):
    report = bench(tiny, model="smollm2-135m", peer_transformers=True)
    info = report.methods["hf-plain"]
    assert info["status"] == "skipped" and "file is not known" in info["message"]


# -- reports -------------------------------------------------------------------

def test_report_files(tiny, tmp_path):
    report = bench(tiny, methods=("plain", "draft-k2"))
    written = write_reports(report, tmp_path / "out")
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert set(data) >= {"settings", "machine", "methods", "categories", "rows", "summary",
                         "notes"}
    for key in ("torch_threads", "cpu_model", "forerun_version", "date"):
        assert data["machine"][key] not in (None, "")
    assert data["settings"]["max_new_tokens"] == 6
    row = data["rows"][0]
    for key in ("question_id", "category", "method", "new_tokens", "wall_seconds",
                "tokens_per_second", "mean_accepted_tokens", "acceptance_rate", "mismatch",
                "turns"):
        assert key in row
    assert "prefill" in data["notes"]["tokens_per_second"]
    md = (tmp_path / "out" / "report.md").read_text()
    assert "draft-k2" in md and "Speedup over plain decoding by category" in md
    # The weight format the model ran in (what `--weights auto` chose).
    assert data["machine"]["weights"] == tiny[0].decoder.settings.weights
    assert f"on torch ({data['machine']['weights']} weights)" in md
    assert "prefill" in md
    if importlib.util.find_spec("matplotlib") is not None:
        png = tmp_path / "out" / "speedup.png"
        assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG"
        assert not written["messages"]


def test_reports_replace_their_own_files_but_never_a_users(tiny, tmp_path):
    """A folder's report files are rewritten when forerun wrote them, and a
    report.md of someone else's is refused, unchanged, unless forced."""
    report = bench(tiny, methods=("plain",), warmup=0)
    write_reports(report, tmp_path / "again")
    write_reports(report, tmp_path / "again")               # its own files: replaced
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "report.md").write_text("my notes")
    with pytest.raises(OutputPathError, match="holds report.md, which forerun did not write"):
        write_reports(report, mine)
    assert (mine / "report.md").read_text() == "my notes"
    assert not (mine / "report.json").exists()
    write_reports(report, mine, force=True)
    assert "plain" in (mine / "report.md").read_text()


def test_report_without_matplotlib(tiny, tmp_path, monkeypatch):
    report = bench(tiny, warmup=0)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    written = write_reports(report, tmp_path)
    assert not (tmp_path / "speedup.png").exists()
    assert (tmp_path / "report.md").is_file()
    assert "matplotlib is not installed" in written["messages"][0]


# -- the command line ----------------------------------------------------------

def test_cli_bench(tiny_folders, prompt_file, tmp_path, capsys):
    target, draft = tiny_folders
    out = tmp_path / "out"
    assert main(["bench", "--model", str(target), "--draft", str(draft), "--prompts",
                 str(prompt_file), "--methods", "plain,draft-k2", "--categories", "qa",
                 "--limit", "1", "-n", "4", "-t", "0,0.5", "--out", str(out), "-q"]) == 0
    captured = capsys.readouterr()
    assert "draft-k2" in captured.out and "speedup" in captured.out
    assert "temperature 0.5 (sampled)" in captured.out
    assert (out / "report.md").is_file() and (out / "report.json").is_file()
    data = json.loads((out / "report.json").read_text())
    assert data["settings"]["prompt_count"] == 1
    assert data["settings"]["temperatures"] == [0.0, 0.5]


def test_cli_bench_refuses_a_users_file_and_a_blank_out_before_running(
        tiny_folders, prompt_file, tmp_path, capsys):
    target, _ = tiny_folders
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "report.json").write_text("{}")
    args = ["bench", "--model", str(target), "--prompts", str(prompt_file), "--methods",
            "plain", "--limit", "1", "-n", "2", "-q"]
    assert main([*args, "--out", str(mine)]) == 1
    err = capsys.readouterr().err
    assert "holds report.json, which forerun did not write" in err and "--force" in err
    assert "Traceback" not in err and "bench: " not in err     # refused before running
    assert (mine / "report.json").read_text() == "{}"
    assert main([*args, "--out", " "]) == 1
    assert "--out is empty" in capsys.readouterr().err
    assert main([*args, "--out", str(mine), "--force"]) == 0
    assert json.loads((mine / "report.json").read_text())["settings"]


def test_cli_errors_are_clean(prompt_file, capsys):
    assert main(["bench", "--methods", "plain,turbo", "--prompts", str(prompt_file)]) == 1
    assert "unknown method 'turbo'" in capsys.readouterr().err
    assert main(["bench", "--prompts", "/nonexistent.jsonl"]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert main(["bench", "--list-methods"]) == 0
    listing = capsys.readouterr().out
    assert "draft-kN" in listing and "hf-assisted" in listing


# -- a real model --------------------------------------------------------------

@pytest.mark.real_model
@pytest.mark.exclusive_cpu
def test_real_model_with_llama_cpp(preset_model, tmp_path):
    """The llama.cpp peer needs a GGUF: the smallest preset, a few tokens."""
    model = preset_model("smollm2-135m")
    prompts = [p for p in load_prompts() if p.category == "qa"][:1]
    report = run_bench(settings(model="smollm2-135m", max_new_tokens=4, warmup=0,
                                peer_llama_cpp=True),
                       model=model, prompts=prompts, log=lambda m: None)
    assert report.methods["plain"]["status"] == "ok"
    llama = report.methods["llamacpp-plain"]
    if importlib.util.find_spec("llama_cpp") is None:
        assert llama["status"] == "skipped"
        return
    assert llama["status"] == "ok", llama
    assert report.methods["llamacpp-lookup"]["status"] == "ok"
    assert "llamacpp-matched" not in report.methods   # forerun runs on torch here
    row = rows_of(report, "llamacpp-plain")[0]
    assert row["new_tokens"] == rows_of(report, "plain")[0]["new_tokens"]
    assert row["plain_match"] is not None
    write_reports(report, tmp_path)
    assert (tmp_path / "report.json").is_file()


@pytest.mark.real_model
@pytest.mark.exclusive_cpu
def test_real_model_on_the_llama_cpp_engine(tmp_path, capsys):
    """``--engine llama.cpp``: forerun's rows run on llama.cpp, the prompt-
    lookup row reproduces plain decoding's tokens on that engine, the
    matched peer is set up like the engine (and computes its tokens) beside
    the stock ones, and Medusa (torch only) fails with a reason instead of
    ending the run."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed")
    from real_presets import require_preset

    require_preset("smollm2-135m")
    code = main(["bench", "-m", "smollm2-135m", "--engine", "llama.cpp", "--draft", "none",
                 "--methods", "plain,ngram,medusa", "--categories", "summarization",
                 "--limit", "1", "-n", "12", "--warmup", "0", "--peer-llama-cpp", "-q",
                 "-o", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["settings"]["engine"] == "llama.cpp"
    assert "on llama.cpp" in (tmp_path / "report.md").read_text()
    methods = report["methods"]
    assert methods["ngram"]["status"] == "ok"
    assert "torch engine" in (methods["medusa"]["message"] or "")
    assert "n_ubatch=512" in methods["llamacpp-matched"]["note"]
    assert "f16 keys, q8_0 values" in methods["llamacpp-matched"]["note"]
    assert "f16 keys, f16 values" in methods["llamacpp-plain"]["note"]
    assert methods["llamacpp-lookup"]["status"] == "ok", methods["llamacpp-lookup"]
    rows = {r["method"]: r for r in report["rows"] if r["status"] == "ok"}
    assert rows["ngram"]["mismatch"] is False
    assert rows["llamacpp-matched"]["plain_match"] == 1.0
    assert rows["llamacpp-lookup"]["mismatch"] is not None   # checked against llamacpp-plain
