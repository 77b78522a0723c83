"""README.md as a user reads it: every ```python block runs as written, each in a fresh process, so the README
cannot drift from the code again (its examples used names they never defined: x, branch_out, ffn, ids, model).

Bash blocks are not run (they install packages and run the whole lab), but the citations a user cannot look up
are checked for: the README cites public papers.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# a block that uses one of these needs that optional dependency (an extra), and is skipped without it
_NEEDS = {"addnorm.integrations import hf": "transformers", "diagnostics.plots": "matplotlib"}


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number of the opening fence, code) of every ```python block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start, body = i + 1, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise ValueError(f"README.md line {start}: ```python block is never closed")
            blocks.append((start, "\n".join(body) + "\n"))
        i += 1
    return blocks


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def test_the_extractor_finds_blocks_and_only_python_ones():
    text = "a\n```python\nx = 1\n```\n```bash\nrm -rf /\n```\n```python\ny = 2\nz = 3\n```\n"
    assert python_blocks(text) == [(2, "x = 1\n"), (8, "y = 2\nz = 3\n")]
    with pytest.raises(ValueError, match="never closed"):
        python_blocks("```python\nx = 1\n")
    assert len(BLOCKS) >= 4  # functional API, modules, diagnostics, Hugging Face


@pytest.mark.parametrize("line, code", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_python_block_runs_as_written(line, code, tmp_path):
    for needle, module in _NEEDS.items():
        if needle in code and importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module}")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "MPLBACKEND": "Agg",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    # a fresh process in an empty directory: nothing defined or imported beforehand, files it writes land there
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"README.md block at line {line} failed:\n{r.stderr[-3000:]}"


def test_readme_cites_public_sources_only():
    """Users do not have the project's internal notes ("seed 000", "stability.md", "the seeds' table")."""
    text = README.read_text(encoding="utf-8")
    for pattern in (r"seed 0\d\d", r"stability\.md", r"seeds'? table"):
        assert not re.search(pattern, text, re.IGNORECASE), pattern
    for arxiv in ("2002.04745", "2203.00555", "2309.14322"):  # Xiong et al. 2020, DeepNet, Wortsman et al. 2023
        assert f"arXiv:{arxiv}" in text


def test_readme_timings_are_measured_ones():
    """The Quick start gives measured times with the machine named (install, lab, --quick), no placeholder, and the
    lab's time is the wall time of the run docs/lab-results.md was generated from, so the two cannot drift apart."""
    text = README.read_text(encoding="utf-8")
    start = text.index("## Quick start")
    quick_start = text[start : text.index("\n## ", start + 1)]
    assert "TODO" not in text and "about N " not in text
    assert "2-core" in quick_start and "install takes about" in quick_start and "--quick` " in quick_start
    doc = (README.parent / "docs" / "lab-results.md").read_text(encoding="utf-8")
    wall = re.search(r"wall time (\d+ min \d+ s) with --jobs (\d+)", doc)
    assert wall, "docs/lab-results.md states the run's wall time"
    assert f"`addnorm lab`\n{wall.group(1)}" in quick_start or f"`addnorm lab` {wall.group(1)}" in quick_start
