"""Magpie data: the user prefix cut from chat templates (ChatML with its
default system prompt, Llama 3, Llama 2), the templates refused, the
quality and benchmark filters, and a run stopped midway then resumed
making exactly the records of a run that never stopped."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from forerun.corpus.token_manifest import ManifestWriter, TokenManifest
from forerun.errors import ConfigError, ForerunError
from forerun.tokenizer import Tokenizer
from forerun.training.magpie import (
    SENTINEL,
    BenchOverlap,
    DataBuilder,
    DataSettings,
    degenerate,
    item_seed,
    magpie_prefix,
    new_counters,
    new_state,
)

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
            "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# Qwen2.5-Instruct's template (as the Qwen2.5-Coder GGUFs carry it): ChatML,
# with a default system prompt when the conversation has none.
QWEN25 = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == "
    "'system' %}\n        {{- messages[0]['content'] }}\n    {%- else %}\n        {{- 'You are"
    " Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    "{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n        {{- '<|im_start|>"
    "system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n        {{- "
    "'<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages "
    "%}\n    {%- if (message.role == \"user\") or (message.role == \"system\" and not "
    "loop.first) or (message.role == \"assistant\" and not message.tool_calls) %}\n        "
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>"
    "assistant\\n' }}\n{%- endif %}\n")
# SmolLM2-Instruct's (a Llama model with a ChatML template)
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' "
           "%}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
           "Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
           "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt "
           "%}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Llama 3-Instruct's
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content "
          "= '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content']"
          " | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + "
          "content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
          "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# Llama 2-chat's: [INST] ... [/INST], roles must alternate starting with the user
LLAMA2 = ("{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 "
          "== 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/"
          "assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + "
          "'[INST] ' + message['content'].strip() + ' [/INST]' }}{% elif message['role'] == "
          "'assistant' %}{{ ' '  + message['content'].strip() + ' ' + eos_token }}{% endif %}"
          "{% endfor %}")


def tokenizer(template: str | None, bos: str = "<s>") -> Tokenizer:
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["system user assistant You are a helpful assistant"] * 20,
                                trainer)
    return Tokenizer(backend, bos_token_id=backend.token_to_id(bos),
                     eos_token_id=backend.token_to_id("</s>"), chat_template=template)


@pytest.mark.parametrize("template, system", [
    (QWEN25, "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
    (SMOLLM2, "You are a helpful AI assistant named SmolLM, trained by Hugging Face")],
    ids=["qwen2.5", "smollm2"])
def test_a_chatml_prefix_ends_at_the_user_turn_with_the_default_system_prompt(template,
                                                                               system):
    tok = tokenizer(template)
    prefix = magpie_prefix(tok)
    assert prefix.text == f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"
    assert tok.decode(list(prefix.ids)) == prefix.text
    assert prefix.ids[0] == tok.token_to_id("<|im_start|>")
    # the user's turn ends at <|im_end|>, a special token: generation stops on it
    assert prefix.stop_token_ids == (tok.token_to_id("<|im_end|>"),) and prefix.stop == ()
    # a conversation the template renders starts with the prefix, then the user's text
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert rendered.startswith(prefix.text + "Hi there")


def test_a_llama3_prefix_starts_with_bos_and_stops_at_eot():
    tok = tokenizer(LLAMA3, bos="<|begin_of_text|>")
    prefix = magpie_prefix(tok)
    assert prefix.text == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
    assert prefix.ids[:2] == (tok.token_to_id("<|begin_of_text|>"),
                              tok.token_to_id("<|start_header_id|>"))
    assert prefix.stop_token_ids == (tok.token_to_id("<|eot_id|>"),)


def test_a_llama2_prefix_stops_at_the_inst_marker_as_text():
    prefix = magpie_prefix(tokenizer(LLAMA2))
    assert prefix.text == "<s>[INST] "
    assert prefix.stop_token_ids == () and prefix.stop == ("[/INST]",)


@pytest.mark.parametrize("template, message", [
    (None, "has no chat template"),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "nothing before it"),
    ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
     "nothing before it"),
    ("{% for m in messages %}### {{ m['content'] }}\n{% endfor %}", "alike"),
    ("{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}{% endif %}"
     "{% endfor %}", "does not write the user's message"),
    ("{{ raise_exception('system message required') }}", "can't render"),
], ids=["none", "content-only", "bos-and-content", "roles-alike", "system-only", "raises"])
def test_a_template_without_a_user_turn_is_refused(template, message):
    with pytest.raises(ConfigError, match=message):
        magpie_prefix(tokenizer(template))


@pytest.mark.needs_preset("qwen2.5-coder-1.5b", "smollm2-135m")
def test_the_presets_prefixes():
    from forerun.loading.gguf_file import GGUFFile
    from forerun.tokenizer import tokenizer_from_gguf_metadata
    from real_presets import require_preset

    for name, system in (("qwen2.5-coder-1.5b", "You are Qwen"),
                         ("smollm2-135m", "You are a helpful AI assistant named SmolLM")):
        tok = tokenizer_from_gguf_metadata(GGUFFile(require_preset(name)).metadata)
        prefix = magpie_prefix(tok)
        assert prefix.text.startswith(f"<|im_start|>system\n{system}")
        assert prefix.text.endswith("<|im_end|>\n<|im_start|>user\n")
        assert prefix.stop_token_ids == (tok.token_to_id("<|im_end|>"),)


def test_the_sentinel_is_plain_text():
    assert "<" not in SENTINEL and "{" not in SENTINEL


# -- filters -------------------------------------------------------------------

def test_repetitive_tokens_are_degenerate_and_ordinary_ones_are_not():
    rng = np.random.default_rng(0)
    assert degenerate([5, 6, 7] * 20)
    assert degenerate(list(rng.integers(0, 1000, 20)) + [1, 2, 3, 4] * 30)
    assert not degenerate(list(rng.integers(0, 1000, 200)))
    assert not degenerate([1, 1, 1, 1] * 5)          # too short to judge


def test_benchmark_prompts_are_kept_out_copied_or_paraphrased():
    from forerun.bench.prompts import load_prompts

    turns = [t for p in load_prompts() for t in p.turns]
    bench = BenchOverlap(turns)
    # a long stretch copied from one (here with other words around it)
    assert bench.overlaps("Please: explain what a mortgage offset account is, in plain "
                          "terms, for me", query=True)
    # a short question reworded
    assert bench.overlaps("What's the difference between weather and climate?", query=True)
    assert bench.overlaps("what is the difference between TCP and UDP?", query=True)
    # a text chunk holding a sentence of one (queries only are checked for paraphrases)
    assert bench.overlaps("x = 1\n# Why do we have leap years, and why is the year 1900 not "
                          "a leap year while 2000 was?\n")
    assert not bench.overlaps("What's the difference between weather and climate?")
    # unrelated requests pass
    for query in ("Write a Python function that parses ISO dates.",
                  "What is the difference between a list and a tuple in Python?",
                  "How do I sort a dictionary by value?"):
        assert not bench.overlaps(query, query=True), query
    assert BenchOverlap(turns).digest == bench.digest != BenchOverlap(turns[1:]).digest


def test_item_seeds_are_fixed_and_distinct():
    seeds = [item_seed(0, i) for i in range(1000)]
    assert seeds == [item_seed(0, i) for i in range(1000)]
    assert len(set(seeds)) == 1000 and item_seed(1, 0) != item_seed(0, 0)


def test_a_topic_is_the_system_message_of_the_prefix():
    tok = tokenizer(QWEN25)
    topic = "You are an assistant that translates texts between languages."
    prefix = magpie_prefix(tok, topic)
    assert prefix.text == f"<|im_start|>system\n{topic}<|im_end|>\n<|im_start|>user\n"
    assert prefix.stop_token_ids == magpie_prefix(tok).stop_token_ids
    with pytest.raises(ConfigError, match="--topic"):
        magpie_prefix(tokenizer(LLAMA2), topic)      # roles must alternate from the user's


def test_settings_that_change_the_data_are_differences_and_the_draft_only_when_sampling():
    a = DataSettings(seed=1, answer_draft="ngram")
    assert a.differences(DataSettings(seed=1, answer_draft="none")) == []
    assert a.differences(DataSettings(seed=2))[0].startswith("seed: 2 in the manifest")
    sampled = DataSettings(answer_temperature=0.7, answer_draft="ngram")
    assert sampled.differences(DataSettings(answer_temperature=0.7)) != []
    assert DataSettings.from_json(a.to_json()) == a
    topics = DataSettings(seed=1, topics=("Translate.", "Summarise."))
    assert DataSettings.from_json(topics.to_json()) == topics
    assert topics.differences(DataSettings(seed=1))[0].startswith("topics: ()")
    # cut answers are kept by default; a manifest from before the setting dropped them
    assert DataSettings().keep_cut_answers
    old = {k: v for k, v in a.to_json().items() if k != "keep_cut_answers"}
    assert not DataSettings.from_json(old).keep_cut_answers
    assert a.differences(DataSettings.from_json(old)) == [
        "keep_cut_answers: False in the manifest, True now"]
    for bad in (dict(query_temperature=0), dict(query_top_p=0), dict(text_share=2),
                dict(max_answer_tokens=0), dict(seq_len=8), dict(seed=-1),
                dict(topics=("",))):
        with pytest.raises(ConfigError):
            DataSettings(**bad).validate()


# -- a run, stopped and resumed --------------------------------------------------

def chat_model_folder(folder: Path) -> Path:
    """A tiny random Qwen2 (tests/tiny_models) as a Hugging Face folder
    whose end-of-sequence token ends most of its sampled generations
    within 32 tokens (its greedy answers end at once: empty), and which
    never emits the id its tokenizer lacks."""
    from tiny_models import hf_model, tiny_tokenizer_json

    model = hf_model("qwen2", seed=0)
    ids = torch.randint(3, 299, (16, 64), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state.reshape(-1, model.config.hidden_size)
        mean = hidden.mean(0)
        _, _, v = torch.pca_lowrank(hidden - mean, q=4)
        model.lm_head.weight[2] = 0.43 * mean / mean.norm() + 0.5 * v[:, 1]
        model.lm_head.weight[299] = -10 * mean / mean.norm()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tiny_tokenizer_json(folder)
    return folder


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    import forerun

    return forerun.load(str(chat_model_folder(tmp_path_factory.mktemp("chat"))),
                        progress=False)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    words = "the quick brown fox jumps over the lazy dog hello world".split()
    rng = np.random.default_rng(0)
    for n in range(4):
        text = " ".join(rng.choice(words, 100))
        if n == 3:   # a sentence the benchmark holds
            text += " " + BENCH_SENTENCE + " " + " ".join(rng.choice(words, 20))
        (folder / f"f{n}.txt").write_text(text)
        (folder / f"copy{n}.txt").write_text(text)     # duplicates
    (folder / "empty.txt").write_text("")
    return folder


BENCH_SENTENCE = "alpha beta gamma delta epsilon zeta eta theta iota"


# Sampled answers: the tiny model's greedy ones are empty, and sampled ones
# test more (the answer's seed must be the item's again after a resume).
SETTINGS = DataSettings(seed=3, max_query_tokens=32, answer_temperature=1.0,
                        max_answer_tokens=24, seq_len=64, text_share=0.3)


class StopAt:
    """The model, whose ``n``-th generation sets ``stop`` as it starts (a
    Ctrl-C in the middle of a query or an answer)."""

    def __init__(self, model, stop: threading.Event, n: int) -> None:
        self.model, self.stop, self.n, self.calls = model, stop, n, 0
        self.tokenizer, self.decoder, self.name = model.tokenizer, model.decoder, model.name
        self.eos_token_ids = model.eos_token_ids

    def encode_prompt(self, *args, **kwargs):
        return self.model.encode_prompt(*args, **kwargs)

    def generate(self, *args, **kwargs):
        self._count()
        return self.model.generate(*args, **kwargs)

    def run_pool(self, *args, **kwargs):
        return self.model.run_pool(*args, **kwargs)

    def stream_in_batch(self, *args, **kwargs):
        self._count()
        return self.model.stream_in_batch(*args, **kwargs)

    def _count(self) -> None:
        self.calls += 1
        if self.calls == self.n:
            self.stop.set()


def build(model, out: Path, corpus: Path, *, max_tokens: int, stop_at: int | None = None,
          resume: bool = False, checkpoint_seconds: float = 0.0, parallel: int = 1,
          stop_after_records: int | None = None):
    """``stop_at``: a stop request as the n-th generation starts;
    ``stop_after_records``: one as the n-th record is kept (a batch's other
    items in the middle of their generations)."""
    from forerun.corpus.text_files import corpus_files

    fp = model.tokenizer.fingerprint()
    if resume:
        writer = ManifestWriter.resume(out, fingerprint=fp)
    else:
        writer = ManifestWriter.create(out, model=model.name, fingerprint=fp,
                                       vocab_size=model.decoder.vocab_size,
                                       settings=SETTINGS.to_json(), shard_tokens=700,
                                       state=new_state(), counters=new_counters())
    stop = threading.Event()
    runner = StopAt(model, stop, stop_at) if stop_at else model
    if stop_after_records:
        stop_after(writer, stop, stop_after_records)
    builder = DataBuilder(runner, writer, SETTINGS, files=corpus_files([corpus]),
                          bench=BenchOverlap([BENCH_SENTENCE]),
                          max_tokens=max_tokens, stop=stop,
                          checkpoint_seconds=checkpoint_seconds, parallel=parallel)
    return builder.run()


def stop_after(writer: ManifestWriter, stop: threading.Event, n: int) -> None:
    """Set ``stop`` as ``writer`` keeps its ``n``-th record."""
    add, kept = writer.add, []

    def add_then_stop(record):
        add(record)
        kept.append(record)
        if len(kept) == n:
            stop.set()

    writer.add = add_then_stop


def contents(path: Path):
    m = TokenManifest.open(path)
    records = [(r.tokens.tolist(), r.kind, r.loss_start, r.seed, r.query, r.source, r.key)
               for r in m]
    return records, m.counts, m.data["counters"], m.data["state"], [
        (s["file"], len(s["records"])) for s in m.data["shards"]]


def test_a_run_stopped_twice_and_resumed_makes_the_records_of_one_that_never_stopped(
        chat_model, corpus, tmp_path):
    report = build(chat_model, tmp_path / "whole", corpus, max_tokens=2500)
    assert report.stopped == "budget"
    whole = contents(tmp_path / "whole")
    records, counts, counters, state, shards = whole
    kinds = {r[1] for r in records}
    assert kinds == {"conversation", "text"} and state["complete"]
    assert len(shards) > 1                       # the 700-token shards closed in turn
    # every filter had work: over-long queries, duplicate text, the benchmark
    assert counters["queries"]["dropped"]["too_long"] > 0
    assert counters["text"]["dropped"]["duplicate"] > 0
    assert counters["text"]["dropped"]["bench_overlap"] > 0
    cut = 0
    for r in records:
        if r[1] == "conversation":
            tokens, loss_start = r[0], r[2]
            prompt = chat_model.encode_prompt(messages=[{"role": "user", "content": r[4]}])
            assert tokens[:loss_start] == prompt
            if tokens[-1] not in chat_model.eos_token_ids:     # cut at the longest answer
                assert len(tokens) - loss_start == SETTINGS.max_answer_tokens
                cut += 1
        else:
            assert r[2] == 0 and len(r[0]) <= SETTINGS.seq_len
    assert cut > 0 and counters["answers"]["cut"] == cut      # kept, and counted
    assert counters["answers"]["dropped"]["too_long"] == 0

    out = tmp_path / "stopped"
    first = build(chat_model, out, corpus, max_tokens=2500, stop_at=9)
    assert first.stopped == "signal"
    partial = contents(out)[0]
    assert 0 < len(partial) < len(records) and partial == records[:len(partial)]
    second = build(chat_model, out, corpus, max_tokens=2500, stop_at=30, resume=True)
    assert second.stopped == "signal"
    third = build(chat_model, out, corpus, max_tokens=2500, resume=True)
    assert third.stopped == "budget"
    assert contents(out) == whole
    assert len(TokenManifest.open(out).data["runs"]) == 3
    # nothing but the manifest and the shards it names is left
    names = {p.name for p in out.iterdir()}
    assert names == {"manifest.json"} | {f for f, _ in shards}


def test_a_query_stops_at_a_special_token_that_dooms_it_and_the_records_stay_the_same(
        chat_model, corpus, tmp_path, monkeypatch):
    """A query stops at the first special token other than its turn's end
    and the end of text (it would be dropped whatever followed), so a run
    generates fewer query tokens and keeps the very records of a run that
    generated them all.  Its broken twin, one that also stops at the end
    of text (a query ending there is kept), keeps other records."""
    import forerun.training.magpie as magpie

    doomed = magpie.doomed_tokens
    prefix = magpie.magpie_prefix(chat_model.tokenizer)
    assert doomed(chat_model.tokenizer.special_token_ids, prefix, chat_model.eos_token_ids) \
        == chat_model.tokenizer.special_token_ids - set(prefix.stop_token_ids) \
        - set(chat_model.eos_token_ids)
    ends = build(chat_model, tmp_path / "stops", corpus, max_tokens=2500)
    stopped = contents(tmp_path / "stops")
    monkeypatch.setattr(magpie, "doomed_tokens", lambda *a: frozenset())
    runs_on = build(chat_model, tmp_path / "runs-on", corpus, max_tokens=2500)
    whole = contents(tmp_path / "runs-on")
    assert stopped[0] == whole[0]                       # the records
    assert ends.query_tokens < runs_on.query_tokens, (ends.query_tokens, runs_on.query_tokens)
    dropped = stopped[2]["queries"]["dropped"]
    assert dropped["special_tokens"] > whole[2]["queries"]["dropped"]["special_tokens"]
    assert sum(dropped.values()) == sum(whole[2]["queries"]["dropped"].values())
    monkeypatch.setattr(magpie, "doomed_tokens", lambda specials, p, eos: (
        doomed(specials, p, eos) | set(eos)))
    try:            # (this model's queries mostly end at the end of text)
        build(chat_model, tmp_path / "eos", corpus, max_tokens=2500)
        twin = contents(tmp_path / "eos")[0]
    except ForerunError as e:
        assert "were all dropped" in str(e)
        twin = None
    assert twin != whole[0]


def test_conversations_made_in_parallel_are_the_records_of_one_at_a_time(
        chat_model, corpus, tmp_path):
    """Queries and answers generated several at a time, with a stop and a
    resume at another width between: the manifest of a run of one item at a
    time, record for record, counters and shards too."""
    build(chat_model, tmp_path / "one", corpus, max_tokens=2500)
    whole = contents(tmp_path / "one")
    build(chat_model, tmp_path / "eight", corpus, max_tokens=2500, parallel=8)
    assert contents(tmp_path / "eight") == whole
    out = tmp_path / "stopped"
    assert build(chat_model, out, corpus, max_tokens=2500, stop_after_records=3,
                 parallel=4).stopped == "signal"
    assert 3 == len(contents(out)[0]) < len(whole[0])
    assert build(chat_model, out, corpus, max_tokens=2500, resume=True,
                 parallel=3).stopped == "budget"
    assert contents(out) == whole
    with pytest.raises(ConfigError, match="--parallel"):
        build(chat_model, tmp_path / "zero", corpus, max_tokens=10, parallel=0)


def test_an_answer_cut_at_the_longest_is_kept_unless_asked_to_drop_it(chat_model):
    """Sampled answers of at most 4 tokens: one that doesn't end by then is
    kept as it stands (the target's own tokens, no end of turn) by default,
    and dropped as too long with ``keep_cut_answers=False``."""
    from dataclasses import replace

    from forerun.training.magpie import Magpie

    keep = Magpie(chat_model, replace(SETTINGS, max_answer_tokens=4))
    drop = Magpie(chat_model, replace(SETTINGS, max_answer_tokens=4, keep_cut_answers=False))
    prompt = keep.prompt("the quick brown fox")
    outcomes = [(keep.answer(prompt, seed), drop.answer(prompt, seed)) for seed in range(6)]
    cut = [(k, d) for k, d in outcomes if k.cut]
    assert cut, "no answer ran to the limit"
    for k, d in cut:
        assert k.dropped is None and len(k.tokens) == 4
        assert k.tokens[-1] not in chat_model.eos_token_ids
        assert d.dropped == "too_long" and d.tokens == k.tokens and not d.cut
    for k, d in outcomes:
        if not k.cut:        # answers that ended are the same either way
            assert not d.cut and d.dropped == k.dropped
            assert k.tokens[-1] in chat_model.eos_token_ids


def test_a_time_budget_ends_a_run_and_a_resume_continues_it(chat_model, corpus, tmp_path):
    whole = tmp_path / "whole"
    build(chat_model, whole, corpus, max_tokens=900, checkpoint_seconds=60)
    out = tmp_path / "timed"
    from forerun.corpus.text_files import corpus_files

    fp = chat_model.tokenizer.fingerprint()
    writer = ManifestWriter.create(out, model=chat_model.name, fingerprint=fp,
                                   vocab_size=chat_model.decoder.vocab_size,
                                   settings=SETTINGS.to_json(), shard_tokens=700,
                                   state=new_state(), counters=new_counters())
    report = DataBuilder(chat_model, writer, SETTINGS, files=corpus_files([corpus]),
                         bench=BenchOverlap([BENCH_SENTENCE]),
                         max_tokens=900, max_seconds=0.05).run()
    assert report.stopped == "time"
    assert not TokenManifest.open(out).complete
    build(chat_model, out, corpus, max_tokens=900, resume=True)
    assert contents(out)[:4] == contents(whole)[:4]


def test_greedy_answers_with_prompt_lookup_and_a_model_whose_data_is_all_dropped(
        chat_model, tmp_path):
    """The tiny model's greedy answers end at once (empty): the run gives up
    after a streak of conversations that kept nothing, saying why, and
    keeps its counts."""
    from forerun.errors import ForerunError
    from forerun.speculation.config import resolve

    greedy = DataSettings(seed=3, max_query_tokens=32, max_answer_tokens=48,
                          answer_draft="ngram")
    fp = chat_model.tokenizer.fingerprint()
    writer = ManifestWriter.create(tmp_path / "m", model=chat_model.name, fingerprint=fp,
                                   vocab_size=chat_model.decoder.vocab_size,
                                   settings=greedy.to_json(), state=new_state(),
                                   counters=new_counters())
    builder = DataBuilder(chat_model, writer, greedy, answer_speculative=resolve("ngram"),
                          max_tokens=1000, give_up_after=12)
    with pytest.raises(ForerunError, match="the last 12 conversations were all dropped"):
        builder.run()
    counters = TokenManifest.open(tmp_path / "m").data["counters"]
    assert counters["answers"]["made"] > 0
    assert counters["answers"]["dropped"]["empty"] == counters["answers"]["made"]
    assert TokenManifest.open(tmp_path / "m").data["runs"][-1]["stopped"] == "error"


def test_queries_take_the_topics_in_turn_and_answers_none(chat_model):
    """Item i's query is written after topic i mod n's prefix; the answer's
    prompt is the plain chat template, whatever the topic."""
    from forerun.training.magpie import Magpie

    class Recorder:
        def __init__(self, model) -> None:
            self.model, self.prompts = model, []
            self.tokenizer, self.decoder, self.name = model.tokenizer, model.decoder, model.name
            self.eos_token_ids = model.eos_token_ids

        def encode_prompt(self, *args, **kwargs):
            return self.model.encode_prompt(*args, **kwargs)

        def generate(self, *args, **kwargs):
            self.prompts.append(list(kwargs["prompt_ids"]))
            return self.model.generate(*args, **kwargs)

    topics = ("You write poems.", "You translate texts.")
    model = Recorder(chat_model)
    magpie = Magpie(model, DataSettings(topics=topics, max_query_tokens=4,
                                        max_answer_tokens=4))
    for index in range(3):
        magpie.query(seed=index, index=index)
    tok = chat_model.tokenizer
    wanted = [list(magpie_prefix(tok, topics[i % 2]).ids) for i in range(3)]
    assert model.prompts == wanted and wanted[0] != wanted[1]
    prompt = magpie.prompt("Hello there")
    assert prompt == chat_model.encode_prompt(messages=[{"role": "user", "content": "Hello there"}])


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """Code and prose with lines, a copy of one (a duplicate) and a file
    holding a benchmark sentence."""
    folder = tmp_path_factory.mktemp("documents")
    words = "the quick brown fox jumps over the lazy dog hello world".split()
    rng = np.random.default_rng(1)

    def lines(n: int, indent: str = "") -> str:
        return "".join(indent + " ".join(rng.choice(words, 6)) + "\n" for _ in range(n))

    (folder / "a.py").write_text(lines(60, "    "))
    (folder / "b.md").write_text(lines(80))
    (folder / "c.txt").write_text(lines(3) + BENCH_SENTENCE + "\n" + lines(3))
    (folder / "copy.md").write_text((folder / "b.md").read_text())
    return folder


def test_documents_are_chat_wrapped_with_the_loss_from_the_document_and_resume_alike(
        chat_model, documents, tmp_path):
    """``text_layout="chat"``: every chunk of the corpus becomes the
    conversation the target reads (the chunk, then a request about it, the
    assistant's turn opened), its lines whole, its loss from its first
    token of the document; filtered as text chunks are; a run stopped and
    resumed makes the same records."""
    from dataclasses import replace

    from forerun.corpus.text_files import corpus_files
    from forerun.training.documents import CODE_REQUESTS, SEPARATOR, TEXT_REQUESTS

    settings = replace(SETTINGS, text_share=1.0, text_layout="chat", seq_len=320)
    files = corpus_files([documents])
    fp = chat_model.tokenizer.fingerprint()

    def run(out: Path, *, resume: bool = False, stop_at_record: int | None = None):
        writer = (ManifestWriter.resume(out, fingerprint=fp) if resume else
                  ManifestWriter.create(out, model=chat_model.name, fingerprint=fp,
                                        vocab_size=chat_model.decoder.vocab_size,
                                        settings=settings.to_json(), state=new_state(),
                                        counters=new_counters()))
        stop = threading.Event()
        if stop_at_record:
            stop_after(writer, stop, stop_at_record)
        return DataBuilder(chat_model, writer, settings, files=files,
                           bench=BenchOverlap([BENCH_SENTENCE]), max_tokens=10**6,
                           stop=stop).run()

    assert run(tmp_path / "whole").stopped == "corpus"
    records, counts, counters, state, _ = contents(tmp_path / "whole")
    assert {r[1] for r in records} == {"document"} and counts["document"]["records"] > 4
    assert counters["text"]["dropped"]["duplicate"] > 0
    assert counters["text"]["dropped"]["bench_overlap"] > 0
    tok = chat_model.tokenizer
    prefix = list(magpie_prefix(tok).ids)
    for tokens, _, loss_start, _, request, source, _ in records:
        assert len(tokens) <= settings.seq_len
        assert request in (CODE_REQUESTS if source.split("#")[0].endswith(".py")
                           else TEXT_REQUESTS)
        assert tokens[:loss_start] == prefix[:loss_start] and loss_start >= len(prefix) - 1
        rendered = tok.decode(tokens)
        document = rendered[len(magpie_prefix(tok).text):rendered.index(SEPARATOR + request)]
        assert tokens == chat_model.encode_prompt(
            messages=[{"role": "user", "content": document + SEPARATOR + request}])
        original = (documents / Path(source.split("#")[0]).name).read_text()
        assert document.strip() + "\n" in original       # whole lines of the file
    out = tmp_path / "stopped"
    assert run(out, stop_at_record=2).stopped == "signal"
    assert len(contents(out)[0]) == 2
    assert run(out, resume=True).stopped == "corpus"
    assert contents(out) == contents(tmp_path / "whole")
    # at most the first chunk of each file
    settings = replace(settings, max_file_chunks=1)
    assert run(tmp_path / "firsts").stopped == "corpus"
    firsts = contents(tmp_path / "firsts")[0]
    assert {r[5].split("#")[1] for r in firsts} == {"0"}
    assert [r for r in records if r[5].endswith("#0")] == firsts
