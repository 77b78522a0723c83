"""Run flash-attention's, Liger-Kernel's, FlashInfer's and vLLM's OWN test files against addnorm.compat.

    python tools/compat_suites.py liger --backend cpu                           # fetches liger-kernel's sdist
    python tools/compat_suites.py flash-attn --backend cpu --hidden 192         # one hidden size of the grid
    TRITON_INTERPRET=1 python tools/compat_suites.py flash-attn --backend triton --seqlen 16 --hidden 192
    python tools/compat_suites.py all --device cuda --backend triton            # a GPU: full grid, full seqlen
    python tools/compat_suites.py flash-attn --source flash-attn=DIR            # offline: a folder of the files
    python tools/compat_suites.py flashinfer --backend cpu --subsample 4        # FlashInfer's tests/utils/test_norm.py
    python tools/compat_suites.py vllm --backend cpu --subsample 8              # vLLM's two norm kernel test files

What it does, per suite:

1. Gets the upstream files into ``--cache`` (default ``.compat-suites/``, git-ignored; reused offline):
   - liger: ``pip download --no-deps --no-binary :all: liger-kernel==0.8.5`` (the sdist ships ``test/``);
   - flash-attn: its sdists ship only ``tests/*.py`` (not ``tests/ops/triton/``), so the file is fetched from
     GitHub at the pinned commit; where GitHub is unreachable, pass a folder holding
     ``tests/ops/triton/test_layer_norm.py`` with ``--source flash-attn=DIR``;
   - flashinfer: ``tests/utils/test_norm.py`` from GitHub at the pinned commit (or ``--source flashinfer=DIR``);
     its tests that cannot run off a GPU by their own design are deselected, each with its reason in the summary;
     its one import of FlashInfer's tracing package (``flashinfer.trace.default_check``, a tolerance check) is
     served by a shim written into the run folder (``FLASHINFER_TRACE_SHIM`` below);
   - vllm: ``tests/kernels/core/test_layernorm.py`` and ``test_fused_quant_layernorm.py`` from GitHub at the pinned
     commit; ``tools/vllm_shim/`` is copied next to them (test-only stand-ins for their ``vllm`` and
     ``tests.kernels`` imports: ``vllm._custom_ops`` is ``addnorm.compat.vllm``), and their ``torch.ops._C.<op>``
     calls become ``torch.ops.addnorm_vllm.<op>``.
   Their files are never committed to this repository. The version/commit and each file's sha256 are printed.
2. Copies them into a run folder and rewrites ONLY (each rule listed in the summary; a rule that no longer
   matches the upstream text is an error, not a silent no-op):
   - imports: ``flash_attn.ops.triton.layer_norm`` / ``liger_kernel.*`` -> ``addnorm.compat.flash_attn`` /
     ``addnorm.compat.liger``; ``liger_kernel.utils``' ``infer_device``/``is_npu_available`` -> the chosen device;
     flash-attention's unused ``from einops import rearrange, repeat`` is dropped only when einops is missing;
   - the device: ``"cuda"`` -> ``--device`` (tensors and autocast), and the two device-capability queries that
     gate the bf16 cases (flash-attention's ``is_sm8x``, Liger's ``supports_bfloat16``) answer for that device
     (a CPU runs bf16, so the bf16 half of each grid runs instead of being skipped);
   - ``--seqlen N``: flash-attention's ``seqlen = 512`` (both tests) becomes N (the issue allows a small sequence
     length for the Triton interpreter).
   Every assertion, tolerance and parameter of their tests is left as it is.
3. Runs pytest on the rewritten files with ``ADDNORM_BACKEND=--backend`` and prints (``--json PATH`` writes) the
   outcome: passed / failed / skipped with the skip reasons grouped. A skip whose reason is not a string of the
   upstream file itself, or a failure raising NotImplementedError, counts as "missing feature"; the exit status is
   0 only with no failure and no missing feature.

``--hidden`` keeps only cases of the given hidden sizes and ``--subsample K`` a deterministic 1-in-K subset (by
the CRC32 of the test id); both are reported in the summary (the rest counts as deselected, not passed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CACHE = ROOT / ".compat-suites"


@dataclass(frozen=True)
class Rule:
    """One textual rewrite of an upstream file: ``pattern`` (a regex, MULTILINE) -> ``replacement``."""

    what: str  # shown in the summary
    pattern: str
    replacement: str
    required: bool = True  # the upstream file must contain it (else the file changed: stop, do not run blindly)


@dataclass(frozen=True)
class Suite:
    name: str
    files: tuple[str, ...]  # upstream paths to fetch (helpers included)
    tests: tuple[str, ...]  # the test files run
    pip_spec: str = ""  # an sdist that ships the files
    github: str = ""  # owner/repo, fetched at `commit` when no sdist ships them
    commit: str = ""
    # (test function, why, on CUDA too) not run: each is printed with its reason in the summary
    deselect: tuple[tuple[str, str, bool], ...] = ()
    shim: str = ""  # a folder of this repository copied next to the files: test-only stand-ins for their imports


SUITES = {
    "flash-attn": Suite(
        "flash-attn",
        files=("tests/ops/triton/test_layer_norm.py",),
        tests=("tests/ops/triton/test_layer_norm.py",),
        github="Dao-AILab/flash-attention",
        commit="01d6dd193034c92b6f46bc11f01a4c97fdc8aba6",
    ),
    "liger": Suite(
        "liger",
        files=("test/__init__.py", "test/conftest.py", "test/utils.py", "test/transformers/test_fused_add_rms_norm.py"),
        tests=("test/transformers/test_fused_add_rms_norm.py",),
        pip_spec="liger-kernel==0.8.5",
    ),
    "flashinfer": Suite(
        "flashinfer",
        files=("tests/utils/test_norm.py",),
        tests=("tests/utils/test_norm.py",),
        github="flashinfer-ai/flashinfer",
        commit="09928cf3ba8de21e42641b098ab19de724d24d3f",
        deselect=tuple(
            (name, "a 4 GB buffer behind torch.cuda.mem_get_info (FlashInfer's GPU-memory probe, CUDA only)", False)
            for name in (
                "test_rmsnorm_int64_stride",
                "test_rmsnorm_quant_int64_stride",
                "test_fused_add_rmsnorm_int64_stride",
                "test_fused_add_rmsnorm_quant_int64_stride",
            )
        )
        + tuple(
            (
                name,
                "a 175000 x 12288 tensor (4-8 GB) behind torch.cuda.mem_get_info (FlashInfer's probe, CUDA only)",
                False,
            )
            for name in (
                "test_rmsnorm_contiguous_overflow",
                "test_gemma_rmsnorm_contiguous_overflow",
                "test_rmsnorm_quant_contiguous_overflow",
                "test_fused_add_rmsnorm_contiguous_overflow",
                "test_gemma_fused_add_rmsnorm_contiguous_overflow",
                "test_fused_add_rmsnorm_quant_contiguous_overflow",
                "test_layernorm_contiguous_overflow",
                "test_qk_rmsnorm_contiguous_overflow",
            )
        )
        + (("test_norm_compilation_without_fp8", "builds FlashInfer's own CUDA sources with nvcc (its JIT)", True),),
    ),
    "vllm": Suite(
        "vllm",
        files=("tests/kernels/core/test_layernorm.py", "tests/kernels/core/test_fused_quant_layernorm.py"),
        tests=("tests/kernels/core/test_layernorm.py", "tests/kernels/core/test_fused_quant_layernorm.py"),
        github="vllm-project/vllm",
        commit="0a88d969d25280ee389277b47c66b6362b45aebf",
        shim="tools/vllm_shim",
    ),
}


def _capability(device: str, cuda_expr: str) -> str:
    """The replacement of a bf16 capability query: unchanged on CUDA, True elsewhere (CPUs run bf16)."""
    return cuda_expr if device == "cuda" else "True"


def rules_for(suite: str, path: str, device: str, seqlen: int | None, have_einops: bool) -> list[Rule]:
    """The rewrites of one upstream file (see the module docstring); nothing else of their files changes."""
    dev = re.escape('"cuda"')
    if suite == "flash-attn":
        rules = [
            Rule(
                "import: flash_attn.ops.triton.layer_norm -> addnorm.compat.flash_attn",
                r"^from flash_attn\.ops\.triton\.layer_?norm import",
                "from addnorm.compat.flash_attn import",
            ),
            Rule(
                f"bf16 gate is_sm8x: answers for {device}",
                r'torch\.cuda\.get_device_capability\("cuda"\)\[0\] >= 8',
                _capability(device, 'torch.cuda.get_device_capability("cuda")[0] >= 8'),
            ),
            Rule(f'device = "cuda" -> "{device}"', r"^(\s*)device = " + dev, rf'\1device = "{device}"'),
            Rule(
                f'autocast device_type="cuda" -> "{device}"',
                r"device_type=" + dev,
                f'device_type="{device}"',
                required=False,
            ),
        ]
        if not have_einops:
            # imported by their file but unused; einops is no dependency of addnorm (checked unused below)
            rules.append(
                Rule(
                    "drop unused `from einops import rearrange, repeat` (einops not installed)",
                    r"^from einops import rearrange, repeat\n",
                    "",
                    required=False,
                )
            )
        if seqlen is not None:
            rules.append(Rule(f"seqlen = 512 -> {seqlen}", r"^(\s*)seqlen = 512$", rf"\g<1>seqlen = {seqlen}"))
        return rules
    if suite == "liger":
        mark = "  # addnorm compat_suites: device rewrite\n"
        infer = Rule(
            f"import: liger_kernel.utils.infer_device -> returns {device!r}",
            r"^from liger_kernel\.utils import infer_device$",
            f"def infer_device():{mark}    return {device!r}",
        )
        if path.endswith("test_fused_add_rms_norm.py"):
            return [
                Rule(
                    "import: liger_kernel.* -> addnorm.compat.liger",
                    r"^from liger_kernel\.[\w.]+ import (LigerFusedAddRMSNormFunction|liger_fused_add_rms_norm"
                    r"|LigerFusedAddRMSNorm)$",
                    r"from addnorm.compat.liger import \1",
                ),
                infer,
                Rule(
                    f"bf16 gate supports_bfloat16: answers for {device}",
                    r"^from test\.utils import supports_bfloat16$",
                    "from test.utils import supports_bfloat16"
                    if device == "cuda"
                    else "def supports_bfloat16():  # addnorm compat_suites: device rewrite (a CPU runs bf16)\n"
                    "    return True",
                ),
            ]
        if path == "test/utils.py":
            return [infer]
        if path == "test/conftest.py":
            return [
                Rule(
                    "import: liger_kernel.utils.is_npu_available -> False",
                    r"^from liger_kernel\.utils import is_npu_available$",
                    f"def is_npu_available():{mark}    return False",
                )
            ]
        return []
    if suite == "flashinfer":
        return [
            Rule(
                "import: flashinfer -> addnorm.compat.flashinfer",
                r"^import flashinfer$",
                "import addnorm.compat.flashinfer as flashinfer",
            ),
            Rule(
                "import: flashinfer.utils.device_support_pdl -> addnorm.compat.flashinfer's",
                r"^from flashinfer\.utils import device_support_pdl$",
                "from addnorm.compat.flashinfer import device_support_pdl",
            ),
            Rule(
                "import: flashinfer.jit (its nvcc JIT, used only by the deselected compilation test) -> None",
                r"^from flashinfer\.jit import env as jit_env\nfrom flashinfer\.jit\.core import gen_jit_spec$",
                "jit_env = gen_jit_spec = None  # addnorm compat_suites: FlashInfer's nvcc JIT (test deselected)",
            ),
            Rule(
                "import: flashinfer.trace.default_check -> the harness's shim of it (FlashInfer's trace package "
                "is not addnorm's)",
                r"^(\s*)from flashinfer\.trace import default_check$",
                r"\1from _addnorm_flashinfer_trace import default_check",
            ),
            Rule(f'.to(0) -> .to("{device}")', r"\.to\(0\)", f'.to("{device}")'),
            Rule(f'device="cuda" -> "{device}"', r"device=" + dev, f'device="{device}"'),
        ]
    if suite == "vllm":
        rules = [
            Rule(
                "torch.ops._C.<op> -> torch.ops.addnorm_vllm.<op> (registered by addnorm.compat.vllm, _C's schemas)",
                r"torch\.ops\._C\.",
                "torch.ops.addnorm_vllm.",
            ),
            Rule(f'device="cuda" -> "{device}"', r"device=" + dev, f'device="{device}"'),
        ]
        if device != "cuda":
            rules.append(
                Rule(
                    f"CUDA_DEVICES (cuda:0, cuda:1) -> [{device!r}]",
                    r'^CUDA_DEVICES = \[\n    f"cuda:\{i\}" for i in range\(1 if torch\.accelerator\.device_count\(\) == 1 '
                    r"else 2\)\n\]$",
                    f"CUDA_DEVICES = [{device!r}]",
                )
            )
            call = {
                "test_layernorm.py": r"torch\.accelerator\.synchronize\(\)",
                "test_fused_quant_layernorm.py": r"torch\.accelerator\.set_device_index\(device\)",
            }[path.rpartition("/")[2]]
            rules.append(Rule(f"{call.replace(chr(92), '')} -> pass (no accelerator on {device})", call, "pass"))
        return rules
    raise ValueError(f"suite must be one of {sorted(SUITES)}, got {suite!r}")


def rewrite(text: str, rules: list[Rule]) -> tuple[str, list[str]]:
    """Apply ``rules`` to ``text``; returns the new text and one line per rule applied (with its count). A
    required rule that matches nothing raises ValueError: the upstream file is not the one these rules fit."""
    done = []
    for rule in rules:
        text, n = re.subn(rule.pattern, rule.replacement, text, flags=re.MULTILINE)
        if n == 0 and rule.required:
            raise ValueError(f"rewrite rule {rule.what!r} matched nothing: the upstream file changed; check it")
        if n:
            done.append(f"{rule.what} (x{n})")
    if re.search(r"\b(rearrange|repeat)\(", text) and "from einops import" not in text:
        raise ValueError("the file uses einops but einops is not installed: pip install einops")
    return text, done


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _source_info(folder: Path) -> dict:
    info_path = folder / "SOURCE.json"
    if info_path.exists():
        return json.loads(info_path.read_text())
    if (folder / ".git").exists():  # a checkout of the upstream repository (not a folder inside another one)
        try:
            commit = subprocess.run(
                ["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
            ).stdout.strip()
            return {"origin": f"git checkout {folder}", "version": commit}
        except (OSError, subprocess.CalledProcessError):
            pass
    pkg_info = folder / "PKG-INFO"
    if pkg_info.exists():
        m = re.search(r"^Version: (.+)$", pkg_info.read_text(), flags=re.MULTILINE)
        return {"origin": f"sdist folder {folder}", "version": m.group(1) if m else "unknown"}
    return {"origin": f"local folder {folder}", "version": "unknown"}


def _fetch_sdist(suite: Suite, dest: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--no-build-isolation",
            suite.pip_spec,
            "-d",
            tmp,
        ]
        r = subprocess.run(cmd, capture_output=True, text=True)
        archives = list(Path(tmp).glob("*.tar.gz"))
        if r.returncode != 0 or not archives:
            raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
        with tarfile.open(archives[0]) as tar:
            top = tar.getnames()[0].split("/")[0]
            for rel in suite.files:
                member = tar.extractfile(f"{top}/{rel}")
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                (dest / rel).write_bytes(member.read())
        return {"origin": f"PyPI sdist {archives[0].name}", "version": suite.pip_spec}


def _fetch_github(suite: Suite, dest: Path) -> dict:
    for rel in suite.files:
        url = f"https://raw.githubusercontent.com/{suite.github}/{suite.commit}/{rel}"
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:  # noqa: S310 - a fixed https URL
                data = resp.read()
        except OSError as err:
            raise RuntimeError(
                f"cannot fetch {url} ({err}). flash-attention's sdists do not ship tests/ops/triton/; pass a folder "
                f"holding {rel} (a checkout of {suite.github}) with --source {suite.name}=DIR"
            ) from None
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_bytes(data)
    return {"origin": f"github.com/{suite.github}", "version": suite.commit}


def get_sources(suite: Suite, cache: Path, source: Path | None) -> tuple[Path, dict]:
    """The folder holding the suite's upstream files, and where they came from (fetched once into ``cache``)."""
    if source is not None:
        missing = [rel for rel in suite.files if not (source / rel).is_file()]
        if missing:
            raise FileNotFoundError(f"--source {suite.name}={source}: missing {', '.join(missing)}")
        return source, _source_info(source)
    folder = cache / suite.name
    if all((folder / rel).is_file() for rel in suite.files):
        return folder, _source_info(folder)
    folder.mkdir(parents=True, exist_ok=True)
    info = _fetch_sdist(suite, folder) if suite.pip_spec else _fetch_github(suite, folder)
    (folder / "SOURCE.json").write_text(json.dumps(info, indent=1) + "\n")
    return folder, info


