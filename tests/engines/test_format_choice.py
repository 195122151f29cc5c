"""weights='auto': each candidate format is timed on the model's shapes, the
fastest is chosen, the choice is kept per machine and measured again when
its record is damaged, and load() runs the model in it."""

from __future__ import annotations

import torch

import forerun
import forerun.engines.format_choice as format_choice
from forerun.api.loader import choose_weights
from forerun.engines.format_choice import FormatChoice, choose_format, time_formats
from forerun.engines.linear import Int4Groups, Int8Rows
from forerun.engines.timed_blocks import TIMED_POSITIONS, random_weights
from forerun.protocol.model_config import ModelConfig
from tiny_gguf import write_tiny_gguf

CPU = torch.device("cpu")


def config(hidden=64, intermediate=128) -> ModelConfig:
    return ModelConfig.from_hf({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0})


def test_each_candidate_is_timed_at_each_length():
    ms = time_formats(config(), ("q4", "q8", "bfloat16", "float32"), CPU)
    assert set(ms) == {"q4", "q8", "bfloat16", "float32"}
    for row in ms.values():
        assert len(row) == len(TIMED_POSITIONS) and all(0 < v < 1e4 for v in row)


def test_timed_weights_are_in_the_format_they_time():
    gen = torch.Generator().manual_seed(0)
    assert isinstance(random_weights("q4", 32, 64, gen), Int4Groups)
    assert isinstance(random_weights("q4", 32, 40, gen), Int8Rows)   # no whole groups
    assert isinstance(random_weights("q8", 32, 64, gen), Int8Rows)
    assert random_weights("bfloat16", 32, 64, gen).dtype == torch.bfloat16
    assert random_weights("float32", 32, 64, gen).dtype == torch.float32


def test_the_fastest_over_both_lengths_is_chosen():
    assert choose_format({"q4": [5.0, 9.0], "q8": [4.0, 20.0], "float32": [30.0, 31.0]}) == "q4"
    assert choose_format({"q4": [5.0, 9.0], "bfloat16": [6.0, 7.0]}) == "bfloat16"


def test_the_choice_is_kept_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path))
    calls = []

    def fake(cfg, candidates, device):
        calls.append(candidates)
        return {fmt: [10.0 + n, 20.0] for n, fmt in enumerate(candidates)}
    monkeypatch.setattr(format_choice, "time_formats", fake)
    first = choose_weights("tiny", config(), CPU)
    assert first.format == "q4" and len(calls) == 1
    assert choose_weights("tiny", config(), CPU) == first and len(calls) == 1
    choose_weights("tiny", config(hidden=96), CPU)          # another shape: measured
    assert len(calls) == 2
    for record in (tmp_path / "calibration" / "weights").glob("*.json"):
        record.write_text('{"format": "q9"}')
    assert choose_weights("tiny", config(), CPU) == first and len(calls) == 3


def test_a_stored_choice_must_name_a_candidate():
    ms = {"q4": [1.0, 2.0], "q8": [1.0, 2.0]}
    assert FormatChoice.from_dict({"format": "q4", "milliseconds": ms}, ("q4", "q8"))
    assert FormatChoice.from_dict({"format": "q5", "milliseconds": ms}, ("q4", "q8")) is None
    assert FormatChoice.from_dict({"format": "q4", "milliseconds": {"q4": [1.0, 2.0]}},
                                  ("q4", "q8")) is None
    bad = {"q4": [1.0, float("nan")], "q8": [1.0, 2.0]}
    assert FormatChoice.from_dict({"format": "q4", "milliseconds": bad}, ("q4", "q8")) is None


def test_auto_loads_the_chosen_format(tmp_path, monkeypatch):
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    for fmt in ("q8", "bfloat16"):
        monkeypatch.setattr(forerun.api.loader, "choose_weights",
                            lambda name, cfg, device, fmt=fmt: FormatChoice(fmt, {}))
        model = forerun.load(path, context_length=64, progress=False)
        assert model.decoder.settings.weights == fmt
