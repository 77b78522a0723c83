"""Tiny random models of every architecture the installed transformers can build from a config class alone.

A config class's defaults describe the published model (hidden 4096, 32 layers, vocab 150k); :func:`tiny_config`
shrinks every size field it knows (here and in sub-configs such as ``text_config``) to a few dozen units, keeps the
structure fields (norm type, eps, layer pattern, residual scales) as they are, and cuts per-layer lists to the new
depth. Nothing is downloaded: models are built with ``from_config`` and random weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# Size fields, with the small value each gets. Widths are multiples of the head count times head_dim.
_WIDTH = 64
_SIZES: dict[str, int] = {
    **dict.fromkeys(
        (
            "hidden_size",
            "d_model",
            "n_embd",
            "embed_dim",
            "dim",
            "model_dim",
            "hidden_dim",
            "embedding_size",
            "word_embed_proj_dim",
            "projection_dim",
            "text_embed_dim",
            "emb_dim",
        ),
        _WIDTH,
    ),
    **dict.fromkeys(
        (
            "num_hidden_layers",
            "n_layer",
            "n_layers",
            "num_layers",
            "encoder_layers",
            "decoder_layers",
            "num_decoder_layers",
            "num_encoder_layers",
            "depth",
        ),
        2,
    ),
    **dict.fromkeys(
        (
            "intermediate_size",
            "ffn_dim",
            "encoder_ffn_dim",
            "decoder_ffn_dim",
            "d_ff",
            "n_inner",
            "ffn_hidden_size",
            "mlp_dim",
            "feed_forward_proj_dim",
            "hidden_dim_ffn",
        ),
        128,
    ),
    **dict.fromkeys(
        (
            "num_attention_heads",
            "n_head",
            "n_heads",
            "encoder_attention_heads",
            "decoder_attention_heads",
            "num_heads",
            "attention_heads",
        ),
        4,
    ),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"), 2),
    **dict.fromkeys(("head_dim", "d_kv", "kv_channels", "attention_head_dim", "v_head_dim", "qk_nope_head_dim"), 16),
    **dict.fromkeys(("qk_rope_head_dim", "rotary_dim", "rotary_emb_base_dim"), 8),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token"), 2),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"), 32),
    **dict.fromkeys(("q_lora_rank", "kv_lora_rank"), 32),
    "image_size": 32,  # vision models: a few patches (position tables follow image_size // patch_size)
    # audio tokenizers (VibeVoice's) double their conv channels from num_filters at each of ~6 stages: 32 filters
    # leave 340M parameters, over the survey's time limit
    "num_filters": 4,
    "entity_vocab_size": 512,  # LUKE: a 500k-entity embedding table (128M parameters) otherwise
}
_MAX_VOCAB = 512
# fields that list one entry per layer: cut to the new depth (so a 5:1 sliding/global pattern keeps its start)
_PER_LAYER = ("layer_types", "block_types", "mlp_only_layers", "attention_layers", "layers_block_type")
_N_LAYERS = 2


@dataclass(kw_only=True)
class Built:
    """A built model, the inputs of a short forward, and what kind of model it is."""

    model_type: str
    model: nn.Module
    batch: dict
    role: str  # "decoder", "encoder" or "encoder-decoder"


class SkipModel(Exception):
    """The architecture cannot be built or run here; the message says why (shown in the survey)."""


def _shrink(d: dict) -> dict:
    out = dict(d)
    for key, value in d.items():
        if isinstance(value, dict) and ("model_type" in value or key.endswith("_config")):
            out[key] = _shrink(value)
        elif key in _SIZES and isinstance(value, int) and not isinstance(value, bool) and value > _SIZES[key]:
            out[key] = _SIZES[key]
        elif key == "vocab_size" and isinstance(value, int) and value > _MAX_VOCAB:
            out[key] = _MAX_VOCAB
        elif key in ("out_features", "out_indices") and value is not None:
            out[key] = None  # backbones name stages after the depth; None lets the config pick from the new one
        elif key in _PER_LAYER and isinstance(value, list) and len(value) > _N_LAYERS:
            out[key] = value[:_N_LAYERS]
    # ids of special tokens must stay inside the smaller vocabulary
    vocab = out.get("vocab_size")
    if isinstance(vocab, int):
        for key, value in list(out.items()):
            if key.endswith(("_token_id", "_token_index")) and isinstance(value, int) and value >= vocab:
                out[key] = vocab - 1 - (hash(key) % 8)
    # a head count that no longer divides the width would fail the model's own checks
    heads = out.get("num_attention_heads")
    kv = out.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and kv > heads:
        out["num_key_value_heads"] = heads
    # None means one KV head per query head in most configs; some models (Nemotron) divide by it unguarded
    if isinstance(heads, int) and "num_key_value_heads" in out and kv is None:
        out["num_key_value_heads"] = heads
    return out


class SurveyTimeout(Exception):
    """The survey's CPU-time limit for one architecture ran out. Raised from a timer signal wherever the code happens
    to be, so every ``except Exception`` on the way that turns a failure into a reason lets it through first."""


def config_names() -> set[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return set(CONFIG_MAPPING_NAMES)


def config_class(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]
    except SurveyTimeout:
        raise  # a slow import is over the time limit, not a missing dependency
    except Exception as e:  # noqa: BLE001 - a missing optional dependency surfaces here
        raise SkipModel(f"config class not importable: {type(e).__name__}: {e}") from e


def tiny_config(model_type: str, **overrides: Any):
    """The config of ``model_type`` with every size field shrunk (see the module docstring); ``overrides`` last."""
    cls = config_class(model_type)
    try:
        default = cls()
        data = _shrink(default.to_dict())
        data.update(overrides)
        data.pop("model_type", None)
        data.pop("transformers_version", None)
        config = cls.from_dict(data)
    except SurveyTimeout:
        raise
    except Exception as e:  # noqa: BLE001
        raise SkipModel(f"config cannot be built from its defaults: {type(e).__name__}: {str(e)[:200]}") from e
    for attr in ("use_cache",):
        if hasattr(config, attr):
            setattr(config, attr, False)
    return config


def _role(config, model_type: str) -> str:
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder"
    # BERT-likes also have a causal-LM head class; a masked-LM head says what they were trained as
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "decoder"
    # vision- and audio-language models: what their language model is
    text = getattr(config, "text_config", None)
    if text is not None and getattr(text, "model_type", None) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "decoder"
    return "encoder"


def _main_input(name: str, config, batch_size: int, seq_len: int, g: torch.Generator) -> dict:
    text = getattr(config, "text_config", None) or config
    if name == "input_ids":
        vocab = int(getattr(text, "vocab_size", 0) or getattr(config, "vocab_size", 0) or 0)
        if vocab <= 0:
            raise SkipModel("no vocab_size in the config")
        # ids away from both ends, where special tokens (image, pad, bos) usually sit
        lo, hi = min(4, vocab - 1), max(min(4, vocab - 1) + 1, vocab - 8)
        return {"input_ids": torch.randint(lo, hi, (batch_size, seq_len), generator=g)}
    if name == "pixel_values":
        vision = getattr(config, "vision_config", None) or config
        size = getattr(vision, "image_size", None)
        size = size[0] if isinstance(size, (list, tuple)) else size
        channels = getattr(vision, "num_channels", 3)
        if not isinstance(size, int) or not isinstance(channels, int):
            raise SkipModel("needs pixel_values, and the config gives no image_size/num_channels")
        return {"pixel_values": torch.randn(batch_size, channels, size, size, generator=g)}
    raise SkipModel(f"needs {name} (not text or image): not built by the survey")


def inputs(config, main_input_name: str = "input_ids", *, seed: int = 0, batch_size: int = 2, seq_len: int = 8) -> dict:
    """The survey's batch for a model of ``config`` (a :func:`tiny_config`) whose main input is ``main_input_name``
    (the model class's attribute): random ``input_ids`` or ``pixel_values`` of the shape the config gives, drawn
    from ``seed``, and ``decoder_input_ids`` for an encoder-decoder; raises :class:`SkipModel` for other inputs
    (audio features, ...)."""
    g = torch.Generator().manual_seed(seed)
    batch = _main_input(main_input_name, config, batch_size, seq_len, g)
    if getattr(config, "is_encoder_decoder", False) and "input_ids" in batch:
        batch["decoder_input_ids"] = batch["input_ids"].clone()
    return batch


def build(model_type: str, *, seed: int = 0, batch_size: int = 2, seq_len: int = 8, **overrides: Any) -> Built:
    """A tiny random base model (``AutoModel``) of ``model_type`` and a batch for it; raises :class:`SkipModel`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    if model_type not in MODEL_MAPPING_NAMES:
        raise SkipModel("no base model class (AutoModel) for this config")
    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    try:
        model = transformers.AutoModel.from_config(config)
    except SurveyTimeout:
        raise
    except Exception as e:  # noqa: BLE001
        raise SkipModel(f"model cannot be built: {type(e).__name__}: {str(e)[:200]}") from e
    model.eval()
    batch = inputs(
        config, getattr(model, "main_input_name", "input_ids"), seed=seed, batch_size=batch_size, seq_len=seq_len
    )
    return Built(model_type=model_type, model=model, batch=batch, role=_role(config, model_type))


def model_types() -> list[str]:
    """Every model_type of the installed transformers that has a base model class, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    return sorted(MODEL_MAPPING_NAMES)
