"""Monitor (numbers equal a manual computation, hooks removable, JSONL/plots), anomaly detection and the NaN
sentinel, on tiny nanoGPT-style models."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from addnorm.diagnostics import Monitor, NonFiniteSentinel, SpikeDetector, find_blocks, localize_jump

V, T, B, D = 40, 6, 2, 16


class Attn(nn.Module):
    """Causal self-attention that keeps the largest pre-softmax logit of its last forward in ``max_attn_logit``."""

    def __init__(self, d: int, h: int = 2):
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        att = q @ k.transpose(-1, -2) / math.sqrt(c // self.h)  # (b, h, t, t)
        self.max_attn_logit = att.detach().amax()
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d), Attn(d)
        self.ln_2, self.mlp = nn.LayerNorm(d), nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyLM(nn.Module):
    def __init__(self, n_layers: int = 3, d: int = D):
        super().__init__()
        self.wte = nn.Embedding(V, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, V, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def loss_of(model, idx, tgt):
    return F.cross_entropy(model(idx).reshape(-1, V), tgt.reshape(-1))


def rms(t):
    return float(t.detach().double().pow(2).mean().sqrt())


def no_hooks(model: nn.Module) -> bool:
    return all(
        not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)
        for m in model.modules()
    )


# ---- finding the blocks ---------------------------------------------------------------------------------------------
def test_find_blocks_known_paths_generic_and_explicit():
    model = TinyLM()
    assert [n for n, _ in find_blocks(model)] == ["blocks.0", "blocks.1", "blocks.2"]

    class HFStyle(nn.Module):  # Llama-style nesting: model.model.layers
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.layers = nn.ModuleList(Block(D) for _ in range(2))
            self.heads = nn.ModuleList(nn.Linear(D, V) for _ in range(3))  # more entries, not the layers

    assert [n for n, _ in find_blocks(HFStyle())] == ["model.layers.0", "model.layers.1"]

    class Anonymous(nn.Module):  # no known name: the largest same-class ModuleList wins
        def __init__(self):
            super().__init__()
            self.small = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
            self.stack = nn.ModuleList(Block(D) for _ in range(4))

    assert [n for n, _ in find_blocks(Anonymous())] == [f"stack.{i}" for i in range(4)]
    assert [n for n, _ in find_blocks(Anonymous(), "small")] == ["small.0", "small.1"]
    m = Anonymous()
    assert [n for n, _ in find_blocks(m, [m.stack[1], m.stack[3]])] == ["stack.1", "stack.3"]
    with pytest.raises(ValueError, match="blocks="):
        find_blocks(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="no submodule"):
        find_blocks(model, "nope.layers")
    with pytest.raises(ValueError, match="submodule of the model"):
        find_blocks(model, [nn.Linear(2, 2)])


# ---- numbers --------------------------------------------------------------------------------------------------------
def test_record_matches_manual_computation():
    model = TinyLM()
    idx, tgt = data()
    with Monitor(model) as mon:
        loss = loss_of(model, idx, tgt)
        loss.backward()
        rec = mon.step(loss=loss, lr=1e-3)

    # Manual forward, block by block, with the norm inputs taken by hand.
    with torch.no_grad():
        x = model.wte(idx)
        res, norm_in, attn_logit = [], [], []
        for block in model.blocks:
            a = x
            x = x + block.attn(block.ln_1(x))
            norm_in.append(max(rms(a), rms(x)))
            attn_logit.append(float(block.attn.max_attn_logit))
            x = x + block.mlp(block.ln_2(x))
            res.append(rms(x))
        logits = model.head(model.ln_f(x))
    total = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))

    assert rec["step"] == 0 and rec["lr"] == 1e-3
    assert rec["loss"] == pytest.approx(float(loss.detach()), rel=1e-6)
    assert rec["grad_norm"] == pytest.approx(total, rel=1e-5)
    assert rec["output_logz"] == pytest.approx(float(torch.logsumexp(logits.double(), -1).mean()), rel=1e-5)
    assert len(rec["layers"]) == 3
    for i, (entry, block) in enumerate(zip(rec["layers"], model.blocks)):
        g = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in block.parameters()))
        assert entry["name"] == f"blocks.{i}" and entry["index"] == i
        assert entry["grad_norm"] == pytest.approx(g, rel=1e-5)
        assert entry["residual_rms"] == pytest.approx(res[i], rel=1e-5)
        assert entry["norm_input_rms"] == pytest.approx(norm_in[i], rel=1e-5)
        assert entry["max_attn_logit"] == pytest.approx(attn_logit[i], rel=1e-5)
    assert mon.history == [rec]


def test_record_every_and_last_forward_wins():
    model = TinyLM(n_layers=2)
    mon = Monitor(model, record_every=2)
    recs = []
    for s in range(4):
        idx, tgt = data(s)
        model.zero_grad()
        loss_of(model, idx, tgt).backward()
        recs.append(mon.step(loss=0.0))
    assert [r is not None for r in recs] == [True, False, True, False]
    assert [r["step"] for r in mon.history] == [0, 2]

    # Two forwards before one step (gradient accumulation): the record describes the second one.
    mon = Monitor(model)
    model(data(7)[0])
    idx2 = data(8)[0]
    model(idx2).sum().backward()
    rec = mon.step()
    with torch.no_grad():
        x = model.wte(idx2)
        for block in model.blocks:
            x = block(x)
    assert rec["layers"][-1]["residual_rms"] == pytest.approx(rms(x), rel=1e-5)
    assert rec["loss"] is None
    mon.detach()


def test_update_size_on_probe():
    model = TinyLM(n_layers=2)
    probe = data(3)[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    mon = Monitor(model, probe=probe, probe_every=2)
    sizes = []
    for s in range(3):
        opt.zero_grad()
        loss = loss_of(model, *data(s))
        loss.backward()
        sizes.append(mon.step(loss=loss).get("update_size"))
        opt.step()
    # Step 0: parameters unchanged; step 1 is not a probe step; step 2 sees two optimizer updates.
    assert sizes[0] == 0.0 and sizes[1] is None and sizes[2] > 0
    mon.detach()


def test_update_size_equals_manual():
    model = TinyLM(n_layers=2)
    probe = data(3)[0]
    with torch.no_grad():
        ref = model(probe).clone()
    mon = Monitor(model, probe=probe, probe_every=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
        expected = float(torch.linalg.vector_norm(model(probe) - ref))
    model(probe).sum().backward()
    assert mon.step()["update_size"] == pytest.approx(expected, rel=1e-5)
    mon.detach()


def test_output_logz_on_a_strided_subset_of_positions():
    model = TinyLM(n_layers=1)
    idx = data()[0]  # B * T = 12 positions
    with Monitor(model, logz_rows=4) as mon:
        logits = model(idx)
        rec = mon.step()
    rows = logits.detach().double().reshape(-1, V)[::3]  # 12 positions, at most 4: every third
    assert rec["output_logz"] == pytest.approx(float(torch.logsumexp(rows, -1).mean()), rel=1e-6)
    with pytest.raises(ValueError, match="logz_rows"):
        Monitor(model, logz_rows=0)


def test_sparse_embedding_gradients():
    model = TinyLM(n_layers=1)
    model.wte.sparse = True
    with Monitor(model) as mon:
        loss_of(model, *data()).backward()
        rec = mon.step()
    assert model.wte.weight.grad.is_sparse
    dense = [p.grad.to_dense() if p.grad.is_sparse else p.grad for p in model.parameters()]
    assert rec["grad_norm"] == pytest.approx(math.sqrt(sum(float(g.double().pow(2).sum()) for g in dense)), rel=1e-5)


# ---- lifecycle and outputs -----------------------------------------------------------------------------------------
def test_detach_removes_every_hook():
    model = TinyLM(n_layers=2)
    assert no_hooks(model)
    mon = Monitor(model)
    assert not no_hooks(model)
    mon.detach()
    assert no_hooks(model)
    # Nothing runs afterwards: a forward leaves the monitor's per-forward state untouched.
    mon._residual = ["sentinel"] * 2
    model(data()[0])
    assert mon._residual == ["sentinel"] * 2
    with Monitor(model):
        assert not no_hooks(model)
    assert no_hooks(model)


def test_jsonl_one_flushed_record_per_step(tmp_path):
    model = TinyLM(n_layers=2)
    path = tmp_path / "run.jsonl"
    mon = Monitor(model, jsonl=path)
    for s in range(3):
        model.zero_grad()
        loss = loss_of(model, *data(s))
        loss.backward()
        mon.step(loss=loss)
        lines = path.read_text().splitlines()  # flushed: readable before detach
        assert len(lines) == s + 1
    mon.detach()
    assert [json.loads(line) for line in path.read_text().splitlines()] == mon.history


def test_bad_arguments():
    model = TinyLM(n_layers=2)
    with pytest.raises(TypeError, match="model"):
        Monitor("not a model")
    with pytest.raises(ValueError, match="record_every"):
        Monitor(model, record_every=0)
    assert no_hooks(model)


def test_missing_tensorboard_names_the_extra_and_detaches(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # what an install without tensorboard sees
    model = TinyLM(n_layers=2)
    with pytest.raises(ImportError, match=r"pip install 'addnorm\[tensorboard\]'"):
        Monitor(model, tensorboard=tmp_path / "tb")
    assert no_hooks(model)  # the failed constructor cleaned up after itself


def test_a_failed_constructor_removes_its_hooks(tmp_path):
    model = TinyLM(n_layers=2)
    with pytest.raises(FileNotFoundError):
        Monitor(model, jsonl=tmp_path / "no-such-dir" / "run.jsonl")
    assert no_hooks(model)

    class IntOut(nn.Module):  # a model whose output has no floating-point tensor to probe
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x.argmax(-1)

    m = IntOut()
    with pytest.raises(ValueError, match="probe"):
        Monitor(m, probe=torch.randn(2, 4))
    assert no_hooks(m)


class _Writer:
    """Stands in for torch.utils.tensorboard.SummaryWriter: keeps what it is given."""

    instances: list = []

    def __init__(self, log_dir):
        self.log_dir, self.scalars, self.flushes, self.closed = log_dir, [], 0, False
        _Writer.instances.append(self)

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def flush(self):
        self.flushes += 1

    def close(self):
        self.closed = True


def test_tensorboard_gets_every_recorded_scalar(tmp_path, monkeypatch):
    """The TensorBoard path without the package: a stand-in writer receives exactly the records' numbers."""
    import sys
    import types

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = _Writer
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    _Writer.instances.clear()
    model = TinyLM(n_layers=2)
    mon = Monitor(model, tensorboard=tmp_path / "tb", probe=data(9)[0], probe_every=1, record_every=2)
    for s in range(3):
        model.zero_grad()
        loss = loss_of(model, *data(s))
        loss.backward()
        mon.step(loss=loss)
    (writer,) = _Writer.instances
    assert writer.log_dir == str(tmp_path / "tb")
    expected = []
    for rec in mon.history:  # steps 0 and 2 (record_every=2)
        for key in ("loss", "grad_norm", "output_logz", "update_size"):
            expected.append((f"addnorm/{key}", rec[key], rec["step"]))
        for e in rec["layers"]:
            for key in ("grad_norm", "residual_rms", "norm_input_rms", "max_attn_logit"):
                expected.append((f"addnorm/{key}/{e['index']:03d}", e[key], rec["step"]))
    assert [r["step"] for r in mon.history] == [0, 2]
    assert sorted(writer.scalars) == sorted(expected) and all(isinstance(v, float) for _, v, _ in writer.scalars)
    assert writer.flushes == 2  # one per record: readable while training runs
    mon.detach()
    assert writer.closed and no_hooks(model)