# A pytest plugin written next to the rewritten files: filters the collected cases (--hidden, --subsample) and
# records each case's outcome, skip reason and exception type as JSON (what the summary counts).
PLUGIN = r"""
import json, os, time, zlib

_CFG = json.loads(os.environ["ADDNORM_COMPAT_SELECT"])
_RESULTS = {}
_DESELECTED = []
_SELECTED = []
_SESSION = []
_START = time.monotonic()


def pytest_sessionstart(session):
    _SESSION.append(session)


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        hidden = params.get("hidden_size", params.get("hd"))  # flash-attention's name, Liger's
        ok = not _CFG["hidden"] or hidden is None or hidden in _CFG["hidden"]
        ok = ok and zlib.crc32(item.nodeid.encode()) % _CFG["subsample"] == 0
        (keep if ok else drop).append(item)
    _DESELECTED.extend(item.nodeid for item in drop)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_collection_finish(session):
    _SELECTED.extend(item.nodeid for item in session.items)  # after every filter (ours, -k, -m)


def pytest_runtest_logreport(report):
    r = _RESULTS.setdefault(report.nodeid, {"outcome": "passed", "duration": 0.0})
    r["duration"] += report.duration
    limit = _CFG["max_seconds"]
    if report.when == "teardown" and limit and time.monotonic() - _START > limit and _SESSION:
        _SESSION[0].shouldstop = "--max-seconds reached"  # stops after this case; the summary counts the rest
    if report.when != "call" and report.passed:
        return
    if hasattr(report, "wasxfail"):
        r["outcome"] = "xfailed" if report.skipped else "xpassed"
    elif report.skipped:
        r["outcome"] = "skipped"
        r["reason"] = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    elif report.failed:
        r["outcome"] = "failed" if report.when == "call" else "error"
        crash = getattr(report.longrepr, "reprcrash", None)
        r["message"] = crash.message if crash is not None else str(report.longrepr)[-500:]


# Under pytest-xdist (`-- -n 8`) the workers collect, filter and run; the controller sees every case's report.
# Workers leave their (identical) deselection count in a side file, and only the controller writes the results.
_DESELECTED_FILE = os.environ["ADDNORM_COMPAT_RESULTS"] + ".deselected"

try:
    import pytest as _pytest
    import xdist  # noqa: F401

    # optional: with `-p no:xdist` the hook's plugin is not registered, and a required hook would fail collection
    @_pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(node, ids):
        if not _SELECTED:
            _SELECTED.extend(ids)
except ImportError:
    pass


def pytest_sessionfinish(session):
    worker = getattr(session.config, "workerinput", None)  # set only in an xdist worker of THIS run
    if worker is not None:
        if worker["workerid"] == "gw0":
            with open(_DESELECTED_FILE, "w") as f:
                f.write(str(len(_DESELECTED)))
        return
    deselected = len(_DESELECTED)
    if not deselected and os.path.exists(_DESELECTED_FILE):
        deselected = int(open(_DESELECTED_FILE).read() or 0)
    with open(os.environ["ADDNORM_COMPAT_RESULTS"], "w") as f:
        json.dump({"cases": _RESULTS, "deselected": deselected, "selected": len(_SELECTED)}, f)
"""


