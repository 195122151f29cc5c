"""The shipped GGUF models: forerun's engine against transformers loading the
same GGUF file (both dequantize to float32)."""

import gc

import pytest
import torch

pytestmark = pytest.mark.real_model

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three primary colours are",
    "<|im_start|>user\nTranslate 'good morning' into French.<|im_end|>\n<|im_start|>assistant\n",
]


def load_reference(gguf_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32).eval()


@torch.no_grad()
def reference_greedy(model, ids, n):
    """transformers' greedy continuation with its KV cache, EOS not special."""
    out = model(torch.tensor([ids]), use_cache=True)
    tokens = []
    for _ in range(n):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                    use_cache=True)
    return tokens


@pytest.fixture(scope="module", params=["smollm2-135m", "qwen2.5-coder-0.5b"])
def pair(request, preset_gguf, preset_model):
    ours = preset_model(request.param)
    ref = load_reference(preset_gguf(request.param))
    yield ours, ref
    del ref
    gc.collect()


def test_next_token_logits_match(pair):
    ours, ref = pair
    for text in PROMPTS:
        ids = ours.tokenizer.encode(text)
        ours.decoder.reset()
        logits = ours.decoder.feed(ids).logits
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0]
        assert logits.shape == expected.shape
        assert (logits - expected).abs().max().item() < 1e-3, text


def test_greedy_continuations_match(pair):
    ours, ref = pair
    for text in PROMPTS:
        ids = ours.tokenizer.encode(text)
        result = ours.generate(prompt_ids=ids, max_new_tokens=32, ignore_eos=True)
        assert result.tokens == reference_greedy(ref, ids, 32), text


@pytest.mark.slow
def test_qwen_1_5b_matches_transformers(preset_gguf):
    import forerun

    # Its own float32 model, released with the reference (12 GB together).
    path = preset_gguf("qwen2.5-coder-1.5b")
    ours = forerun.load("qwen2.5-coder-1.5b", context_length=1024, progress=False,
                        weights="float32")
    ref = load_reference(path)
    try:
        ids = ours.tokenizer.encode(PROMPTS[0])
        ours.decoder.reset()
        logits = ours.decoder.feed(ids).logits
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0]
        assert (logits - expected).abs().max().item() < 1e-3
        result = ours.generate(prompt_ids=ids, max_new_tokens=32, ignore_eos=True)
        assert result.tokens == reference_greedy(ref, ids, 32)
    finally:
        del ref, ours
        gc.collect()
