"""addnorm doctor: one planted-bug model per finding, clean models without errors, the CLI's exit codes."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from addnorm.cli import main as cli_main
from addnorm.diagnostics import diagnose

# A nanoGPT-style LM with knobs that plant each bug; written to a file for the CLI tests, exec'd for the rest.
TOY_SRC = textwrap.dedent("""
    import math
    import torch
    import torch.nn.functional as F
    from torch import nn

    V, T, B = 50, 7, 3  # T and B differ from every feature size, so a norm over them is recognisable


    class SeqLayerNorm(nn.Module):  # bug: normalizes each channel over the sequence axis
        def __init__(self, d):
            super().__init__()
            self.ln = nn.LayerNorm(T)

        def forward(self, x):
            return self.ln(x.transpose(1, 2)).transpose(1, 2)


    class BatchNormSeq(nn.Module):  # bug: BatchNorm over (B, T) per channel
        def __init__(self, d):
            super().__init__()
            self.bn = nn.BatchNorm1d(d)

        def forward(self, x):
            return self.bn(x.transpose(1, 2)).transpose(1, 2)


    class NaiveRMSNorm(nn.Module):  # bug: statistics in the input dtype (fp16/bf16 when the model runs there)
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


    def make_norm(kind, d):
        if kind == "ln":
            return nn.LayerNorm(d)
        if kind == "ln_2d":  # bug: LayerNorm([T, d]) shares statistics across positions
            return nn.LayerNorm([T, d])
        if kind == "ln_wrong":  # bug: normalized_shape does not match d
            return nn.LayerNorm(d // 2)
        return {"ln_seq": SeqLayerNorm, "bn": BatchNormSeq, "naive": NaiveRMSNorm}[kind](d)


    class Attn(nn.Module):
        def __init__(self, d, h, n_layers):
            super().__init__()
            self.h = h
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            for lin in (self.qkv, self.proj):
                nn.init.normal_(lin.weight, std=0.02)
                nn.init.zeros_(lin.bias)
            nn.init.normal_(self.proj.weight, std=0.02 / math.sqrt(2 * n_layers))

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, t, c))


    class MLP(nn.Module):
        def __init__(self, d, n_layers):
            super().__init__()
            self.fc = nn.Linear(d, 4 * d)
            self.proj = nn.Linear(4 * d, d)
            nn.init.normal_(self.fc.weight, std=0.02)
            nn.init.normal_(self.proj.weight, std=0.02 / math.sqrt(2 * n_layers))

        def forward(self, x):
            return self.proj(F.gelu(self.fc(x)))


    class Block(nn.Module):
        def __init__(self, d, h, n_layers, placement, skip, norm, gain):
            super().__init__()
            self.placement, self.skip, self.gain = placement, skip, gain
            self.ln_1, self.ln_2 = make_norm(norm, d), make_norm(norm, d)
            self.attn, self.mlp = Attn(d, h, n_layers), MLP(d, n_layers)
            if skip == "proj":  # bug: a projection on the skip path
                self.skip_proj = nn.Linear(d, d)

        def res(self, x):
            if self.skip == "scale":  # bug: the skip path is scaled
                return 0.5 * x
            if self.skip == "proj":
                return self.skip_proj(x)
            return x

        def forward(self, x):
            if self.placement == "nonorm":  # bug for residual-growth: branches read the raw, growing stream
                x = x + self.gain * self.mlp(x)
                return x + self.gain * self.mlp(x)
            if self.placement == "pre":
                x = self.res(x) + self.gain * self.attn(self.ln_1(x))
                return self.res(x) + self.gain * self.mlp(self.ln_2(x))
            x = self.ln_1(self.res(x) + self.gain * self.attn(x))
            return self.ln_2(self.res(x) + self.gain * self.mlp(x))


    class ToyLM(nn.Module):
        def __init__(self, d=32, h=4, n_layers=3, placement="pre", skip="identity", norm="ln", gain=1.0,
                     final_norm=True):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, d), nn.Embedding(16, d)
            nn.init.normal_(self.wte.weight, std=0.02)
            nn.init.normal_(self.wpe.weight, std=0.01)
            self.blocks = nn.ModuleList(Block(d, h, n_layers, placement, skip, norm, gain) for _ in range(n_layers))
            self.ln_f = make_norm("ln", d) if final_norm else nn.Identity()
            self.head = nn.Linear(d, V, bias=False)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))


    def batch():
        return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))


    def clean():
        return ToyLM(), batch()


    def scaled_skip():
        return ToyLM(skip="scale"), batch()


    def not_a_factory_result():
        return ToyLM()


    def raises():
        raise RuntimeError("factory is broken")