# FlashInfer's test_layernorm_quant imports `default_check` from its `flashinfer.trace` package, a tracing tool that
# addnorm.compat.flashinfer does not stand for. This shim states the same check, written from its documented
# behaviour (flashinfer/trace/template.py at 00c6ba87): each output pair of equal shape; floating tensors compared
# with torch.isclose in float32 at tolerances by dtype (float8: 0.1, bfloat16: 1e-2, float16: 1e-3, float32:
# 1e-5), failing when the per cent of elements not close exceeds max_mismatch_pct, or the cosine similarity of the
# finite elements is below min_cos_sim (None: not checked); other tensors compared exactly under the same budget.
FLASHINFER_TRACE_SHIM = r"""
import torch

_TOL = {"float8": 0.1, "bfloat16": 1e-2, "float16": 1e-3, "float32": 1e-5, "float64": 1e-7}


def _tol(dtype):
    name = str(dtype).removeprefix("torch.")
    return next((t for prefix, t in _TOL.items() if name.startswith(prefix)), 0.0)


def _cos(a, b):
    a, b = a.reshape(-1).float(), b.reshape(-1).float()
    keep = a.isfinite() & b.isfinite()
    a, b = a[keep], b[keep]
    na, nb = a.norm(), b.norm()
    if not keep.any():
        return 1.0
    if na == 0 or nb == 0:
        return 1.0 if torch.equal(a, b) else 0.0
    return float((a * b).sum() / (na * nb))


def default_check(reference_outputs, actual_outputs, *, rtol=None, atol=None, max_mismatch_pct=0.0,
                  min_cos_sim=1.0 - 1e-3):
    refs = list(reference_outputs) if isinstance(reference_outputs, (list, tuple)) else [reference_outputs]
    acts = list(actual_outputs) if isinstance(actual_outputs, (list, tuple)) else [actual_outputs]
    if len(refs) != len(acts):
        return False
    for ref, act in zip(refs, acts):
        if not isinstance(ref, torch.Tensor) or not isinstance(act, torch.Tensor):
            if ref != act:
                return False
            continue
        if ref.shape != act.shape:
            return False
        if ref.numel() == 0:
            continue
        if ref.is_floating_point() or act.is_floating_point():
            t = _tol(act.dtype if act.is_floating_point() else ref.dtype)
            close = torch.isclose(act.float(), ref.float(), rtol=t if rtol is None else rtol,
                                  atol=t if atol is None else atol)
            if 100.0 * (1.0 - close.float().mean().item()) > max_mismatch_pct:
                return False
            if min_cos_sim is not None and _cos(act, ref) < min_cos_sim:
                return False
        elif 100.0 * (1.0 - (act == ref).float().mean().item()) > max_mismatch_pct:
            return False
    return True
"""


