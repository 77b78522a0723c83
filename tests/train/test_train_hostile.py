"""``addnorm train`` against hostile flags and paths (issue 30): every refusal is a message naming the flag, a
non-zero exit and nothing written; a run that produced non-finite numbers is "diverged", never a good checkpoint."""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path

import pytest
import torch

from addnorm import outpaths
from addnorm.cli import main
from addnorm.train.config import TrainConfig
from addnorm.train.loop import train
from tests.train.test_train import LANG, tiny_cfg, tiny_model

TINY = [
    *("--set d_model=16 --set n_layers=1 --set n_heads=2 --set backend=torch".split()),
    *("--batch-size 4 --seq-len 8 --warmup 1 --quiet".split()),
]


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _checkpoint_is_finite(path: Path) -> bool:
    state = torch.load(path, weights_only=True)
    return all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())


# ---- paths: empty, read-only, locked, full disk ------------------------------------------------------------------


def test_an_empty_out_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *TINY, "--steps", "2", "--out", ""]) == 2
    err = capsys.readouterr().err
    assert "--out is empty" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_folder_that_cannot_be_written_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    import addnorm.outpaths

    real_access = os.access
    monkeypatch.setattr(
        addnorm.outpaths.os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real_access(p, mode)
    )
    assert main(["train", *TINY, "--steps", "2", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "not writable" in err
    assert list(tmp_path.iterdir()) == []


def test_a_permission_error_while_writing_is_a_message(tmp_path, capsys, monkeypatch):
    """A folder that turns read-only under the run (root ignores modes, so the error is simulated)."""
    import addnorm.io

    def denied(path, data):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(addnorm.io, "atomic_write_json", denied)
    assert main(["train", *TINY, "--steps", "2", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "permission denied" in err and "Traceback" not in err


def test_a_full_disk_while_checkpointing_names_the_problem(tmp_path, capsys, monkeypatch):
    """torch.save onto a file on a full disk raised an opaque ``inline_container.cc ... unexpected pos``
    RuntimeError (seen on a 200 KB tmpfs). A disk that fills up mid-file: the first 4 KB go through, then
    ENOSPC, behind the same buffered file object ``os.fdopen`` gives."""
    import io

    import addnorm.io

    class FillingDisk(io.RawIOBase):
        def __init__(self, fd: int, room: int = 4096):
            self.fd, self.room = fd, room

        def writable(self):
            return True

        def fileno(self):
            return self.fd

        def write(self, data):
            if self.room <= 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            n = os.write(self.fd, bytes(data[: self.room]))
            self.room -= n
            return n

        def close(self):
            if not self.closed:
                os.close(self.fd)
            super().close()

    real_fdopen = os.fdopen

    def fdopen(fd, mode="r", **kw):
        return io.BufferedWriter(FillingDisk(fd)) if "b" in mode else real_fdopen(fd, mode, **kw)

    monkeypatch.setattr(addnorm.io.os, "fdopen", fdopen)
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no space left on the device" in err and "inline_container" not in err
    assert not (out / "checkpoint.pt").exists() and not list(out.glob(".checkpoint.pt.*"))


def test_a_second_train_into_a_locked_out_is_refused_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "2", "--out", str(out)]) == 0
    before = _files(out)
    capsys.readouterr()
    with outpaths.out_lock(out, command="addnorm train"):  # what a run in progress holds
        # --resume: a new run into an --out holding a checkpoint is refused before the lock (test_train_flag_names)
        assert main(["train", "--out", str(out), "--resume"]) == 2
        err = capsys.readouterr().err
        assert "in use by another `addnorm train` run" in err and "--out" in err
    after = _files(out)
    after.pop(".lock", None), before.pop(".lock", None)
    assert after == before


# ---- --resume: the data file and where it is ------------------------------------------------------------------------


def test_resume_refuses_a_data_file_that_changed(tmp_path, capsys):
    data = tmp_path / "notes.txt"
    data.write_bytes(bytes(range(256)) * 40)
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "2", "--data", str(data), "--out", str(out)]) == 0
    saved = json.loads((out / "args.json").read_text())
    assert saved["data"] == str(data.resolve()) and len(saved["data_sha256"]) == 64
    data.write_bytes(bytes(reversed(range(256))) * 40)
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--data" in err and "changed" in err and str(data.resolve()) in err


