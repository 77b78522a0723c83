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


def test_an_existing_files_mode_is_kept(tmp_path):
    """`lab doc --output FILE` reset a 0600 (or 0755) file to the umask's 0644."""
    for mode in (0o600, 0o640, 0o755):
        target = tmp_path / f"f{mode:o}"
        target.write_text("old")
        target.chmod(mode)
        io.atomic_write_text(target, "new")
        assert target.read_text() == "new"
        assert stat.S_IMODE(target.stat().st_mode) == mode


def test_a_symlink_is_written_through_to_its_target(tmp_path):
    """The link stays a link (dotfile managers, docs linked into a site); its target gets the new content."""
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "page.md"
    target.write_text("old")
    target.chmod(0o640)
    link = tmp_path / "link.md"
    link.symlink_to(target)
    io.atomic_write_text(link, "new")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new" and stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["page.md"]  # no temporary left
    # a dangling link: its target is created, the link kept
    dangling = tmp_path / "dangling.md"
    dangling.symlink_to(tmp_path / "real" / "new.md")
    io.atomic_write_bytes(dangling, b"x")
    assert dangling.is_symlink() and (tmp_path / "real" / "new.md").read_bytes() == b"x"
    # a relative link resolves from the link's folder, not the current one
    rel = tmp_path / "rel.md"
    rel.symlink_to(os.path.join("real", "page.md"))
    io.atomic_write_text(rel, "again")
    assert rel.is_symlink() and target.read_text() == "again"