def prepare_run(suite: Suite, src: Path, run_dir: Path, device: str, seqlen: int | None) -> list[str]:
    """Copy the suite's files into ``run_dir`` with the rewrites applied; returns the rewrites done."""
    try:
        import einops  # noqa: F401

        have_einops = True
    except ImportError:
        have_einops = False
    done = []
    for rel in suite.files:
        text, applied = rewrite((src / rel).read_text(), rules_for(suite.name, rel, device, seqlen, have_einops))
        (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / rel).write_text(text)
        done += [f"{rel}: {line}" for line in applied]
    # their folder, not this repository's pytest settings; Liger's `flaky` mark registered but never acted on
    (run_dir / "pytest.ini").write_text("[pytest]\nmarkers =\n    flaky: pytest-rerunfailures' mark (no reruns here)\n")
    (run_dir / "_addnorm_compat_plugin.py").write_text(PLUGIN)
    if suite.name == "flashinfer":
        (run_dir / "_addnorm_flashinfer_trace.py").write_text(FLASHINFER_TRACE_SHIM)
    if suite.shim:
        shutil.copytree(ROOT / suite.shim, run_dir, dirs_exist_ok=True)
        done.append(f"shim: {suite.shim}/ copied next to the files (their imports of vllm and tests.kernels)")
    return done


