"""Deliberate designs of released architectures are notes, not errors, and the seeds' bugs next to them still are.

Toy models first (each design next to the bug it must not excuse), then the survey's architectures that the
doctor used to report errors on (tiny random-init configs, as ``addnorm survey`` builds them)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from addnorm.diagnostics import diagnose
from tests.diagnostics.test_diagnostics_doctor import TOY

V, T, B = 50, 7, 3


def _codes(findings, severity):
    return {f.code for f in findings if f.severity == severity}


class GatedBlock(nn.Module):
    """Doge's skip gate: x * g + branch(norm(x)), g a learnable vector initialised to 1."""

    def __init__(self, d, gate=1.0, const=1.0):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)
        self.gate = nn.Parameter(torch.full((d,), gate))
        self.const = const

    def forward(self, x):
        return self.const * x * self.gate + self.fc(self.norm(x))


class Stack(nn.Module):
    def __init__(self, blocks, d=16, final=True):
        super().__init__()
        self.emb, self.blocks = nn.Embedding(V, d), nn.ModuleList(blocks)
        self.ln_f, self.head = (nn.LayerNorm(d) if final else nn.Identity()), nn.Linear(d, V)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def ids():
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))


def test_learnable_skip_gate_is_a_note_and_a_constant_scale_stays_an_error():
    gated = diagnose(Stack([GatedBlock(16) for _ in range(2)]), ids())
    assert not _codes(gated, "error") and "skip-path-design" in _codes(gated, "info")
    (note,) = {f.message for f in gated if f.code == "skip-path-design"}
    assert "gate" in note
    scaled = diagnose(Stack([GatedBlock(16, const=0.5) for _ in range(2)]), ids())
    assert "residual-not-identity" in _codes(scaled, "error")


class BranchFFN(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class ParallelLists(nn.Module):
    """XLM's layout: attention, FFN and norms in parallel lists; the parent adds the residual."""

    def __init__(self, d=16, n=2):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.ffns = nn.ModuleList(BranchFFN(d) for _ in range(n))
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(n))
        self.head = nn.Linear(d, V)

    def forward(self, idx):
        x = self.emb(idx)
        for ffn, norm in zip(self.ffns, self.norms):
            x = norm(x + ffn(x))
        return self.head(x)


def test_parallel_branch_lists_are_a_note():
    findings = diagnose(ParallelLists(), ids())
    assert not _codes(findings, "error"), [(f.code, f.message) for f in findings]
    assert any("branches" in f.message for f in findings if f.code == "skip-path-design")


def test_a_block_with_norms_and_no_skip_stays_an_error():
    """addnorm's pre-noskip: x = f(norm(x)) in a token model, the bug the skip check exists for."""
    from addnorm.nn import TransformerConfig, TransformerLM

    model = TransformerLM(TransformerConfig.preset("gpt2", n_layers=2, placement="pre-noskip"))
    assert "residual-not-identity" in _codes(diagnose(model, ids()), "error")


class ConvModule(nn.Module):
    """Conformer's convolution module on (B, T, d): Conv1d -> BatchNorm1d, and a channels-first LayerNorm."""

    def __init__(self, d):
        super().__init__()
        self.conv, self.bn = nn.Conv1d(d, d, 3, padding=1, groups=d), nn.BatchNorm1d(d)
        self.ln = ChannelsFirstLayerNorm(d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        h = self.ln(self.bn(self.conv(x.transpose(1, 2))))
        return self.out(h.transpose(1, 2))


class ChannelsFirstLayerNorm(nn.LayerNorm):
    """ConvNeXt's channels_first LayerNorm: normalizes dim 1 of (B, C, L)."""

    def forward(self, x):
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


class ConvBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.conv = nn.LayerNorm(d), ConvModule(d)

    def forward(self, x):
        return x + self.conv(self.norm(x))


def test_conv_bn_and_channels_first_norms_are_checked_as_such():
    findings = diagnose(Stack([ConvBlock(16) for _ in range(2)]), ids())
    assert not _codes(findings, "error"), [(f.code, f.message) for f in findings if f.severity == "error"]
    notes = [f for f in findings if f.code == "channel-norm"]
    assert {f.module.rsplit(".", 1)[-1] for f in notes} == {"bn", "ln"}


def test_batchnorm_on_the_stream_stays_an_error():
    assert "norm-dimension" in _codes(diagnose(TOY["ToyLM"](norm="bn"), TOY["batch"]()), "error")


class TinyViT(nn.Module):
    """A Pre-Norm vision encoder without a final norm (its output goes to a projector)."""

    def __init__(self, d=16):
        super().__init__()
        self.patch = nn.Conv2d(3, d, 4, stride=4)
        self.blocks = nn.ModuleList(GatedBlock(d) for _ in range(2))

    def forward(self, pixel_values):
        x = self.patch(pixel_values).flatten(2).transpose(1, 2)
        for b in self.blocks:
            x = b(x)
        return x


def test_missing_final_norm_is_a_note_on_an_image_encoder_and_an_error_on_a_token_model():
    vit = diagnose(TinyViT(), {"pixel_values": torch.randn(2, 3, 16, 16)})
    assert "missing-final-norm" in _codes(vit, "info") and not _codes(vit, "error")
    lm = diagnose(Stack([GatedBlock(16) for _ in range(2)], final=False), ids())
    assert "missing-final-norm" in _codes(lm, "error")


# ---- the survey's architectures -----------------------------------------------------------------------------------
# The ones docs/survey.md showed with doctor errors (issue 30). The slow ones (over ~10 s each here) are marked.
FAST = ["deepseek_v4", "doge", "fnet", "ibert", "inkling2_text", "mobilebert", "pixtral", "radio", "sam_vision_model"]
FAST += ["squeezebert", "vitdet", "xlm", "zaya"]
SLOW = ["convnext", "convnextv2", "dinov3_convnext", "fastspeech2_conformer", "flaubert", "inkling2_loop_text"]
SLOW += ["internvl_vision", "levit", "mobilenet_v1", "mobilevit", "qianfan_ocr_vision", "sam3_vit_model"]
SLOW += ["sam_hq_vision_model", "swiftformer"]


def _doctor_errors(model_type):
    pytest.importorskip("transformers")
    import warnings

    from addnorm.integrations.tiny import build

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = build(model_type)
        findings = diagnose(built.model, built.batch)
    return [(f.code, f.module, f.message[:200]) for f in findings if f.severity == "error"], findings


@pytest.mark.parametrize("model_type", FAST)
def test_released_architecture_has_no_doctor_error(model_type):
    errors, _ = _doctor_errors(model_type)
    assert not errors, errors


@pytest.mark.slow
@pytest.mark.parametrize("model_type", SLOW)
def test_released_architecture_has_no_doctor_error_slow(model_type):
    errors, _ = _doctor_errors(model_type)
    assert not errors, errors
