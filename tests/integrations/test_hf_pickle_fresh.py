"""A model patched by ``hf.apply`` and saved whole (``torch.save(model)``) loads in a fresh process that never ran
``apply``: the fused classes are made again from the transformers classes they were made from, with the same
forwards (the same logits bit for bit, the same fused calls, still revertible)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from addnorm.integrations import hf  # noqa: E402
from addnorm.integrations.hf.handoff import fused_runs  # noqa: E402

_LOAD = """
import sys, torch
from addnorm.integrations.hf import handoff
saved = torch.load(sys.argv[1], weights_only=False)
torch.set_num_threads(saved["threads"])  # bit for bit needs the same BLAS split as the saving process
model, ids = saved["model"], saved["ids"]
names = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("AddNorm")})
assert names == saved["names"], (names, saved["names"])
before = handoff.fused_runs()
with torch.no_grad():
    logits = model(ids).logits
assert handoff.fused_runs() - before == saved["runs"], (handoff.fused_runs() - before, saved["runs"])
assert torch.equal(logits, saved["logits"]), (logits - saved["logits"]).abs().max()
from addnorm.integrations import hf
assert hf.is_applied(model) and hf.fused_layer_classes(model) == saved["fused"]
hf.revert(model)
assert not any(type(m).__name__.startswith("AddNorm") for m in model.modules())
print("ok", names)
"""


# llama: template layers with handoff norms; bloom: producer children rewritten (their adds made by a helper);
# gpt_neox: a parallel block rewritten from its own source
@pytest.mark.parametrize("family", ["llama", "bloom", "gpt_neox"])
def test_a_saved_patched_model_loads_in_a_process_that_never_ran_apply(family, tmp_path):
    model = hf.apply(hf.tiny_model(family).eval())
    ids = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(0))
    before = fused_runs()
    with torch.no_grad():
        logits = model(ids).logits
    runs = fused_runs() - before
    names = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("AddNorm")})
    assert any(n.startswith("AddNormFused") for n in names), names
    path = tmp_path / "model.pt"
    fused = hf.fused_layer_classes(model)
    torch.save(
        dict(model=model, ids=ids, logits=logits, runs=runs, names=names, fused=fused, threads=torch.get_num_threads()),
        path,
    )
    src = str(Path(hf.__file__).resolve().parents[3])  # src/addnorm/integrations/hf/__init__.py
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", _LOAD, str(path)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok")


def test_a_class_transformers_no_longer_fuses_fails_to_load_with_a_clear_error(monkeypatch):
    """If the layer class unpickled has no fused forward here (another transformers version), loading says so and
    what to do, rather than running a forward that no longer matches the class."""
    import pickle

    from addnorm.integrations.hf import patch

    model = hf.apply(hf.tiny_model("llama").eval())
    data = pickle.dumps(model.model.layers[0])
    base = type(model.model.layers[0])._addnorm_made_from[0]
    monkeypatch.setattr(patch, "_FUSED_CLASSES", {})
    monkeypatch.setattr(patch, "layer_rule", lambda module: None)
    with pytest.raises(RuntimeError, match=f"cannot unpickle addnorm's fused {base.__name__}.*revert"):
        pickle.loads(data)