""")


def toy():
    ns: dict = {}
    exec(compile(TOY_SRC, "<toy>", "exec"), ns)
    return ns


TOY = toy()


def codes(findings, severity=None):
    return {f.code for f in findings if severity is None or f.severity == severity}


def run(**kw):
    return diagnose(TOY["ToyLM"](**kw), TOY["batch"]())


# ---- one planted bug per finding --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, code, severity, module",
    [
        (dict(skip="scale"), "residual-not-identity", "error", "blocks.0"),
        (dict(skip="proj"), "residual-not-identity", "error", "blocks.0"),
        (dict(final_norm=False), "missing-final-norm", "error", "blocks"),
        (dict(norm="ln_seq"), "norm-dimension", "error", "blocks.0.ln_1.ln"),
        (dict(norm="ln_2d"), "norm-dimension", "error", "blocks.0.ln_1"),
        (dict(norm="ln_wrong"), "norm-dimension", "error", "blocks.0.ln_1"),
        (dict(norm="bn"), "norm-dimension", "error", "blocks.0.ln_1.bn"),
        (dict(norm="naive"), "low-precision-stats", "warning", "blocks.0.ln_1"),
        (dict(placement="post", n_layers=12), "post-norm-deep", "warning", "blocks"),
        (dict(placement="nonorm", n_layers=6, gain=100.0), "residual-growth", "warning", "blocks"),
    ],
)
def test_planted_bug_is_found(kw, code, severity, module):
    findings = run(**kw)
    hits = [f for f in findings if f.code == code]
    assert hits, f"{code} not reported for {kw}: {[(f.code, f.message) for f in findings]}"
    assert hits[0].severity == severity and hits[0].module == module
    assert hits[0].message and hits[0].fix
    # No other error than the planted one (a failed forward is reported next to a wrong normalized_shape).
    assert codes(findings, "error") <= {code, "forward-failed"}


def test_scaled_skip_message_names_the_scale():
    (f,) = [f for f in run(skip="scale", n_layers=1) if f.code == "residual-not-identity"]
    assert "0.25" in f.message  # two sublayers, each 0.5 * x on the skip path


def test_half_precision_stats_are_an_error_in_a_half_model():
    model = TOY["ToyLM"](norm="naive").to(torch.bfloat16)
    findings = diagnose(model, TOY["batch"]())
    assert "low-precision-stats" in codes(findings, "error")


def test_clean_models_have_no_errors_or_warnings():
    for kw in ({}, dict(placement="post"), dict(n_layers=12), dict(placement="post", n_layers=6)):
        findings = run(**kw)
        assert codes(findings, "error") == set() and codes(findings, "warning") == set(), (kw, findings)
    (summary,) = [f for f in run(placement="post") if f.code == "summary"]
    assert "Post-Norm" in summary.message


def test_nonfinite_forward_names_the_module():
    class LogOf(torch.nn.Module):
        def forward(self, x):
            return torch.log(x)  # NaN for the negative entries

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), LogOf(), torch.nn.Linear(4, 2))
    findings = diagnose(model, torch.randn(3, 4))
    (f,) = [f for f in findings if f.code == "non-finite"]
    assert f.severity == "error" and f.module == "1"


def test_diagnose_leaves_the_model_untouched():
    model, batch = TOY["ToyLM"](norm="bn"), TOY["batch"]()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    diagnose(model, batch)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_addnorm_models():
    nn_mod = pytest.importorskip("addnorm.nn")
    if not hasattr(nn_mod, "TransformerLM"):
        pytest.skip("addnorm.nn models not built yet")

    def check(preset="gpt2", **kw):
        cfg = nn_mod.TransformerConfig.preset(preset, **{"d_model": 32, "n_heads": 4, "vocab_size": 64, **kw})
        return diagnose(nn_mod.TransformerLM(cfg), torch.randint(0, 64, (2, 7)))

    for preset in ("gpt2", "llama", "palm", "gemma", "bert"):
        findings = check(preset, n_layers=2)
        assert codes(findings, "error") == set() and codes(findings, "warning") == set(), (preset, findings)
    # DeepNorm is the cure the deep-Post-Norm warning suggests: it must not be warned about.
    assert "post-norm-deep" not in codes(check("deepnet", n_layers=12))
    assert "post-norm-deep" in codes(check("bert", n_layers=12), "warning")
    assert "missing-final-norm" in codes(check("gpt2", n_layers=2, final_norm=False), "error")
    assert "norm-dimension" in codes(check("gpt2", n_layers=2, norm="batchnorm"), "error")
    assert "residual-not-identity" in codes(check("gpt2", n_layers=2, placement="pre-noskip"), "error")


# ---- the CLI ------------------------------------------------------------------------------------------------------
@pytest.fixture
def toy_file(tmp_path):
    path = tmp_path / "toy_model.py"
    path.write_text(TOY_SRC)
    return path


def test_cli_exit_codes_and_json(toy_file, capsys):
    assert cli_main(["doctor", f"{toy_file}:clean"]) == 0
    out = capsys.readouterr().out
    assert "0 error(s)" in out and "Pre-Norm" in out

    assert cli_main(["doctor", f"{toy_file}:scaled_skip", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert list(doc) == ["findings"]
    assert {"code", "severity", "module", "message", "fix"} <= set(doc["findings"][0])
    assert doc["findings"][0]["code"] == "residual-not-identity" and doc["findings"][0]["severity"] == "error"

    assert cli_main(["doctor", f"{toy_file}:scaled_skip"]) == 1
    out = capsys.readouterr().out
    # One finding per block, printed once with every module it applies to.
    assert "ERRORS (3)" in out and "[residual-not-identity] blocks.0, blocks.1, blocks.2\n" in out
    assert out.count("multiplies the skip path") == 1 and "fix:" in out


@pytest.mark.parametrize(
    "target, needle",
    [
        ("{dir}/missing.py:clean", "not found"),
        ("{file}:no_such_factory", "no attribute 'no_such_factory'"),
        ("{file}:raises", "factory is broken"),
        ("{file}:not_a_factory_result", "must return (model, example_batch)"),
        ("{file}", "FILE.py:FACTORY"),
    ],
)
def test_cli_bad_target_exits_2_with_a_message(toy_file, capsys, target, needle):
    code = cli_main(["doctor", target.format(dir=toy_file.parent, file=toy_file)])
    err = capsys.readouterr().err
    assert code == 2
    assert needle in err and "Traceback" not in err


def test_cli_hf_config_tiny_llama(tmp_path, capsys):
    pytest.importorskip("transformers")
    config = {
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert cli_main(["doctor", "--hf-config", str(path), "--json"]) == 0
    findings = json.loads(capsys.readouterr().out)["findings"]
    (summary,) = [f for f in findings if f["code"] == "summary"]
    assert summary["module"] == "model.layers" and "Pre-Norm" in summary["message"]
    assert cli_main(["doctor", "--hf-config", str(tmp_path / "nope.json")]) == 2
    assert "not found" in capsys.readouterr().err


def test_cli_hf_config_encoder_decoder_runs_its_forward(tmp_path, capsys):
    """T5-like models need decoder inputs; without them the doctor reported its own batch as the model's error."""
    pytest.importorskip("transformers")
    config = {
        "model_type": "t5",
        "vocab_size": 64,
        "d_model": 32,
        "d_kv": 8,
        "d_ff": 64,
        "num_layers": 2,
        "num_heads": 4,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code = cli_main(["doctor", "--hf-config", str(path), "--json"])
    findings = json.loads(capsys.readouterr().out)["findings"]
    assert not [f for f in findings if f["code"] == "forward-failed"], findings
    assert code == (1 if any(f["severity"] == "error" for f in findings) else 0)


def test_monitor_on_hf_llama():
    transformers = pytest.importorskip("transformers")
    from addnorm.diagnostics import Monitor

    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, 64, (2, 7))
    with Monitor(model) as mon:
        out = model(input_ids=ids, output_hidden_states=True)
        out.logits.float().pow(2).mean().backward()
        rec = mon.step()
    assert [e["name"] for e in rec["layers"]] == ["model.layers.0", "model.layers.1"]
    # hidden_states[1] is the stream after layer 0 (the last entry has the final norm applied).
    after_first = out.hidden_states[1].detach().double()
    assert rec["layers"][0]["residual_rms"] == pytest.approx(float(after_first.pow(2).mean().sqrt()), rel=1e-5)
    assert all(e["norm_input_rms"] > 0 for e in rec["layers"])
    expected = float(torch.logsumexp(out.logits.detach().double(), -1).mean())
    assert rec["output_logz"] == pytest.approx(expected, rel=1e-5)


