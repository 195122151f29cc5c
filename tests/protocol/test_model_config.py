"""ModelConfig refuses what a hostile or broken config.json or GGUF header
holds with a ConfigError naming the key: a ZeroDivisionError, a TypeError or
a KeyError deep in the engine is never what a user sees."""

from __future__ import annotations

import pytest

from forerun.errors import ConfigError
from forerun.protocol.model_config import ModelConfig

BASE = {"model_type": "qwen2", "vocab_size": 300, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
        "eos_token_id": 2, "bos_token_id": 1}


def test_the_base_config_is_valid():
    config = ModelConfig.from_hf(BASE)
    assert config.head_dim == 16 and config.eos_token_ids == (2,)


@pytest.mark.parametrize("update, key", [
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"num_attention_heads": "four"}, "num_attention_heads"),
    ({"num_attention_heads": [4]}, "num_attention_heads"),
    ({"hidden_size": 64.5}, "hidden_size"),
    ({"hidden_size": True}, "hidden_size"),
    ({"num_hidden_layers": -1}, "num_hidden_layers"),
    ({"num_key_value_heads": 3}, "num_kv_heads"),
    ({"rms_norm_eps": "x"}, "rms_norm_eps"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
    ({"eos_token_id": "x"}, "EOS"),
    ({"eos_token_id": [2, -1]}, "EOS"),
    ({"bos_token_id": 1.5}, "BOS"),
    ({"rope_scaling": "linear"}, "rope_scaling"),
    ({"rope_scaling": {"rope_type": "linear"}}, "factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, "factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "yarn"),
])
def test_hostile_values_are_config_errors_naming_the_key(update, key):
    with pytest.raises(ConfigError, match=key):
        ModelConfig.from_hf({**BASE, **update})


def test_an_integral_float_is_accepted():
    assert ModelConfig.from_hf({**BASE, "max_position_embeddings": 4096.0}) \
        .max_position_embeddings == 4096