def summarize(results: dict, upstream_text: str) -> dict:
    """Counts by outcome; skip reasons grouped, split into the upstream file's own skips and any other."""
    counts: dict[str, int] = {}
    own_skips: dict[str, int] = {}
    other_skips: dict[str, int] = {}
    failures = []
    missing_feature = 0
    for nodeid, r in sorted(results.items()):
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
        if r["outcome"] == "skipped":
            reason = r.get("reason", "").removeprefix("Skipped: ")
            own = reason and (repr(reason)[1:-1] in upstream_text or reason in upstream_text)
            (own_skips if own else other_skips)[reason] = (own_skips if own else other_skips).get(reason, 0) + 1
            missing_feature += not own
        elif r["outcome"] in ("failed", "error"):
            failures.append(f"{nodeid}: {r.get('message', '')[:300]}")
            missing_feature += "NotImplementedError" in r.get("message", "")
    return {
        "counts": counts,
        "upstream_skips": own_skips,
        "other_skips": other_skips,
        "missing_feature": missing_feature,
        "failures": failures,
    }


def _deselected(suite: Suite, device: str) -> list[tuple[str, str]]:
    return [(name, why) for name, why, on_cuda in suite.deselect if on_cuda or device != "cuda"]


def run_suite(suite: Suite, args: argparse.Namespace, source: Path | None) -> dict:
    src, info = get_sources(suite, args.cache, source)
    files = {rel: sha256(src / rel) for rel in suite.files}
    with tempfile.TemporaryDirectory(prefix=f"addnorm-{suite.name}-") as tmp:
        run_dir = Path(tmp)
        rewrites = prepare_run(suite, src, run_dir, args.device, args.seqlen)
        results_path = run_dir / "results.json"
        # an outer pytest-xdist run (this repository's tests) must not leak its worker identity into this one
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
        env = dict(
            env,
            ADDNORM_BACKEND=args.backend,
            ADDNORM_COMPAT_RESULTS=str(results_path),
            ADDNORM_COMPAT_SELECT=json.dumps(
                {"hidden": args.hidden, "subsample": args.subsample, "max_seconds": args.max_seconds}
            ),
        )
        # addnorm itself: whatever this interpreter imports (an install, or PYTHONPATH=src), made absolute
        import addnorm

        paths = [str(Path(addnorm.__file__).parents[1])] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        env["PYTHONPATH"] = os.pathsep.join(paths)
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:rerunfailures",
            "-p",
            "_addnorm_compat_plugin",
            "--rootdir",
            str(run_dir),
            *suite.tests,
            *(f"--deselect={t}::{name}" for t in suite.tests for name, _ in _deselected(suite, args.device)),
            *args.pytest_args,
        ]
        print(f"== {suite.name}: {info['origin']} @ {info['version']}", flush=True)
        for rel, digest in files.items():
            print(f"   {rel}  sha256 {digest}")
        print("   rewrites: " + "; ".join(rewrites))
        print(
            f"   ADDNORM_BACKEND={args.backend} device={args.device} TRITON_INTERPRET="
            f"{os.environ.get('TRITON_INTERPRET', '')} hidden={args.hidden or 'all'} subsample=1/{args.subsample}"
        )
        load_before = os.getloadavg()
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=run_dir, env=env)
        wall = time.monotonic() - start
        if not results_path.exists():
            raise RuntimeError(f"pytest exited with status {proc.returncode} before running any case")
        results = json.loads(results_path.read_text())
        upstream = "\n".join((src / rel).read_text() for rel in suite.tests)
    summary = summarize(results["cases"], upstream)
    summary["deselected"] = results["deselected"]
    summary["deselected_by_suite"] = dict(_deselected(suite, args.device))
    summary["not_run"] = results["selected"] - len(results["cases"])  # stopped by --max-seconds
    summary.update(
        suite=suite.name,
        origin=info["origin"],
        version=info["version"],
        files=files,
        rewrites=rewrites,
        backend=args.backend,
        device=args.device,
        seqlen=args.seqlen,
        hidden=args.hidden,
        subsample=args.subsample,
        pytest_exit=proc.returncode,
        max_seconds=args.max_seconds,
        wall_s=round(wall, 1),
        load_before=[round(x, 2) for x in load_before],
        load_after=[round(x, 2) for x in os.getloadavg()],
        triton_interpret=os.environ.get("TRITON_INTERPRET", ""),
    )
    return summary


