import json
import subprocess
import sys

from addnorm.cli import main


def test_info_json_lists_versions_and_backends(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["torch"] and info["python"]
    cpu = info["backends"]["cpu"]
    assert cpu["torch"] is None and cpu["reference"] is None
    assert info["auto"]["cpu"] in ("torch", "cpu")
    # each unavailable backend carries a reason
    assert all(reason is None or isinstance(reason, str) and reason for reason in cpu.values())


def test_info_human_readable(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "backends for cpu tensors" in out and "torch" in out


def test_module_entry_point_and_help():
    r = subprocess.run([sys.executable, "-m", "addnorm", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "info" in r.stdout


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "usage" in capsys.readouterr().out


def test_version_flag(capsys):
    import addnorm

    try:
        main(["--version"])
    except SystemExit as e:
        assert e.code == 0
    assert capsys.readouterr().out.strip() == f"addnorm {addnorm.__version__}"


def test_info_help_documents_every_json_key(capsys):
    """`addnorm info --help` names each key that --json prints (scripts read them)."""
    import pytest

    assert main(["info", "--json"]) == 0
    keys = json.loads(capsys.readouterr().out)
    with pytest.raises(SystemExit):
        main(["info", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(k in text for k in keys), [k for k in keys if k not in text]


def test_info_reports_a_bad_backend_setting_instead_of_failing(capsys, monkeypatch):
    monkeypatch.setenv("ADDNORM_BACKEND", "nonsense")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "ADDNORM_BACKEND=nonsense" in out and "auto -> error: ADDNORM_BACKEND must be one of" in out
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["backend_env"] == "nonsense" and info["auto"]["cpu"].startswith("error: ")


_IMPORTS_AFTER = """
import sys
from addnorm.cli import main
for argv in (["--version"], ["--help"], []):
    try:
        main(argv)
    except SystemExit:
        pass
heavy = sorted(m for m in ("torch", "numpy", "numba", "transformers") if m in sys.modules)
print("HEAVY", heavy, file=sys.stderr)
"""


def test_version_and_help_answer_without_importing_torch():
    """torch takes seconds to import: `addnorm --version`/`--help` must not wait for it (they took 3.4 s)."""
    r = subprocess.run([sys.executable, "-c", _IMPORTS_AFTER], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "HEAVY []" in r.stderr, r.stderr
    # the help still lists every command with its summary
    for name in ("info", "lab", "train", "doctor"):
        assert f"    {name}" in r.stdout, r.stdout


def test_import_addnorm_is_lazy_but_the_api_is_there():
    code = (
        "import sys, addnorm; assert 'torch' not in sys.modules; "
        "import torch; x = torch.ones(2, 4); y = addnorm.rms_norm(x, torch.ones(4)); "
        "assert callable(addnorm.add_layer_norm) and 'add_rms_norm' in dir(addnorm); "
        "from addnorm import BackendUnavailableError; "
        "from addnorm.diagnostics import diagnose, Monitor; print('ok')"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_unknown_public_name_is_an_attribute_error():
    import pytest

    import addnorm

    with pytest.raises(AttributeError, match="no_such_name"):
        addnorm.no_such_name  # noqa: B018


def test_each_command_help_registers_its_module(capsys):
    import pytest

    for command, needle in (("doctor", "--timeout"), ("train", "--resume"), ("lab", "--quick")):
        with pytest.raises(SystemExit) as e:
            main([command, "--help"])
        assert e.value.code == 0
        assert needle in capsys.readouterr().out