def test_tensorboard_event_files_hold_the_records(tmp_path):
    try:
        import tensorboard  # noqa: F401
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        pytest.skip(
            "tensorboard is not installed (pip install 'addnorm[tensorboard]'); the writer path is covered "
            "by test_tensorboard_gets_every_recorded_scalar"
        )
    model = TinyLM(n_layers=2)
    with Monitor(model, tensorboard=tmp_path / "tb") as mon:
        for s in range(2):
            model.zero_grad()
            loss = loss_of(model, *data(s))
            loss.backward()
            mon.step(loss=loss)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    got = [(e.step, e.value) for e in acc.Scalars("addnorm/grad_norm")]
    assert [s for s, _ in got] == [0, 1]
    assert [v for _, v in got] == pytest.approx([r["grad_norm"] for r in mon.history], rel=1e-6)
    assert "addnorm/residual_rms/001" in acc.Tags()["scalars"]


def test_plots_heatmap_and_curves(tmp_path):
    pytest.importorskip("matplotlib")
    from addnorm.diagnostics.plots import load_jsonl, plot_layer_curves, plot_layer_heatmap

    model = TinyLM(n_layers=3)
    mon = Monitor(model, jsonl=tmp_path / "log.jsonl")
    for s in range(4):
        model.zero_grad()
        loss_of(model, *data(s)).backward()
        mon.step()
    mon.detach()
    history = load_jsonl(tmp_path / "log.jsonl")
    fig = plot_layer_heatmap(history, key="grad_norm", path=tmp_path / "heat.png")
    shown = fig.axes[0].images[0].get_array()
    assert shown.shape == (3, 4)  # layers x steps
    for k, rec in enumerate(history):
        for i, entry in enumerate(rec["layers"]):
            assert float(shown[i, k]) == pytest.approx(entry["grad_norm"])
    assert (tmp_path / "heat.png").stat().st_size > 0
    fig = plot_layer_curves(history, key="residual_rms", path=tmp_path / "curves.png", layers=[0, 2])
    lines = fig.axes[0].get_lines()
    assert [list(ln.get_ydata()) for ln in lines] == [[r["layers"][i]["residual_rms"] for r in history] for i in (0, 2)]
    assert (tmp_path / "curves.png").stat().st_size > 0
    with pytest.raises(ValueError, match="layers"):
        plot_layer_curves(history, layers=[5])
    with pytest.raises(ValueError, match="empty"):
        plot_layer_heatmap([])