def print_summary(s: dict) -> None:
    counts = ", ".join(f"{n} {k}" for k, n in sorted(s["counts"].items()))
    counts += f" ({s['deselected']} deselected by --hidden/--subsample)" if s["deselected"] else ""
    if s["not_run"]:  # stopped by --max-seconds, or pytest ended before running them (its exit status says why)
        why = "--max-seconds" if s.get("max_seconds") else f"pytest exit status {s['pytest_exit']}"
        counts += f"; {s['not_run']} NOT RUN ({why})"
    print(
        f"-- {s['suite']} ({s['origin']} @ {s['version']}), backend {s['backend']} on {s['device']}: {counts}; "
        f"missing feature: {s['missing_feature']}; {s['wall_s']} s, "
        f"load {s['load_before']} -> {s['load_after']}"
    )
    for name, why in s.get("deselected_by_suite", {}).items():
        print(f"   deselected {name}: {why}")
    for reason, n in s["upstream_skips"].items():
        print(f"   skipped by the upstream test itself ({n}): {reason}")
    for reason, n in s["other_skips"].items():
        print(f"   skipped, NOT an upstream skip ({n}): {reason}")
    for line in s["failures"][:20]:
        print(f"   FAILED {line}")


def _hidden(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--hidden must be comma-separated integers, got {text!r}") from None


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def _source(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or name not in SUITES:
        raise argparse.ArgumentTypeError(f"--source must be SUITE=DIR with SUITE one of {sorted(SUITES)}, got {text!r}")
    if not Path(path).is_dir():
        raise argparse.ArgumentTypeError(f"--source {name}: {path!r} is not a folder")
    return name, Path(path).resolve()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    p.add_argument("suite", choices=[*SUITES, "all"], help="which upstream test file(s) to run")
    p.add_argument(
        "--backend",
        default="cpu",
        choices=["torch", "reference", "cpu", "triton"],
        help="addnorm backend (ADDNORM_BACKEND); triton on CPU needs TRITON_INTERPRET=1",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="replaces their 'cuda' (default cpu)")
    p.add_argument(
        "--seqlen", type=_positive, default=None, help="flash-attention's seqlen (512 upstream; leave unset to keep it)"
    )
    p.add_argument("--hidden", type=_hidden, default=[], help="keep only these hidden sizes, e.g. 192,2048")
    p.add_argument("--subsample", type=_positive, default=1, help="keep a deterministic 1-in-K subset of cases")
    p.add_argument(
        "--max-seconds",
        type=_positive,
        default=None,
        help="stop starting new cases after this many seconds per suite (the rest is reported not run)",
    )
    p.add_argument(
        "--source",
        type=_source,
        action="append",
        default=[],
        metavar="SUITE=DIR",
        help="use the upstream files in DIR (offline) instead of fetching them",
    )
    p.add_argument(
        "--cache", type=Path, default=DEFAULT_CACHE, help=f"where fetched files are kept ({DEFAULT_CACHE.name}/)"
    )
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the summaries as JSON")
    p.epilog += "\n\nExtra pytest arguments go after --, e.g. `... flash-attn -- -x --durations=10`."
    argv = sys.argv[1:] if argv is None else list(argv)
    pytest_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    args.pytest_args = pytest_args
    if args.device == "cuda" and args.backend == "cpu":
        p.error("--backend cpu runs on CPU tensors; use --device cpu (or --backend triton/torch on cuda)")
    sources = dict(args.source)
    names = list(SUITES) if args.suite == "all" else [args.suite]
    summaries = []
    for name in names:
        try:
            summaries.append(run_suite(SUITES[name], args, sources.get(name)))
        except (RuntimeError, FileNotFoundError, ValueError) as err:
            print(f"error: {name}: {err}", file=sys.stderr)
            return 2
    for s in summaries:
        print_summary(s)
    if args.json is not None:
        from addnorm.io import atomic_write_json

        atomic_write_json(args.json, summaries)
    ok = all(not s["failures"] and not s["missing_feature"] and not s["not_run"] and s["counts"] for s in summaries)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
