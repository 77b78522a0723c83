"""README.md and docs/*.md as a user reads them: every ```python block runs as written, each in a fresh process, so
the docs cannot drift from the code again (the README's examples once used names they never defined: x, branch_out,
ffn, ids, model).

A block that cannot run on a CPU-only machine without a network says so on its first line, ``# needs: cuda`` or
``# needs: network``; it is then reported as skipped with that reason (a ``cuda`` one runs where a GPU is present).
A block that imports an optional dependency (an extra) that is not installed is skipped the same way. Nothing is
skipped silently: a fence spelled any other way (```py, ```python3, ...) is an error, not an unrun block.

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
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]  # every page whose python blocks run

# a block that uses one of these needs that optional dependency (an extra), and is skipped without it
_NEEDS = {"addnorm.integrations import hf": "transformers", "diagnostics.plots": "matplotlib"}
# what a block may declare on its first line ("# needs: cuda"), and why it is not run without it
_MARKERS = {"cuda": "needs a CUDA GPU", "network": "downloads (the tests run offline)"}
_MARKER = re.compile(r"#\s*needs:\s*(\S+)")


def python_blocks(text: str, name: str = "README.md") -> list[tuple[int, str]]:
    """(line number of the opening fence, code) of every ```python block of ``text`` (the page ``name``)."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        fence = lines[i].strip()
        if fence.startswith(("```", "~~~")) and fence.lstrip("`~").strip().lower().startswith("py"):
            if fence != "```python":
                raise ValueError(
                    f"{name} line {i + 1}: write the fence as ```python (not {fence!r}), so its block runs"
                )
            start, body = i + 1, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise ValueError(f"{name} line {start}: ```python block is never closed")
            blocks.append((start, "\n".join(body) + "\n"))
        i += 1
    return blocks


def needs(code: str) -> str | None:
    """The marker a block declares on its first line (``# needs: cuda``), or None; an unknown one is an error."""
    first = code.lstrip("\n").split("\n", 1)[0]
    m = _MARKER.match(first.strip())
    if m is None:
        return None
    if m.group(1) not in _MARKERS:
        raise ValueError(f"unknown '# needs: {m.group(1)}' (known: {', '.join(_MARKERS)})")
    return m.group(1)


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


BLOCKS = [
    (_name(page), line, code) for page in PAGES for line, code in python_blocks(page.read_text("utf-8"), _name(page))
]


def test_the_extractor_finds_blocks_and_only_python_ones():
    text = "a\n```python\nx = 1\n```\n```bash\nrm -rf /\n```\n```python\ny = 2\nz = 3\n```\n"
    assert python_blocks(text) == [(2, "x = 1\n"), (8, "y = 2\nz = 3\n")]
    with pytest.raises(ValueError, match="never closed"):
        python_blocks("```python\nx = 1\n")
    for fence in ("```py", "```python3", "```Python", "~~~python", "``` python"):
        with pytest.raises(ValueError, match="write the fence as"):
            python_blocks(f"{fence}\nx = 1\n```\n", "docs/x.md")
    assert needs("# needs: cuda\nx = 1\n") == "cuda" and needs("x = 1  # needs: cuda\n") is None
    with pytest.raises(ValueError, match="unknown"):
        needs("# needs: tpu\n")
    names = {name for name, _, _ in BLOCKS}
    assert "README.md" in names and len(names) >= 5  # the README and the docs pages with examples
    assert len([b for b in BLOCKS if b[0] == "README.md"]) >= 5  # kernels, modules, diagnostics, Hugging Face, compat


def test_blocks_that_cannot_run_everywhere_are_rare():
    """A `# needs:` block is the exception: the docs' examples are meant to run on a CPU-only machine, offline."""
    marked = [f"{name}:{line}" for name, line, code in BLOCKS if needs(code)]
    assert len(marked) <= 3, marked


@pytest.mark.parametrize("page, line, code", BLOCKS, ids=[f"{name}:{line}" for name, line, _ in BLOCKS])
def test_python_block_runs_as_written(page, line, code, tmp_path):
    marker = needs(code)
    if marker == "network" or (marker == "cuda" and not _cuda_available()):
        pytest.skip(f"{page}:{line} {_MARKERS[marker]}")
    for needle, module in _NEEDS.items():
        if needle in code and importlib.util.find_spec(module) is None:
            pytest.skip(f"{page}:{line} needs {module}")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "MPLBACKEND": "Agg",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    # a fresh process in an empty directory: nothing defined or imported beforehand, files it writes land there
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{page} block at line {line} failed:\n{r.stderr[-3000:]}"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def test_docs_index_lists_every_page():
    """docs/README.md names every file of docs/, and says which are generated."""
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    for page in sorted(DOCS.iterdir()):
        if page.name != "README.md":
            assert f"]({page.name})" in index, f"docs/README.md does not link {page.name}"
    for generated in ("lab-results.md", "survey.md", "survey.json"):
        row = next(line for line in index.splitlines() if line.startswith(f"| [`{generated}`]"))
        assert "**generated**" in row, generated
    assert "addnorm lab doc" in index and "addnorm survey --docs docs/survey.md --readme README.md" in index


README_MAX_LINES = 150


def test_readme_fits_one_sitting():
    """The README stays a page: at most 150 lines, its generated survey paragraphs counted as they stand (they grow
    with transformers: when they do, shorten the written text, not the generated part)."""
    lines = README.read_text(encoding="utf-8").splitlines()
    generated = sum(
        lines.index(f"<!-- /survey:{name} -->") - lines.index(f"<!-- survey:{name} -->") - 1
        for name in ("hf-fused", "summary")
    )
    assert generated > 0  # the markers are there, and the count includes what lies between them
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines ({generated} generated), more than {README_MAX_LINES}"
    )


def test_readme_test_command_is_the_one_ci_runs():
    """The Quick start's test command is what .ci/run executes on a clean checkout."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    assert ci.startswith("pip install") and ci in README.read_text(encoding="utf-8")


def test_reference_means_the_float_oracles():
    """ "Reference" is addnorm.reference (and the `reference` backend that runs it); the torch backend is the
    plain-PyTorch backend (fallback and baseline), never "the reference"."""
    for page in PAGES:
        text = " ".join(page.read_text(encoding="utf-8").split())
        for phrase in (
            "readable reference",
            "reference path",
            "(the reference,",
            "PyTorch reference",
            "torch reference",
        ):
            assert phrase not in text, f"{_name(page)}: {phrase!r}"


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
    # the page may come from a run of every experiment (--suite all) rather than the default core suite: the README
    # then gives that command its time, and the default's time beside it
    command = "addnorm lab --suite all" if re.search(r"\bsuite all\b", doc[: doc.index("wall time")]) else "addnorm lab"
    assert f"`{command}`\n{wall.group(1)}" in quick_start or f"`{command}` {wall.group(1)}" in quick_start