# ---- anomalies -------------------------------------------------------------------------------------------------------
def test_spike_detector_flags_spikes_not_noise():
    g = torch.Generator().manual_seed(0)
    noise = (2.0 + 0.01 * torch.randn(600, generator=g)).tolist()
    det = SpikeDetector()  # OLMo-core's defaults
    assert (det.window, det.sigmas) == (128, 6.0)
    assert not any(det.update(v) for v in noise)
    assert det.update(2.5)  # 50 sigma above the mean
    assert not det.update(2.0)  # the spike did not widen the band
    assert det.update(float("nan"))
    assert det.spikes == [600, 602]
    early = SpikeDetector(min_history=16)
    assert not any(early.update(v) for v in [1.0] * 15 + [100.0])  # too little history to judge the 16th
    with pytest.raises(ValueError, match="window"):
        SpikeDetector(window=1)
    with pytest.raises(ValueError, match="min_history"):
        SpikeDetector(window=8, min_history=9)


def test_localize_jump_finds_first_layer_and_step():
    history = []
    for step in range(12):
        layers = [{"name": f"blocks.{i}", "residual_rms": 1.0 + 0.1 * i + 0.01 * (step % 3)} for i in range(4)]
        if step >= 9:  # layer 2 blows up at step 9 and drags layer 3 with it
            layers[2]["residual_rms"] *= 20
            layers[3]["residual_rms"] *= 25
        history.append({"step": 10 * step, "layers": layers})
    jump = localize_jump(history, key="residual_rms", factor=3.0)
    assert (jump.layer, jump.name, jump.step, jump.record) == (2, "blocks.2", 90, 9)
    assert jump.value > 3 * jump.reference
    assert localize_jump(history[:9]) is None
    with pytest.raises(ValueError, match="factor"):
        localize_jump(history, factor=1.0)


