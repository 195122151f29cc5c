"""How prompt blocks multiply int8 matrices: the float32 product of
dequantized slices for blocks of GEMM_ROWS positions or more, the int8
kernel below; the choice is measured, kept per machine and measured again
when its record is damaged; verification never reaches the other kernel, so
greedy speculative decoding stays plain decoding."""

from __future__ import annotations

import pytest
import torch

import forerun
import forerun.engines.prefill_kernel as prefill_kernel
from engines.test_format_choice import config
from engines.test_linear import _network
from forerun.engines.linear import DEQUANT_SLICE, Int8Linear, Int8Rows, quantize_int8
from forerun.engines.prefill_kernel import (
    GEMM_ROWS,
    PREFILL_KERNELS,
    PrefillChoice,
    choose_prefill_kernel,
    time_prefill_kernels,
)
from forerun.engines.torch_engine import TorchDecoder
from forerun.engines.transformer import Transformer
from forerun.errors import ConfigError
from forerun.protocol.grouping_probe import MAX_GROUP
from forerun.protocol.model_config import ModelConfig
from tiny_gguf import write_tiny_gguf
from tiny_models import hf_model

# What is chosen here is how torch's int8 layer multiplies a prompt block;
# forerun's native layers (tests/native_kernels) run one kernel for any number of rows.
pytestmark = pytest.mark.usefixtures("torch_kernels")

CPU = torch.device("cpu")


def _as_held(w: torch.Tensor) -> torch.Tensor:
    """``w`` as an int8 layer holds it: int8 rows, each with a bfloat16 scale."""
    values = quantize_int8(w)
    return Int8Rows(values.q, values.scale.bfloat16().float()).dequantize()


def _layer(rows: int = DEQUANT_SLICE * 2 + 52, cols: int = 96) -> tuple[Int8Linear, torch.Tensor]:
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)) * 0.05
    return Int8Linear(quantize_int8(w), None, CPU), _as_held(w)


def test_a_prompt_block_gets_the_float32_product_of_the_int8_values():
    layer, w = _layer()
    x = torch.randn(GEMM_ROWS + 8, w.shape[1], generator=torch.Generator().manual_seed(1))
    exact = (x.double() @ w.double().t()).float()
    int8_kernel = layer(x)
    layer.gemm_rows = GEMM_ROWS
    gemm = layer(x)
    assert gemm.shape == exact.shape          # every slice of rows, the last one short
    assert torch.allclose(gemm, exact, rtol=1e-5, atol=1e-5)
    # The int8 kernel rounds activations to bfloat16: the product is closer.
    assert float((gemm - exact).abs().max()) < float((int8_kernel - exact).abs().max()) / 10


def test_fewer_rows_than_a_prompt_block_run_the_int8_kernel_unchanged():
    layer, w = _layer()
    x = torch.randn(GEMM_ROWS - 1, w.shape[1], generator=torch.Generator().manual_seed(2))
    before = layer(x)
    layer.gemm_rows = GEMM_ROWS
    assert torch.equal(layer(x), before)
    assert GEMM_ROWS > MAX_GROUP       # no verification group the probe tries gets there


def _int8_values_in_float32() -> Transformer:
    """The network of ``_network("q8")`` with its int8 values dequantized
    and run in float32: what a float32 product of them computes."""
    model = hf_model("qwen2", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                     num_key_value_heads=2)
    config = ModelConfig.from_hf(model.config.to_dict())
    state = {k: _as_held(v.detach()) if v.dim() == 2 else v.detach().clone()
             for k, v in model.state_dict().items()}
    return Transformer(config, state, weights_format="float32")


