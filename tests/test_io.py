"""addnorm.io: atomic writes keep the usual permissions and never leave a torn file."""

import json
import os
import stat

import pytest

from addnorm import io


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_atomic_writes_get_the_mode_open_would_give(tmp_path, mask):
    old = os.umask(mask)
    try:
        io.atomic_write_text(tmp_path / "a.md", "x")
        io.atomic_write_json(tmp_path / "b.json", {"v": float("inf")})
        io.atomic_write_bytes(tmp_path / "c.bin", b"\0")
        with open(tmp_path / "plain", "w") as f:
            f.write("x")
    finally:
        os.umask(old)
    want = stat.S_IMODE((tmp_path / "plain").stat().st_mode)
    assert want == 0o666 & ~mask
    for name in ("a.md", "b.json", "c.bin"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == want, name
    assert json.loads((tmp_path / "b.json").read_text()) == {"v": "inf"}


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "r.json"
    io.atomic_write_text(target, "old")

    def boom(f):
        f.write("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        io.atomic_write(target, boom, binary=False)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["r.json"]