def test_monitor_history_localizes_a_planted_blow_up():
    # The seed's bisection trick end to end: log the residual stream per layer, break one layer mid-run, and the
    # history points at that layer and step (later layers inherit the jump; the earlier one does not move).
    model = TinyLM(n_layers=3)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with Monitor(model) as mon:
        for step in range(8):
            if step == 5:
                with torch.no_grad():
                    model.blocks[1].mlp[2].weight.mul_(200.0)
            opt.zero_grad()
            loss = loss_of(model, *data(step))
            loss.backward()
            mon.step(loss=loss)
            opt.step()
    jump = localize_jump(mon.history, key="residual_rms", factor=3.0)
    assert (jump.layer, jump.name, jump.step) == (1, "blocks.1", 5)


class _LogOf(nn.Module):
    def forward(self, x):
        return torch.log(x)  # NaN for negative inputs


class _SqrtOfZero(nn.Module):
    def forward(self, x):
        return x + torch.sqrt(x * 0)  # finite forward; backward multiplies by 1/(2 sqrt(0)) = inf


class _Net(nn.Module):
    def __init__(self, bad: nn.Module):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.blocks = nn.Sequential(nn.Linear(4, 4), bad, nn.Linear(4, 4))
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        return self.out(self.blocks(self.inp(x)))


