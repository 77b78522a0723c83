"""hf.apply / hf.revert keep every module's train/eval mode, and say when a model or a submodule is already patched."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from addnorm.integrations import hf  # noqa: E402
from addnorm.nn import TransformerConfig, TransformerLM  # noqa: E402

FAMILIES = ["llama", "gpt2", "bert", "gemma2"]  # Llama's and Gemma's RMSNorm, LayerNorm (GPT-2's block, BERT's)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _in_mode(model, training: bool) -> list[str]:
    """The modules whose mode is not ``training`` (empty when the whole model is in that mode)."""
    return [name or "<root>" for name, m in model.named_modules() if m.training != training]


@pytest.mark.parametrize("fuse_residual", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_apply_keeps_the_models_mode(family, fuse_residual, mode):
    model = hf.tiny_model(family)  # eval mode
    model.train(mode == "train")
    hf.apply(model, fuse_residual=fuse_residual)
    assert _in_mode(model, mode == "train") == []


@pytest.mark.parametrize("fuse_residual", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_revert_gives_the_originals_the_models_current_mode(family, fuse_residual, mode):
    model = hf.tiny_model(family)
    model.train(mode == "eval")  # the opposite mode at apply time
    hf.apply(model, fuse_residual=fuse_residual)
    model.train(mode == "train")  # switched while patched: reaches the swapped-in norms, not the originals
    originals = [old for _, _, old, _ in model._addnorm_hf_patch.modules]
    hf.revert(model)
    assert _in_mode(model, mode == "train") == []
    assert all(m.training == (mode == "train") for m in originals)  # the very modules apply had taken out


def test_apply_to_a_model_whose_submodule_is_patched_names_it():
    model = hf.tiny_model("llama")
    hf.apply(model.model)
    with pytest.raises(ValueError, match=r"submodule 'model' is already patched.*revert\(model.get_submodule"):
        hf.apply(model)
    hf.revert(model.model)
    hf.apply(model)  # once the submodule is reverted, the whole model patches
    assert hf.is_applied(model)


def test_apply_to_a_submodule_of_a_patched_model_says_so():
    model = hf.tiny_model("llama")
    hf.apply(model)
    with pytest.raises(ValueError, match=r"LlamaModel's norms are addnorm's already.*revert"):
        hf.apply(model.model)


def test_apply_to_an_addnorm_model_still_says_no_norm_to_swap():
    # addnorm.nn's own models hold addnorm norms too, but no transformers module: not "already patched"
    model = TransformerLM(TransformerConfig(n_layers=1, d_model=16, n_heads=2, vocab_size=32))
    with pytest.raises(ValueError, match="has no norm module that addnorm reproduces"):
        hf.apply(model)
