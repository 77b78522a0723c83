"""``addnorm train``: an error about a value given with its own flag names that flag (not only the TrainConfig
field), and nan is refused as "not a finite number" (it is a number to Python)."""

from __future__ import annotations

import pytest

from addnorm.cli import main
from addnorm.train.cli import name_flags
from addnorm.train.config import TrainConfig
from tests.train.test_train_hostile import TINY


@pytest.mark.parametrize(
    ("flag", "value", "words"),
    [
        ("--lr", "nan", "finite number, got nan"),
        ("--lr", "-1", "> 0"),
        ("--steps", "0", "positive int"),
        ("--batch-size", "0", "positive int"),
        ("--seq-len", "0", "positive int"),
        ("--warmup", "-1", ">= 0"),
        ("--seed", "-1", "[0, 2**63)"),
    ],
)
def test_a_bad_flag_value_is_an_error_naming_the_flag(flag, value, words, capsys):
    argv = ["train", *TINY, *(["--steps", "1"] if flag != "--steps" else []), flag, value]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"addnorm train: error: {flag} (TrainConfig." in err and words in err
    assert "Traceback" not in err


def test_nan_in_a_train_field_is_a_value_error_saying_finite():
    with pytest.raises(ValueError, match="z_loss must be a finite number, got nan"):
        TrainConfig(z_loss=float("nan"))


def test_name_flags_leaves_fields_without_a_flag_and_named_ones_alone():
    assert name_flags("TrainConfig.z_loss must be >= 0") == "TrainConfig.z_loss must be >= 0"
    already = "TrainConfig.device (--device) must be cpu"
    assert name_flags(already) == already
    assert name_flags("TrainConfig.lr must be > 0") == "--lr (TrainConfig.lr) must be > 0"


def test_sigterm_stops_a_training_run_with_the_resume_message_and_exit_143(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    argv = ["train", *TINY, "--steps", "100000", "--set", "checkpoint_every=5", "--out", str(tmp_path / "r")]
    code = f"import sys; from addnorm.cli import main; sys.exit(main({argv!r}))"
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, env=env, cwd=os.getcwd())
    log = tmp_path / "r" / "log.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (log.exists() and log.read_text().count("\n") >= 6):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 143, err
    assert "interrupted (SIGTERM)" in err and "--resume" in err and "Traceback" not in err
    assert (tmp_path / "r" / "checkpoint.pt").exists()


def test_a_new_run_into_an_out_holding_a_checkpoint_is_refused_and_it_is_kept(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["train", *TINY, "--steps", "2", "--out", str(out)]) == 0
    capsys.readouterr()
    before = (out / "checkpoint.pt").read_bytes(), (out / "args.json").read_bytes()
    assert main(["train", *TINY, "--steps", "3", "--lr", "3e-3", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "checkpoint.pt" in err and "--resume" in err
    assert ((out / "checkpoint.pt").read_bytes(), (out / "args.json").read_bytes()) == before
    assert main(["train", "--out", str(out), "--resume"]) == 0  # --resume still continues it
