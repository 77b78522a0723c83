"""Hugging Face transformers on addnorm: ``apply(model)`` swaps its norms for addnorm's and fuses each residual add
with the norm after it; ``revert(model)`` undoes it exactly. How, in :mod:`addnorm.integrations.hf.patch`.

    patch.py           apply / revert, and pickling of patched models
    norm_probe.py      which modules are norms, found by running them; norms.py: the norms swapped in
    layer_match.py     a layer recognised by the structure of its forward; forwards.py: the template forwards
    rewrite.py         a layer's own forward rewritten; helper_rewrite.py: adds made in a helper function
    chain.py           a norm on a branch's output with its add (norm_add) and the next norm (norm_add_norm)
    handoff.py         the add a layer returns, fused with the next norm; links.py: which norm that is
    unfused.py         why a model's adds were left unfused (the survey's reason column)
    tiny_models.py     tiny random models for tests, benchmarks and docs
"""

from addnorm.integrations.hf.norms import CastBeforeWeightRMSNorm, HFRMSNorm
from addnorm.integrations.hf.patch import apply, apply_status, fused_layer_classes, is_applied, revert
from addnorm.integrations.hf.tiny_models import FAMILIES, tiny_config, tiny_model

__all__ = [
    "apply",
    "revert",
    "is_applied",
    "apply_status",
    "fused_layer_classes",
    "tiny_config",
    "tiny_model",
    "FAMILIES",
    "CastBeforeWeightRMSNorm",
    "HFRMSNorm",
]
