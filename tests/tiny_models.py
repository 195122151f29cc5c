"""Tiny random Qwen2, Llama, Qwen3 and Gemma 3 models built with
transformers: the numerical reference for forerun's engine."""

from __future__ import annotations

import json

import torch

from forerun.architectures import ARCHITECTURES
from forerun.engines.torch_engine import TorchDecoder
from forerun.engines.transformer import Transformer
from forerun.protocol.model_config import ModelConfig

VOCAB = 300


def hf_config(arch: str, **overrides):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=2,
                  bos_token_id=1)
    common.update(overrides)
    if arch == "qwen2":
        common.setdefault("rope_theta", 10000.0)
        common.setdefault("tie_word_embeddings", False)
        return transformers.Qwen2Config(**common)
    if arch == "llama":
        common.setdefault("rope_theta", 500000.0)
        return transformers.LlamaConfig(**common)
    if arch == "qwen3":
        # a head wider than hidden / heads, as Qwen3's are
        common.setdefault("head_dim", 32)
        common.setdefault("rope_theta", 1000000.0)
        common.setdefault("tie_word_embeddings", True)
        return transformers.Qwen3Config(**common)
    if arch == "gemma3":
        # Two local layers with a window short enough for the tests' prompts
        # to pass it, a global one; a query scale other than head_dim's.
        common.setdefault("head_dim", 32)
        common.setdefault("sliding_window", 8)
        common.setdefault("layer_types", ["sliding_attention", "full_attention",
                                          "sliding_attention"][:common["num_hidden_layers"]])
        common.setdefault("query_pre_attn_scalar", 24)
        common.setdefault("rope_theta", 1000000.0)
        common.setdefault("rope_local_base_freq", 10000.0)
        common.setdefault("final_logit_softcapping", None)
        common.setdefault("attn_logit_softcapping", None)
        common.setdefault("hidden_activation", "gelu_pytorch_tanh")
        common.setdefault("tie_word_embeddings", True)
        return transformers.Gemma3TextConfig(**common)
    raise ValueError(arch)


def hf_model(arch: str, seed: int = 0, **overrides):
    import transformers

    torch.manual_seed(seed)
    config = hf_config(arch, **overrides)
    cls = {"qwen2": transformers.Qwen2ForCausalLM, "llama": transformers.LlamaForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM,
           "gemma3": transformers.Gemma3ForCausalLM}[arch]
    model = cls(config).eval().float()
    # Random init leaves biases at zero; make them matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def forerun_decoder(model, context_length: int = 256, weights: str = "float32"
                    ) -> TorchDecoder:
    config = ModelConfig.from_hf(model.config.to_dict())
    hf_weight = ARCHITECTURES[config.architecture].hf_weight   # (as a folder loads)
    state = {k: hf_weight(k, v.detach().clone()) for k, v in model.state_dict().items()}
    network = Transformer(config, state, weights_format=weights)
    return TorchDecoder(network, context_length, config.eos_token_ids)


def tiny_tokenizer_json(path):
    """A byte-level BPE tokenizer of VOCAB tokens with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"] * 50,
                            trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>"
                         "{% endfor %}{% if add_generation_prompt %}<s>assistant: {% endif %}"}))


def hf_folder(folder, arch: str = "qwen2", seed: int = 0):
    """``folder``, made a Hugging Face folder (config, safetensors, the tiny
    tokenizer) of a tiny random model."""
    hf_model(arch, seed=seed).save_pretrained(folder, safe_serialization=True)
    tiny_tokenizer_json(folder)
    return folder


def hf_folders(tmp_path_factory, seeds, arch: str = "qwen2", prefix: str = "m") -> list:
    """Hugging Face folders of tiny random models (:func:`hf_folder`), one
    per seed: models that share a tokenizer."""
    return [hf_folder(tmp_path_factory.mktemp(f"{prefix}{seed}"), arch, seed) for seed in seeds]