def test_resume_from_another_folder_finds_the_same_data_file(tmp_path, capsys, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "notes.txt").write_bytes(bytes(range(256)) * 40)
    (tmp_path / "b" / "notes.txt").write_bytes(b"another file of the same name " * 100)
    monkeypatch.chdir(tmp_path / "a")
    assert main(["train", *TINY, "--steps", "2", "--data", "notes.txt", "--out", "run", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    monkeypatch.chdir(tmp_path / "b")
    assert main(["train", "--out", str(tmp_path / "a" / "run"), "--resume", "--quiet", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["data"] == first["data"] and again["losses"] == first["losses"]
    # naming the same file again, by another relative path, is no conflict
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--out", "a/run", "--resume", "--quiet", "--data", "a/notes.txt"]) == 0


# ---- non-finite losses and weights ---------------------------------------------------------------------------------


def test_a_run_whose_last_update_made_the_weights_nan_is_diverged(tmp_path):
    cfg = tiny_cfg(steps=1, lr=1e30, warmup=0, out_dir=str(tmp_path))
    res = train(tiny_model(), LANG, cfg)
    assert res.diverged and res.summary()["diverged"] is True
    assert not (tmp_path / "checkpoint.pt").exists()


def test_no_checkpoint_ever_holds_non_finite_weights(tmp_path):
    cfg = tiny_cfg(steps=6, lr=1e30, warmup=0, checkpoint_every=1, out_dir=str(tmp_path))
    res = train(tiny_model(), LANG, cfg)
    assert res.diverged
    ckpt = tmp_path / "checkpoint.pt"
    assert not ckpt.exists() or _checkpoint_is_finite(ckpt)


def test_cli_huge_lr_exits_non_zero_as_diverged(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "1", "--lr", "1e30", "--out", str(out)]) == 1
    text = capsys.readouterr().out
    assert "diverged       YES" in text
    assert json.loads((out / "summary.json").read_text())["summary"]["diverged"] is True
    assert not (out / "checkpoint.pt").exists() or _checkpoint_is_finite(out / "checkpoint.pt")


# ---- --set and numeric flags parsed strictly ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "item, needle",
    [
        ("embed_scale=nan", "embed_scale"),
        ("residual_init_scaling=x", "residual_init_scaling"),
        ("qk_norm=1.5", "qk_norm"),
        ("n_layers=2.5", "n_layers"),
        ("n_layers=true", "n_layers"),
        ("dropout=nan", "dropout"),
        ("init_std=inf", "init_std"),
        ("z_loss=nan", "z_loss"),
        ("clip=inf", "clip"),
        ("schedule=3", "schedule"),
        ("adam_eps=0", "adam_eps"),
        ("beta2=1", "beta2"),
        ("eps=-inf", "eps"),
    ],
)
def test_set_values_are_parsed_by_the_fields_type(item, needle, tmp_path, capsys):
    assert main(["train", *TINY, "--steps", "1", "--set", item, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not (tmp_path / "run").exists() or not (tmp_path / "run" / "args.json").exists()


@pytest.mark.parametrize("flag, value", [("--lr", "inf"), ("--lr", "nan"), ("--lr", "-1")])
def test_numeric_flags_refuse_non_finite_values(flag, value, capsys):
    assert main(["train", *TINY, "--steps", "1", flag, value]) == 2
    assert "lr" in capsys.readouterr().err


def test_well_typed_set_values_are_accepted(capsys):
    argv = ["--set", "qk_norm=yes", "--set", "eps=1e-5", "--set", "d_ff=None", "--set", "clip=0", "--json"]
    assert main(["train", *TINY, "--steps", "1", *argv]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["qk_norm"] is True and report["model"]["eps"] == 1e-5 and report["train"]["clip"] == 0


# ---- devices and seeds ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["meta", "xla"])
def test_devices_training_cannot_run_on_are_refused(device, capsys):
    assert main(["train", *TINY, "--steps", "1", "--device", device]) == 2
    err = capsys.readouterr().err
    assert "device" in err and repr(device) in err and "Traceback" not in err


def test_every_seed_the_lab_derives_from_its_largest_seed_trains():
    """`lab --seed 4294967295` failed six experiments: they train with seeds seed + k (TrainConfig refused them)."""
    from addnorm.lab.runner import SEED_LIMIT

    largest = SEED_LIMIT - 1
    for k in (0, 1, 5, 999):
        assert TrainConfig(seed=largest + k).seed == largest + k
    res = train(tiny_model(), LANG, tiny_cfg(steps=2, seed=largest + 7))
    assert res.steps_done == 2 and not res.diverged
    with pytest.raises(ValueError, match="seed"):
        TrainConfig(seed=2**63)


def test_a_batched_member_whose_last_update_overflowed_is_diverged_like_train():
    from addnorm.train.batched import train_batched

    cfgs = [tiny_cfg(steps=1, lr=1e-2, warmup=0, seed=0), tiny_cfg(steps=1, lr=1e30, warmup=0, seed=1)]
    got = train_batched([tiny_model(0), tiny_model(1)], LANG, cfgs)
    ref = train(tiny_model(1), LANG, cfgs[1])
    assert ref.diverged and got[1].diverged and math.isnan(got[1].final_loss)
    assert not got[0].diverged and math.isfinite(got[0].final_loss)
