"""Models the doctor cannot run its checks on: one on the meta device (shapes without values) and a compiled
torch.jit.script/trace module. ``diagnose`` says so (a finding, resp. a TypeError naming the eager module it needs),
and ``addnorm doctor`` exits 2 with that message, not with the doctor's own failure (an ``.item()`` on a meta tensor,
``get_submodule`` on a ScriptModule)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from torch import nn

from addnorm.cli import main as cli_main
from addnorm.diagnostics import diagnose

TARGET = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Block(nn.Module):
        def __init__(self, d=16):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.ff = nn.Linear(d, d)

        def forward(self, x):
            return x + self.ff(self.norm(x))


    class Net(nn.Module):
        def __init__(self, d=16, n=2):
            super().__init__()
            self.layers = nn.ModuleList(Block(d) for _ in range(n))
            self.norm = nn.LayerNorm(d)

        def forward(self, x):
            for b in self.layers:
                x = b(x)
            return self.norm(x)


    def eager():
        return Net(), torch.randn(2, 5, 16)


    def meta():
        with torch.device("meta"):
            return Net(), torch.randn(2, 5, 16)


    def meta_batch():
        return Net(), {"x": torch.randn(2, 5, 16, device="meta")}


    def scripted():
        return torch.jit.script(Net()), torch.randn(2, 5, 16)


    def traced():
        return torch.jit.trace(Net(), torch.randn(2, 5, 16)), torch.randn(2, 5, 16)
    """
)


@pytest.fixture()
def target(tmp_path):
    path = tmp_path / "models.py"
    path.write_text(TARGET)
    return path


def _factory(target, name):
    ns: dict = {}
    exec(compile(target.read_text(), str(target), "exec"), ns)  # noqa: S102 - the test's own file
    return ns[name]()


@pytest.mark.parametrize("factory", ["meta", "meta_batch"])
def test_meta_device_model_is_reported_not_checked(target, factory, capsys):
    model, batch = _factory(target, factory)
    if factory == "meta_batch":
        batch = batch["x"]
    findings = diagnose(model, batch)
    assert [(f.code, f.severity) for f in findings] == [("values-not-checked", "warning")]
    assert "meta device" in findings[0].message and "to_empty" in findings[0].fix
    assert cli_main(["doctor", f"{target}:{factory}"]) == 2
    err = capsys.readouterr().err
    assert "meta device" in err and ".item()" not in err and "forward-failed" not in err


@pytest.mark.parametrize("factory", ["scripted", "traced"])
def test_script_module_asks_for_the_eager_module(target, factory, capsys):
    model, batch = _factory(target, factory)
    assert isinstance(model, torch.jit.ScriptModule)
    with pytest.raises(TypeError, match="the doctor needs the eager nn.Module"):
        diagnose(model, batch)
    assert cli_main(["doctor", f"{target}:{factory}"]) == 2
    err = capsys.readouterr().err
    assert "needs the eager nn.Module" in err and "pass the model before scripting or tracing it" in err
    assert "get_submodule" not in err and "checks themselves failed" not in err


def test_the_eager_model_is_checked(target):
    model, batch = _factory(target, "eager")
    assert isinstance(model, nn.Module) and "values-not-checked" not in {f.code for f in diagnose(model, batch)}
    assert cli_main(["doctor", f"{target}:eager"]) == 0