# ---- hostile targets: the doctor runs user code, which may exit, print, hang or be interrupted --------------------
HOSTILE_SRC = textwrap.dedent("""
    import sys
    import time

    from toy_model import ToyLM, batch


    class ExitingLM(ToyLM):
        def forward(self, idx):
            sys.exit(0)


    class ChattyLM(ToyLM):
        def forward(self, idx):
            print("forward says hello")
            return super().forward(idx)


    class FdChattyLM(ToyLM):
        def forward(self, idx):
            import os

            os.write(1, b"written straight to file descriptor 1\\n")  # what a C extension's printf does
            return super().forward(idx)


    class BrokenLM(ToyLM):
        def forward(self, idx):
            idx = idx.view(idx.shape[0], 5, -1)  # a bug: the view fails (T is 7)
            return super().forward(idx)


    def fd_chatty():
        return FdChattyLM(), batch()


    def broken_forward():
        return BrokenLM(), batch()


    def exits0():
        sys.exit(0)


    def exits3():
        sys.exit(3)


    def forward_exits():
        return ExitingLM(), batch()


    def chatty():
        for i in range(2000):
            print("loading shard", i)
        return ChattyLM(), batch()


    def sleeper():
        time.sleep(60)


    def interrupted():
        raise KeyboardInterrupt


    def helper_that_fails():
        return {}["missing key"]


    def deep_failure():
        return helper_that_fails()
""")


