"""Tiny Hugging Face models for the benchmark harness's tests."""

import json

import pytest
import torch

import forerun
from tiny_models import hf_model, tiny_tokenizer_json

PROMPTS = [
    {"question_id": 1, "category": "qa", "turns": ["hello world"]},
    {"question_id": 2, "category": "qa", "turns": ["the quick brown fox"]},
    {"question_id": 3, "category": "chat", "turns": ["hello", "the lazy dog"]},
]


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: the tiny models gain nothing from more, and on a
    busy machine idle threads spinning for work make them 100x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_folders(tmp_path_factory):
    """A target and a draft folder: tiny Qwen2 models sharing a tokenizer."""
    root = tmp_path_factory.mktemp("bench-models")
    folders = []
    for name, seed in (("target", 3), ("draft", 4)):
        folder = root / name
        hf_model("qwen2", seed=seed).save_pretrained(folder, safe_serialization=True)
        tiny_tokenizer_json(folder)
        folders.append(folder)
    return tuple(folders)


@pytest.fixture(scope="session")
def tiny(tiny_folders):
    """(target Model, draft Model, target folder, draft folder)."""
    target, draft = tiny_folders
    load = lambda f: forerun.load(f, context_length=256, device="cpu", progress=False)  # noqa: E731
    return load(target), load(draft), target, draft


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


@pytest.fixture
def registry(monkeypatch):
    """A private copy of the method registry: methods registered in a test
    vanish after it."""
    from forerun.bench import registry

    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))
    return registry.register_method
