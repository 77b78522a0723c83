"""Tiny random transformers models, for tests, benchmarks and docs: nothing is downloaded, every weight is random."""

from __future__ import annotations

import torch
from torch import nn

from addnorm.integrations.hf.patch import require_transformers

__all__ = ["FAMILIES", "tiny_config", "tiny_model"]

_DECODER_SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


# Families with hand-sized tiny configs (tests, benchmarks, docs); tiny_config builds any other model_type too.
FAMILIES = ("gpt2", "bert", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3")


def _config_classes():
    import transformers as t

    return {
        "gpt2": (
            t.GPT2Config,
            dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=1, eos_token_id=2),
        ),
        "bert": (
            t.BertConfig,
            dict(
                vocab_size=128,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=128,
                max_position_embeddings=128,
            ),
        ),
        "llama": (t.LlamaConfig, _DECODER_SIZES),
        "mistral": (t.MistralConfig, _DECODER_SIZES),
        "qwen2": (t.Qwen2Config, _DECODER_SIZES),
        "qwen3": (t.Qwen3Config, {**_DECODER_SIZES, "head_dim": 16}),
        "gemma": (t.GemmaConfig, {**_DECODER_SIZES, "head_dim": 16}),
        "gemma2": (t.Gemma2Config, {**_DECODER_SIZES, "head_dim": 16, "query_pre_attn_scalar": 16}),
        "gemma3": (t.Gemma3TextConfig, {**_DECODER_SIZES, "head_dim": 16, "query_pre_attn_scalar": 16}),
    }


def tiny_config(family: str, **overrides):
    """A tiny config of ``family``: one of :data:`FAMILIES` (2 layers, hidden 64, 4 heads, vocab 128), or any other
    model_type of the installed transformers, shrunk by the survey's rules (addnorm.integrations.tiny);
    ``overrides`` are config fields, e.g. ``num_hidden_layers=4``."""
    require_transformers()
    classes = _config_classes()
    if family in classes:
        cls, sizes = classes[family]
        return cls(**{**sizes, **overrides})
    from addnorm.integrations import tiny

    if not isinstance(family, str) or family not in tiny.config_names():
        raise ValueError(
            f"family must be a model_type of the installed transformers (e.g. {', '.join(classes)}), got {family!r}"
        )
    try:
        return tiny.tiny_config(family, **overrides)
    except tiny.SkipModel as e:
        raise ValueError(f"family {family!r}: {e}") from e


def tiny_model(family: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> nn.Module:
    """A randomly initialised model of :func:`tiny_config` (a causal LM where the family has one; BERT: masked LM;
    else the base model), in eval mode."""
    transformers = require_transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = tiny_config(family, **overrides)
    if family == "bert":
        auto = transformers.AutoModelForMaskedLM
    elif config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        auto = transformers.AutoModelForCausalLM
    else:
        auto = transformers.AutoModel
    torch.manual_seed(seed)
    model = auto.from_config(config)
    return model.to(dtype).eval()
