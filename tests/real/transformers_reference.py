"""transformers as the reference for the shipped GGUF models: the model
loaded from the same GGUF file in float32, its greedy continuation, and the
prompts the parity tests use."""

import torch

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
