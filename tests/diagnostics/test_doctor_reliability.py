"""The doctor against hostile targets and inputs (issue 30): NaN weights, a huge --timeout, a module that changes
the working directory at import, a factory that calls os._exit, a config whose validation error spans two lines."""

from __future__ import annotations

import json
import os

import pytest
import torch

from addnorm.cli import main as cli_main
from addnorm.diagnostics import diagnose
from tests.diagnostics.test_diagnostics_doctor import TOY, TOY_SRC


def test_nan_weights_give_no_false_skip_errors_and_keep_the_direction():
    """A model with NaN weights used to get residual-not-identity errors ("ratio nan") on every block and be called
    bidirectional: its blocks saw NaN inputs. The NaN is reported once, as what it is."""
    model = TOY["ToyLM"](n_layers=3)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.fill_(float("nan"))  # every output of the attention is NaN
    findings = diagnose(model, TOY["batch"]())
    errors = [f for f in findings if f.severity == "error"]
    assert {f.code for f in errors} == {"non-finite"}, [(f.code, f.message) for f in errors]
    (summary,) = [f for f in findings if f.code == "summary"]
    assert "causal (decoder-only)" in summary.message and "placement Pre-Norm" in summary.message


def test_direction_of_a_layer_scaled_encoder_is_bidirectional():
    """A bidirectional encoder whose branches are scaled by 1e-6 (vision encoders' layer scale) moves the other
    positions by ~1e-9: a forward difference called it causal; the gradient does not."""
    model = TOY["ToyLM"](n_layers=2, gain=1e-6)
    for block in model.blocks:
        block.attn.forward = _bidirectional(block.attn)
    (summary,) = [f for f in diagnose(model, TOY["batch"]()) if f.code == "summary"]
    assert "bidirectional (encoder)" in summary.message


def _bidirectional(attn):
    import torch.nn.functional as F

    def forward(x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, attn.h, c // attn.h).transpose(1, 2) for z in attn.qkv(x).split(c, dim=2))
        return attn.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, c))

    return forward


@pytest.fixture
def toy_file(tmp_path):
    path = tmp_path / "toy_model.py"
    path.write_text(TOY_SRC)
    return path


@pytest.mark.parametrize("value", ["1e12", "1e10"])
def test_cli_timeout_too_large_is_refused_by_name(toy_file, capsys, value):
    """--timeout 1e12 used to pass validation and end in OverflowError from the interval timer."""
    with pytest.raises(SystemExit) as e:
        cli_main(["doctor", f"{toy_file}:clean", "--timeout", value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--timeout" in err and "at most" in err and "Traceback" not in err


def test_cli_timeout_at_the_maximum_runs(toy_file, capsys):
    assert cli_main(["doctor", f"{toy_file}:clean", "--timeout", "1e9", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["findings"]


def test_cli_module_that_changes_directory_at_import(tmp_path, monkeypatch, capsys):
    """A target given by a relative path that calls os.chdir at import: the cleanup of sys.path resolved the path
    again, elsewhere, and failed with list.remove(x)."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "mover.py").write_text(
        TOY_SRC + "\n\nimport os as _os\n_os.chdir(_os.path.join(_os.path.dirname(__file__), 'elsewhere'))\n"
    )
    monkeypatch.chdir(tmp_path)
    before = list(__import__("sys").path)
    assert cli_main(["doctor", "mover.py:clean", "--json"]) == 0
    out = capsys.readouterr().out
    assert "summary" in {f["code"] for f in json.loads(out)["findings"]}
    assert __import__("sys").path == before  # the folder added for the import was removed again


@pytest.mark.parametrize("where", ["factory", "import", "forward"])
def test_cli_target_calling_os_exit_is_a_load_failure(tmp_path, capsys, where):
    """os._exit(0) in a factory ended the doctor at once: exit status 0 and no output, a clean pass to a script."""
    src = TOY_SRC + "\n\nimport os as _os\n"
    if where == "import":
        src += "_os._exit(0)\n"
    src += "\n\nclass ExitLM(ToyLM):\n    def forward(self, idx):\n        _os._exit(0)\n"
    src += "\n\ndef make():\n"
    src += "    _os._exit(0)\n" if where == "factory" else "    return ExitLM(), batch()\n"
    path = tmp_path / "exits.py"
    path.write_text(src)
    real = os._exit
    assert cli_main(["doctor", f"{path}:make"]) == 2
    assert os._exit is real  # restored
    err = capsys.readouterr().err
    assert "os._exit(0)" in err and "cannot be checked" in err


def test_cli_hf_config_validation_error_keeps_its_cause(tmp_path, capsys):
    """hidden size 30 with 4 heads: transformers' error puts the reason on its second line, which was cut off."""
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    config = {"model_type": "llama", "hidden_size": 30, "num_attention_heads": 4, "vocab_size": 64}
    path.write_text(json.dumps(config))
    assert cli_main(["doctor", "--hf-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not a multiple of the number of attention heads" in err, err
