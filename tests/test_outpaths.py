"""addnorm.outpaths: the one set of checks on output paths every writing command uses."""

from __future__ import annotations

import errno
import os

import pytest

from addnorm import outpaths


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_path_is_refused_naming_the_flag(value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="--out is empty"):
        outpaths.out_dir(value)
    with pytest.raises(ValueError, match="--docs is empty"):
        outpaths.out_file(value, "--docs")
    assert list(tmp_path.iterdir()) == []


def test_a_file_where_a_folder_is_expected_and_the_reverse(tmp_path):
    a_file = tmp_path / "f.txt"
    a_file.write_text("keep")
    with pytest.raises(ValueError, match=r"--out '.*f\.txt' is a file, not a directory"):
        outpaths.out_dir(a_file)
    with pytest.raises(ValueError, match="is a file, so nothing can be created under it"):
        outpaths.out_dir(a_file / "sub")
    with pytest.raises(ValueError, match=r"--docs '.*' is a directory, not a file"):
        outpaths.out_file(tmp_path, "--docs")
    with pytest.raises(ValueError, match="--docs .* is a file, so nothing"):
        outpaths.out_file(a_file / "page.md", "--docs")
    assert a_file.read_text() == "keep"
    made = outpaths.out_dir(tmp_path / "a" / "b")
    assert made.is_dir()
    assert not outpaths.out_dir(tmp_path / "c", create=False).exists()
    assert outpaths.out_file(tmp_path / "new" / "page.md", "--docs") == tmp_path / "new" / "page.md"


def test_a_folder_that_cannot_be_written_is_refused(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    real_access = os.access
    # root may write anywhere, so the permission check is exercised by what os.access answers
    monkeypatch.setattr(outpaths.os, "access", lambda p, mode: False if str(p) == str(ro) else real_access(p, mode))
    with pytest.raises(ValueError, match=r"--out '.*ro': the folder .* is not writable"):
        outpaths.out_dir(ro)
    with pytest.raises(ValueError, match="--out .*ro/sub.* is not writable"):
        outpaths.out_dir(ro / "sub")
    with pytest.raises(ValueError, match="--output .* is not writable"):
        outpaths.out_file(ro / "page.md", "--output")
    assert list(ro.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_for_real(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    with pytest.raises(ValueError, match="not writable"):
        outpaths.out_dir(ro)


def test_two_outputs_that_are_one_file_are_refused(tmp_path):
    outpaths.check_distinct([("--docs", tmp_path / "a.md"), ("its rows", tmp_path / "a.json")])
    with pytest.raises(ValueError, match=r"--docs and its rows \(--docs with \.json\) are the same file"):
        outpaths.check_distinct(
            [("--docs", tmp_path / "x.json"), ("its rows (--docs with .json)", tmp_path / "x.json")]
        )
    (tmp_path / "d").mkdir()
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "d")
    with pytest.raises(ValueError, match="same file"):
        outpaths.check_distinct([("--readme", tmp_path / "d" / "R.md"), ("--docs", link / "R.md")])


def test_os_errors_are_described_in_words():
    full = OSError(errno.ENOSPC, "No space left on device", "/x/checkpoint.pt")
    assert outpaths.describe_os_error(full) == "no space left on the device: /x/checkpoint.pt"
    assert outpaths.describe_os_error(PermissionError(errno.EACCES, "Permission denied")) == "permission denied"
    assert outpaths.describe_os_error(OSError("odd")) == "odd"