def test_sentinel_names_first_nonfinite_module_forward_and_backward():
    torch.manual_seed(0)
    net = _Net(_LogOf())
    x = torch.randn(8, 4)
    with NonFiniteSentinel(net) as sentinel:
        net(x).sum().backward()
    assert sentinel.first == ("forward", "blocks.1")
    assert no_hooks(net)

    net = _Net(_SqrtOfZero())
    sentinel = NonFiniteSentinel(net)
    out = net(x)
    assert sentinel.first_forward is None and torch.isfinite(out).all()
    out.sum().backward()
    assert sentinel.first == ("backward", "blocks.1")
    sentinel.reset()
    assert sentinel.first is None
    sentinel.detach()
    assert no_hooks(net)

    clean = _Net(nn.Identity())
    with NonFiniteSentinel(clean) as sentinel:
        clean(x).sum().backward()
    assert sentinel.first is None


@pytest.mark.parametrize("preset", ["gpt2", "llama"])
def test_addnorm_presets_match_manual(preset):
    nn_mod = pytest.importorskip("addnorm.nn")
    if not hasattr(nn_mod, "TransformerLM"):
        pytest.skip("addnorm.nn models not built yet")
    cfg = nn_mod.TransformerConfig.preset(preset, n_layers=2, d_model=D, n_heads=2, vocab_size=V, record_logits=True)
    model = nn_mod.TransformerLM(cfg)
    idx, tgt = data()
    with Monitor(model) as mon:
        loss_of(model, idx, tgt).backward()
        rec = mon.step()
    assert [e["name"] for e in rec["layers"]] == ["blocks.0", "blocks.1"]
    with torch.no_grad():
        x = model.embed(idx)
        res = []
        for block in model.blocks:
            x = block(x)
            res.append(rms(x))
    for entry, block, r in zip(rec["layers"], model.blocks, res):
        g = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in block.parameters()))
        assert entry["grad_norm"] == pytest.approx(g, rel=1e-5)
        assert entry["residual_rms"] == pytest.approx(r, rel=1e-5)
        logits = [float(m.max_logit) for m in block.modules() if getattr(m, "max_logit", None) is not None]
        assert logits and entry["max_attn_logit"] == pytest.approx(max(logits), rel=1e-5)

    # Norm inputs: the preset fuses each add with the next norm (norm(x, residual) -> (out, x + residual)); the
    # unfused twin with the same weights calls every norm on its plain input, which a pre-hook can read.
    twin = nn_mod.TransformerLM(cfg.replace(fuse_add_norm=False))
    twin.load_state_dict(model.state_dict())
    seen: dict[int, list[float]] = {}
    for i, block in enumerate(twin.blocks):
        for m in block.modules():
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
                m.register_forward_pre_hook(lambda mod, args, i=i: seen.setdefault(i, []).append(rms(args[0])))
    twin(idx)
    for i, entry in enumerate(rec["layers"]):
        assert entry["norm_input_rms"] == pytest.approx(max(seen[i]), rel=1e-5)
