"""transformers as the reference for the shipped GGUF models: the model
loaded from the same GGUF file in float32, its greedy continuation, and the
prompts the parity tests use."""

import os
from pathlib import Path

import torch

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three primary colours are",
    "<|im_start|>user\nTranslate 'good morning' into French.<|im_end|>\n<|im_start|>assistant\n",
]


def load_reference(gguf_path):
    """transformers' float32 model of ``gguf_path``, as transformers itself
    dequantizes the file.  Its dequantization runs in Python and takes a
    minute and more for the 0.5B and the 1.5B, so the first load saves the
    result in the tests' cache (keyed by the file's digest and transformers'
    version, written to a temporary folder and renamed when whole) and later
    sessions read that."""
    import shutil
    import uuid

    import transformers
    from transformers import AutoModelForCausalLM

    from forerun.loading.content_key import file_digest

    # (tests/conftest.py sets it to the tests' cache for the session)
    folder = (Path(os.environ["FORERUN_TEST_CACHE"]) / "transformers-reference"
              / f"{file_digest(gguf_path)[:24]}-{transformers.__version__}")
    if any((folder / name).is_file()
           for name in ("model.safetensors", "model.safetensors.index.json")):
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32).eval()
    tmp = folder.with_name(f".{folder.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        # (save_pretrained refuses a model loaded from a GGUF: its weights
        # and config, which are plain float32 once loaded, are saved as such)
        from safetensors.torch import save_model

        tmp.mkdir(parents=True)
        model.config.save_pretrained(str(tmp))
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tmp.rename(folder)
    except OSError:
        pass      # another session saved it first, or no room: next time, again
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model


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
