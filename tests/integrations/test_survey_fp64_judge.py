"""The survey's second look at a patched output further than 1e-5 of its scale from the unpatched one: a mismatch
stands unless the patched output is as close to a float64 run of the unpatched model as that model's own fp32
output is (a model that amplifies rounding, like VITS's vocoder, is not wrong for amplifying an ulp)."""

from __future__ import annotations

import torch
from torch import nn

from addnorm.integrations.survey import _as_accurate_as_eager, _outputs


class Amplifier(nn.Module):
    """A deep stack of wide-gain layers: an ulp at its input grows by orders of magnitude at its output."""

    def __init__(self, depth: int = 6, width: int = 64):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        for lin in self.layers:
            with torch.no_grad():
                lin.weight.copy_(torch.randn(width, width, generator=g) * 3 / width**0.5)

    def forward(self, x):
        for lin in self.layers:
            x = torch.tanh(lin(x)) * 4
        return x


class NoDouble(Amplifier):
    def double(self):
        raise RuntimeError("this model has no float64 kernels")


def _batch():
    return {"x": torch.randn(4, 64, generator=torch.Generator().manual_seed(1))}


def test_an_output_as_accurate_as_eager_passes_and_records_both_distances():
    model, batch = Amplifier(), _batch()
    ref = _outputs(model, batch)
    # the "patched" run: the same model with its input perturbed by an ulp, as a norm computed differently would
    got = model(batch["x"].nextafter(torch.full_like(batch["x"], 1e9)))
    assert (got - ref).abs().max() > 0  # it did move
    out = {}
    assert _as_accurate_as_eager(model, batch, ref, got, out)
    assert 0 < out["eager_fp64_err"] < 1e-3 and out["hf_apply_fp64_err"] <= 2 * out["eager_fp64_err"]


def test_an_output_further_from_float64_than_eager_stays_a_mismatch():
    model, batch = Amplifier(), _batch()
    ref = _outputs(model, batch)
    got = ref + 1e-2 * ref.abs().max()
    out = {}
    assert not _as_accurate_as_eager(model, batch, ref, got, out)
    assert out["hf_apply_fp64_err"] > 2 * out["eager_fp64_err"]


def test_no_float64_run_means_no_judge():
    model, batch = NoDouble(), _batch()
    ref = _outputs(model, batch)
    out = {}
    assert not _as_accurate_as_eager(model, batch, ref, ref.clone(), out)
    assert "eager_fp64_err" not in out