def test_a_model_in_q8_prefills_with_the_chosen_kernel():
    network = _network("q8")
    layers = network.int8_layers()
    assert layers and all(layer.gemm_rows is None for layer in layers)
    prompt = list(range(5, 5 + GEMM_ROWS + 20))

    def last_hidden(net: Transformer) -> torch.Tensor:
        # The final hidden state: before the LM head, which runs on one row.
        return TorchDecoder(net, 256).feed(prompt, last_only=True, return_hidden=True).hidden

    ref = last_hidden(_int8_values_in_float32())
    int8 = last_hidden(network)
    network.set_prefill_kernel("float32-gemm")
    assert all(layer.gemm_rows == GEMM_ROWS for layer in layers)
    gemm = last_hidden(network)
    # The block ran the float32 product of the same int8 values.
    assert torch.allclose(gemm, ref, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(int8, ref, rtol=1e-4, atol=1e-4)
    network.set_prefill_kernel("int8")
    assert torch.equal(last_hidden(network), int8)


def test_an_unknown_prefill_kernel_is_refused():
    network = _network("q8")
    try:
        network.set_prefill_kernel("int4-gemm")
    except ConfigError as exc:
        assert "int8, float32-gemm" in str(exc)
    else:
        raise AssertionError("an unknown kernel was accepted")


def test_both_kernels_are_timed():
    ms = time_prefill_kernels(config(), CPU, repeats=1)
    assert set(ms) == set(PREFILL_KERNELS) and all(0 < v < 1e4 for v in ms.values())


def test_the_choice_is_the_faster_and_is_kept_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path))
    calls = []

    def fake(cfg, device):
        calls.append(cfg.hidden_size)
        return {"int8": 30.0, "float32-gemm": 20.0 + cfg.hidden_size / 8}
    monkeypatch.setattr(prefill_kernel, "time_prefill_kernels", fake)
    first = choose_prefill_kernel("tiny", config(), CPU)
    assert first.kernel == "float32-gemm" and len(calls) == 1
    assert choose_prefill_kernel("tiny", config(), CPU) == first and len(calls) == 1
    assert choose_prefill_kernel("tiny", config(hidden=96), CPU).kernel == "int8"
    assert len(calls) == 2                                  # another shape: measured
    for record in (tmp_path / "calibration" / "prefill").glob("*.json"):
        record.write_text('{"kernel": "float32-gemm", "milliseconds": {"int8": -1}}')
    assert choose_prefill_kernel("tiny", config(), CPU) == first and len(calls) == 3


def test_a_stored_choice_must_be_whole():
    ms = {"int8": 3.0, "float32-gemm": 2.0}
    assert PrefillChoice.from_dict({"kernel": "int8", "milliseconds": ms})
    assert PrefillChoice.from_dict({"kernel": "int4", "milliseconds": ms}) is None
    assert PrefillChoice.from_dict({"kernel": "int8", "milliseconds": {"int8": 3.0}}) is None
    nan = {"int8": float("nan"), "float32-gemm": 2.0}
    assert PrefillChoice.from_dict({"kernel": "int8", "milliseconds": nan}) is None


def _load_with_gemm_prefill(tmp_path, monkeypatch):
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(prefill_kernel, "time_prefill_kernels",
                        lambda cfg, device: {"int8": 9.0, "float32-gemm": 1.0})
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hidden_size=128, intermediate_size=256)
    return forerun.load(path, weights="q8", context_length=512, progress=False)


def test_load_applies_the_measured_choice(tmp_path, monkeypatch):
    model = _load_with_gemm_prefill(tmp_path, monkeypatch)
    network = model.decoder.model
    assert model.decoder.settings.prefill == "float32-gemm"
    assert all(layer.gemm_rows == GEMM_ROWS for layer in network.int8_layers())
    assert network.lm_head.gemm_rows is None      # the LM head runs on one row
    q4 = forerun.load(tmp_path / "tiny.gguf", weights="q4", context_length=512, progress=False)
    # What was timed is q8's blocks: q4 keeps the int8 kernel for any int8 part.
    assert q4.decoder.settings.prefill != "float32-gemm"
    assert all(layer.gemm_rows is None for layer in q4.decoder.model.int8_layers())


def test_greedy_speculation_is_plain_decoding_after_a_gemm_prefill(tmp_path, monkeypatch):
    model = _load_with_gemm_prefill(tmp_path, monkeypatch)
    prompt = [int(t) for t in torch.randint(3, 200, (GEMM_ROWS + 7,),
                                            generator=torch.Generator().manual_seed(3))]
    plain = model.generate(prompt_ids=prompt, max_new_tokens=30, ignore_eos=True)
    for draft, k in (("ngram", 4), (model, 4), (model, 12)):
        out = model.generate(prompt_ids=prompt, max_new_tokens=30, ignore_eos=True,
                             draft=draft, draft_k=k)
        assert out.tokens == plain.tokens, (draft, k)
        assert out.stats.drafted > 0
