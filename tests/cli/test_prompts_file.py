"""``forerun generate --prompts-file IN.jsonl --out OUT.jsonl``: every line
answered as ``forerun generate`` answers it alone, in input order, several
decoded together; bad files and lines are clean errors that name the line;
an existing output is kept unless ``--force``."""

from __future__ import annotations

import json

import pytest

import forerun
from forerun.cli.main import main

LINES = [
    '"the quick brown fox"',
    '{"prompt": "hello world", "id": "a", "max_new_tokens": 3}',
    '',
    '{"messages": [{"role": "user", "content": "hi there"}], "temperature": 0.7, "seed": 5}',
    '{"prompt_ids": [5, 6, 7, 8], "id": 7, "ignore_eos": true}',
    '{"prompt": "a b a b a b", "stop": ["b a"]}',
]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    from tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("prompts") / "tiny.gguf")


def _run(gguf, tmp_path, *extra, lines=LINES, out="out.jsonl"):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    return main(["generate", "-m", str(gguf), "--weights", "q8", "-n", "6", "-q",
                 "--prompts-file", str(src), "--out", str(tmp_path / out), *extra])


@pytest.mark.parametrize("draft, parallel", [("ngram", "3"), ("none", "1"), ("none", "8")])
def test_every_line_is_answered_as_generate_answers_it(gguf, tmp_path, draft, parallel):
    assert _run(gguf, tmp_path, "--draft", draft, "--parallel", parallel) == 0
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r.get("id") for r in rows] == [None, "a", None, 7, None]
    model = forerun.load(str(gguf), weights="q8", progress=False)

    def chat(text):
        return [{"role": "user", "content": text}]

    want = [model.generate(messages=chat("the quick brown fox"), max_new_tokens=6),
            model.generate(messages=chat("hello world"), max_new_tokens=3),
            model.generate(messages=chat("hi there"), max_new_tokens=6, temperature=0.7,
                           seed=5),
            model.generate(prompt_ids=[5, 6, 7, 8], max_new_tokens=6, ignore_eos=True),
            model.generate(messages=chat("a b a b a b"), max_new_tokens=6, stop=["b a"])]
    assert [r["tokens"] for r in rows] == [w.tokens for w in want]
    assert [r["text"] for r in rows] == [w.text for w in want]
    assert [r["finish_reason"] for r in rows] == [w.finish_reason for w in want]


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "a"', '"b"'], "line 1 is not JSON"),
    (['"a"', '{"prompt": "b", "max_tokens": 3}'], "line 2: unknown field 'max_tokens'"),
    (['"a"', '{"id": 3}'], "line 2: give exactly one of"),
    (['"a"', '[1, 2]'], "line 2: a line is a JSON string or object"),
    (['"a"', '', '{"prompt": "b", "max_new_tokens": -1}'], "line 3: max_new_tokens"),
    (['', ' '], "holds no prompt"),
])
def test_a_bad_line_is_named(gguf, tmp_path, capsys, lines, message):
    assert _run(gguf, tmp_path, lines=lines) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out.jsonl").exists()


def test_paths_and_options_are_checked_first(gguf, tmp_path, capsys):
    (tmp_path / "out.jsonl").write_text("mine\n")
    assert _run(gguf, tmp_path) == 1
    assert "exists; give another file, or --force" in capsys.readouterr().err
    assert (tmp_path / "out.jsonl").read_text() == "mine\n"
    assert _run(gguf, tmp_path, "--force") == 0
    assert (tmp_path / "out.jsonl").read_text().count("\n") == 5
    for args, message in [
            (["--prompts-file", str(tmp_path / "none.jsonl"), "--out", "x"], "is not a file"),
            (["--prompts-file", str(tmp_path / "in.jsonl")], "needs --out"),
            (["--prompts-file", str(tmp_path / "in.jsonl"), "--out", ""], "needs --out"),
            (["--prompts-file", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "o"),
              "--parallel", "0"], "--parallel must be a positive integer"),
            (["--prompts-file", str(tmp_path / "in.jsonl"), "--out",
              str(tmp_path / "in.jsonl"), "--force"], "is the prompts file itself"),
            (["hi", "--out", "x.jsonl"], "--out goes with --prompts-file"),
            (["--prompts-file", str(tmp_path / "in.jsonl"), "--out", "x", "hi"], "not both"),
            ([], "give a prompt")]:
        assert main(["generate", "-m", str(gguf), *args]) == 1, args
        err = capsys.readouterr().err
        assert message in err, (args, err)