@pytest.fixture
def hostile_file(toy_file):
    path = toy_file.parent / "hostile.py"
    path.write_text(HOSTILE_SRC)
    return path


@pytest.mark.parametrize(
    "factory, exit_text", [("exits0", "sys.exit(0)"), ("exits3", "sys.exit(3)"), ("forward_exits", "sys.exit(0)")]
)
def test_cli_target_that_exits_is_a_load_failure(hostile_file, capsys, factory, exit_text):
    """sys.exit(0) in a factory used to end the doctor silently with status 0, the same as a clean pass."""
    code = cli_main(["doctor", f"{hostile_file}:{factory}", "--json"])
    out, err = capsys.readouterr()
    assert code == 2
    assert exit_text in err and "cannot be checked" in err and "Traceback" not in err
    assert json.loads(out)["status"] == "error" and exit_text in json.loads(out)["error"]  # --json: stays JSON


def test_cli_target_that_exits_on_import(tmp_path, capsys):
    path = tmp_path / "exits_on_import.py"
    path.write_text("import sys\nsys.exit(0)\n")
    assert cli_main(["doctor", f"{path}:make"]) == 2
    assert "importing" in capsys.readouterr().err


def test_cli_json_stays_json_when_the_target_prints(hostile_file, capsys):
    code = cli_main(["doctor", f"{hostile_file}:chatty", "--json"])
    out, err = capsys.readouterr()
    assert code == 0
    assert "summary" in {f["code"] for f in json.loads(out)["findings"]}  # stdout holds only the report
    assert "loading shard 1999" in err and "forward says hello" in err  # the target's output is kept, on stderr


def test_cli_timeout(hostile_file, capsys):
    import time

    t0 = time.monotonic()
    code = cli_main(["doctor", f"{hostile_file}:sleeper", "--timeout", "0.5"])
    elapsed = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == 2 and elapsed < 30
    assert "did not finish" in err and "--timeout 0.5 s" in err and "Traceback" not in err


