"""``addnorm doctor --json`` prints one JSON object on stdout on every exit: the findings (exit 0/1), or, when the
target cannot be loaded or checked (exit 2) or on Ctrl-C (130), ``{"findings": [], "error": ..., "status": ...,
"exit_code": ...}``. It printed nothing on those exits, so ``json.loads(stdout)`` failed; the human message stays on
stderr."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from addnorm.cli import main as cli_main

TARGET = textwrap.dedent(
    """
    import sys
    import time

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


    def clean():
        return Net(), torch.randn(2, 5, 16)


    def raises():
        raise RuntimeError("factory is broken")


    def not_a_pair():
        return Net()


    def exits():
        sys.exit(0)


    def meta():
        with torch.device("meta"):
            return Net(), torch.randn(2, 5, 16)


    def sleeper():
        time.sleep(60)


    def interrupted():
        raise KeyboardInterrupt
    """
)


@pytest.fixture()
def target(tmp_path):
    path = tmp_path / "models.py"
    path.write_text(TARGET)
    return path


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _error_report(capsys, argv, code, status, needle):
    """Run the doctor with --json; check the exit code, the JSON object on stdout and the message on stderr."""
    assert cli_main(["doctor", *argv, "--json"]) == code
    out, err = capsys.readouterr()
    doc = json.loads(out)  # raised JSONDecodeError on the empty stdout before
    assert doc == {"findings": [], "error": doc["error"], "status": status, "exit_code": code}
    assert needle in doc["error"] and f"addnorm doctor: {doc['error']}" in err  # the same message, for people
    return doc


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["{dir}/missing.py:clean"], "not found"),
        (["{file}"], "FILE.py:FACTORY"),
        (["{file}:no_such_factory"], "no attribute 'no_such_factory'"),
        (["{file}:raises"], "factory is broken"),
        (["{file}:not_a_pair"], "must return (model, example_batch)"),
        (["{file}:exits"], "sys.exit(0)"),
        (["{file}:meta"], "meta"),
        ([], "give TARGET"),
        (["{file}:clean", "--hf-config", "{dir}/config.json"], "not both"),
        (["--hf-config", "{dir}/nope.json"], "not found"),
        (["--hf-config", "{dir}/models.py"], "cannot read"),  # not JSON
    ],
)
def test_json_error_report_when_the_target_cannot_be_loaded(target, capsys, argv, needle):
    argv = [a.format(dir=target.parent, file=target) for a in argv]
    _error_report(capsys, argv, 2, "error", needle)


def test_json_error_report_for_an_unknown_hf_model_type(tmp_path, capsys):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "lama", "vocab_size": 64}))
    _error_report(capsys, ["--hf-config", str(path)], 2, "error", "did you mean 'llama'")


def test_json_error_report_when_the_checks_fail(target, capsys, monkeypatch):
    from addnorm.diagnostics.doctor import diagnosis

    def broken(model, batch):
        raise ZeroDivisionError("a doctor bug")

    monkeypatch.setattr(diagnosis, "diagnose", broken)
    _error_report(capsys, [f"{target}:clean"], 2, "error", "the checks themselves failed: ZeroDivisionError")


def test_json_error_report_on_timeout(target, capsys):
    _error_report(capsys, [f"{target}:sleeper", "--timeout", "0.5"], 2, "timeout", "did not finish")


def test_json_error_report_on_ctrl_c(target, capsys):
    _error_report(capsys, [f"{target}:interrupted"], 130, "interrupted", "interrupted")


def test_json_report_of_findings_is_unchanged(target, capsys):
    assert cli_main(["doctor", f"{target}:clean", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert list(doc) == ["findings"] and doc["findings"]  # no "error" key when the checks ran


def test_without_json_a_failure_prints_nothing_on_stdout(target, capsys):
    assert cli_main(["doctor", f"{target}:raises"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "factory is broken" in err