@pytest.mark.parametrize("value", ["-1", "soon", "inf", "nan"])
def test_cli_timeout_rejects_bad_values(toy_file, capsys, value):
    with pytest.raises(SystemExit) as e:
        cli_main(["doctor", f"{toy_file}:clean", "--timeout", value])
    assert e.value.code == 2 and "--timeout" in capsys.readouterr().err


def test_cli_ctrl_c_exits_130_with_a_message(hostile_file, capsys):
    code = cli_main(["doctor", f"{hostile_file}:interrupted"])
    err = capsys.readouterr().err
    assert code == 130 and "interrupted" in err and "Traceback" not in err


def test_cli_traceback_shows_where_the_factory_failed(hostile_file, capsys):
    assert cli_main(["doctor", f"{hostile_file}:deep_failure"]) == 2
    err = capsys.readouterr().err
    assert "KeyError" in err and "Traceback" not in err and "--traceback shows where" in err
    assert cli_main(["doctor", f"{hostile_file}:deep_failure", "--traceback"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and str(hostile_file) in err and "in helper_that_fails" in err
    assert "--traceback shows where" not in err


def test_cli_hf_config_unknown_model_type_names_close_matches(tmp_path, capsys):
    """transformers' own error lists every model type it knows (about 10 KB)."""
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "lama", "vocab_size": 64}))
    assert cli_main(["doctor", "--hf-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "'lama'" in err and "did you mean 'llama'" in err and len(err) < 600
    path.write_text(json.dumps({"model_type": "zzqqxx", "vocab_size": 64}))
    assert cli_main(["doctor", "--hf-config", str(tmp_path)]) == 2  # the folder form too
    err = capsys.readouterr().err
    assert "'zzqqxx'" in err and "no model type of transformers" in err and len(err) < 600


def test_summary_names_what_the_blocks_do_not_a_misleading_class():
    """addnorm's decoder-only stacks are built from EncoderLayer(causal=True): the summary said "EncoderLayer"."""
    from addnorm.nn import TransformerConfig, TransformerEncoder, TransformerLM

    kw = {"n_layers": 2, "d_model": 32, "n_heads": 4, "vocab_size": 64}
    ids = torch.randint(0, 64, (2, 7))
    (lm,) = [
        f.message for f in diagnose(TransformerLM(TransformerConfig.preset("llama", **kw)), ids) if f.code == "summary"
    ]
    assert "causal (decoder-only)" in lm and "Encoder" not in lm
    (enc,) = [
        f.message
        for f in diagnose(TransformerEncoder(TransformerConfig.preset("bert", **kw)), ids)
        if f.code == "summary"
    ]
    assert "bidirectional (encoder)" in enc


def test_cli_real_ctrl_c_exits_130(tmp_path):
    """A real SIGINT while the target runs (not a KeyboardInterrupt raised by the target itself)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    marker = tmp_path / "started"
    target = tmp_path / "slow.py"
    target.write_text(
        f"import pathlib, time\ndef make():\n    pathlib.Path({str(marker)!r}).touch()\n    time.sleep(120)\n"
    )
    src = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "addnorm", "doctor", f"{target}:make"],
        env=env,
        # as a terminal's foreground process gets it: a test run started in the background by a shell without job
        # control inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler in the child
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert marker.exists(), proc.communicate(timeout=10)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    assert out == ""


def test_cli_json_stays_json_when_the_target_writes_to_fd_1(hostile_file, capfd):
    code = cli_main(["doctor", f"{hostile_file}:fd_chatty", "--json"])
    out, err = capfd.readouterr()
    assert code == 0
    json.loads(out)
    assert "written straight to file descriptor 1" in err and "written straight" not in out


def test_forward_failure_names_the_line_in_the_users_code(hostile_file, capsys):
    assert cli_main(["doctor", f"{hostile_file}:broken_forward", "--json"]) == 1
    (failed,) = [f for f in json.loads(capsys.readouterr().out)["findings"] if f["code"] == "forward-failed"]
    line = (
        HOSTILE_SRC.splitlines().index("        idx = idx.view(idx.shape[0], 5, -1)  # a bug: the view fails (T is 7)")
        + 1
    )
    assert f"(at {hostile_file}:{line} in forward)" in failed["message"], failed["message"]
