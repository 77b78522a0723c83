"""addnorm survey: the dataflow tracer on hand-written layers (every placement), the norm probe and the layer
matcher, and a dozen transformers families pinned to what their modeling files do (tiny configs, nothing
downloaded). Each pinned expectation quotes the lines of the installed transformers' modeling file it comes from."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from torch import nn

from addnorm.integrations.hf import layer_match, norm_probe


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---- the tracer on hand-written layers ------------------------------------------------------------------------------
class _Layer(nn.Module):
    """One layer of a given placement: two sublayers (attention f, MLP-like g), norms where the placement puts them."""

    def __init__(self, kind: str, d: int = 16):
        super().__init__()
        self.kind = kind
        self.f, self.g = nn.Linear(d, d), nn.Linear(d, d)
        self.n1, self.n2, self.n3, self.n4 = (nn.LayerNorm(d) for _ in range(4))

    def _attention(self, h):  # (B, T, d): single-head self-attention, the "attention" branch
        q = self.f(h)
        return torch.softmax(q @ h.transpose(-1, -2), dim=-1) @ h

    def forward(self, x):
        f, g, n1, n2, n3, n4 = self._attention, self.g, self.n1, self.n2, self.n3, self.n4
        if self.kind == "pre":
            x = x + f(n1(x))
            return x + g(n2(x))
        if self.kind == "post":
            x = n1(x + f(x))
            return n2(x + g(x))
        if self.kind == "sandwich":
            x = x + n2(f(n1(x)))
            return x + n4(g(n3(x)))
        if self.kind == "branch-output":
            x = x + n1(f(x))
            return x + n2(g(x))
        if self.kind == "parallel":  # GPT-J: one norm, both branches read it, one add
            h = n1(x)
            return f(h) + g(h) + x
        if self.kind == "pre-moe":  # a pre-norm MLP that sums two experts: one branch, not parallel
            x = x + f(n1(x))
            h = n2(x)
            return x + (g(h) + self.f(h))
        if self.kind == "parallel-two-adds":  # Cohere: residual + attn + mlp, left to right
            h = n1(x)
            return x + f(h) + g(h)
        if self.kind == "pre-then-post":  # attention pre-norm, MLP post-norm: a layer that is mixed inside
            x = x + f(n1(x))
            return n2(x + g(x))
        if self.kind == "deepnorm":  # Wang et al. 2022: N(alpha x + F(x))
            x = n1(x * 2.5 + f(x))
            return n2(x * 2.5 + g(x))
        if self.kind == "scaled-branch":
            x = x + f(n1(x)) * 0.25
            return x + g(n2(x)) * 0.25
        if self.kind == "pre-via-lists":  # branches that end in stack / cat (a reference selective scan): still pre
            x = x + torch.stack([t.squeeze(-1) for t in f(n1(x)).split(1, dim=-1)], dim=-1)
            h = n2(x)
            return x + torch.cat([g(h)[..., :5], g(h)[..., 5:]], dim=-1)
        if self.kind == "lost":  # the branch leaves PyTorch's dispatcher (through numpy): its origin is unknown
            x = x + torch.from_numpy(f(n1(x)).numpy().copy())
            return x + g(n2(x))
        if self.kind == "none":
            x = x + f(x)
            return x + g(x)
        raise AssertionError(self.kind)


class _Model(nn.Module):
    def __init__(self, kinds, final=True):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(k) for k in kinds)
        self.norm = nn.LayerNorm(16) if final else None

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x) if self.norm is not None else x


def _analyse(model):
    from addnorm.integrations.survey import analyse

    return analyse(model, {"x": torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))})


@pytest.mark.parametrize(
    "kind, label, sublayers",
    [
        ("pre", "pre", ["pre", "pre"]),
        ("post", "post", ["post", "post"]),
        ("sandwich", "sandwich", ["sandwich", "sandwich"]),
        ("branch-output", "branch-output", ["branch-output", "branch-output"]),
        ("parallel", "parallel", ["parallel"]),
        ("parallel-two-adds", "parallel", ["pre", "parallel"]),
        ("pre-moe", "pre", ["pre", "pre"]),
        ("pre-via-lists", "pre", ["pre", "pre"]),
        ("lost", "unknown", ["unknown", "pre"]),
        ("pre-then-post", "mixed", ["pre", "post"]),
        ("deepnorm", "post", ["post", "post"]),
        ("none", "none", ["none", "none"]),
    ],
)
def test_tracer_labels_each_placement(kind, label, sublayers):
    row = _analyse(_Model([kind, kind]))
    assert row["placement"] == label
    assert row["sublayers"] == sublayers
    assert row["layers"] == 2 and row["stack"] == "layers"


def test_tracer_layers_that_differ_are_mixed():
    row = _analyse(_Model(["post", "pre", "pre"]))  # Mix-LN: post-norm early layers, pre-norm later ones
    assert row["placement"] == "mixed"
    assert row["stacks"][0]["placement"] == "mixed"


def test_tracer_residual_scales_and_final_norm():
    row = _analyse(_Model(["deepnorm", "deepnorm"], final=False))
    assert row["residual_scale"] == "skip*2.5"
    assert row["final_norm"] is False
    row = _analyse(_Model(["scaled-branch", "scaled-branch"]))
    assert row["residual_scale"] == "branch*0.25"
    assert row["final_norm"] is True
    assert row["norm"] == "layernorm" and row["eps"] == 1e-5 and row["bias"] is True


def test_tracer_ignores_names():
    """The same layer with misleading attribute names is labelled the same: placement comes from the dataflow."""
    model = _Model(["pre", "pre"])
    for layer in model.layers:
        layer.post_attention_layernorm = layer.n1  # an alias named like a post-norm
    assert _analyse(model)["placement"] == "pre"


# ---- the norm probe ---------------------------------------------------------------------------------------------
class _Rms(nn.Module):
    """An RMSNorm whose eps is a literal (no attribute): the probe must read it off the output."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 3e-6)).to(x.dtype)


class _NotANorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x / x.abs().amax(-1, keepdim=True) * self.weight


def test_norm_probe_reads_what_a_module_computes():
    ln = norm_probe.probe(nn.LayerNorm(24, eps=1e-6))
    assert (ln.kind, ln.eps, ln.bias, ln.zero_centered_weight, ln.addnorm) == (
        "layernorm",
        1e-6,
        True,
        False,
        "layernorm",
    )
    rms = norm_probe.probe(_Rms(24))
    assert (rms.kind, rms.eps, rms.bias, rms.addnorm) == ("rmsnorm", 3e-6, False, "rmsnorm-cast-before-weight")
    assert norm_probe.probe(_NotANorm(24)) is None
    assert norm_probe.probe(nn.Linear(4, 4)) is None
    plain = norm_probe.probe(nn.RMSNorm(24, eps=1e-5))  # torch's: weight applied in fp32, one rounding
    assert (plain.kind, plain.addnorm) == ("rmsnorm", "rmsnorm")


def test_norm_probe_on_transformers_norms():
    pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo.modeling_olmo import OlmoLayerNorm

    gemma = norm_probe.probe(GemmaRMSNorm(32, eps=1e-6))
    assert (gemma.kind, gemma.zero_centered_weight, gemma.addnorm) == ("rmsnorm", True, "rmsnorm-zero-centered")
    llama = norm_probe.probe(LlamaRMSNorm(32, eps=2e-5))
    assert (llama.eps, llama.addnorm) == (2e-5, "rmsnorm-cast-before-weight")
    # OLMo's norm has no parameters and its eps is a literal 1e-5 in forward: measured from the output
    olmo = norm_probe.probe(OlmoLayerNorm(32))
    assert (olmo.kind, olmo.eps, olmo.weight, olmo.bias, olmo.addnorm) == ("layernorm", 1e-5, False, False, "layernorm")


# ---- the layer matcher -------------------------------------------------------------------------------------------
def test_layer_match_recognises_structure_not_names():
    pytest.importorskip("transformers")
    from transformers.models.cohere.modeling_cohere import CohereDecoderLayer
    from transformers.models.granite.modeling_granite import GraniteDecoderLayer
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    m = layer_match.match(LlamaDecoderLayer)
    assert m.template == "pre"
    assert m.roles == {
        "norm1": "input_layernorm",
        "attn": "self_attn",
        "norm2": "post_attention_layernorm",
        "mlp": "mlp",
    }
    g = layer_match.match(GraniteDecoderLayer)  # residual + hidden_states * self.residual_multiplier
    assert g.template == "pre-scaled" and g.roles["scale"] == "residual_multiplier"
    assert layer_match.match(CohereDecoderLayer) is None  # parallel: residual + attention + mlp

    # Llama's layer with other attribute and local names: still "pre", roles found by position
    src = (
        "import torch.nn as nn\n"
        "class Renamed(nn.Module):\n"
        "    def forward(self, hidden_states, attention_mask=None, use_cache=False, **kw):\n"
        "        r = hidden_states\n"
        "        hidden_states = self.ln_a(hidden_states)\n"
        "        hidden_states, w = self.mixer(hidden_states=hidden_states, use_cache=use_cache,\n"
        "                                      attention_mask=attention_mask, **kw)\n"
        "        hidden_states = r + hidden_states\n"
        "        r = hidden_states\n"
        "        hidden_states = self.ffn(self.ln_b(hidden_states))\n"
        "        hidden_states = r + hidden_states\n"
        "        return hidden_states\n"
    )
    assert _compile(src) is None  # ffn(ln_b(h)) in one line is another statement structure: no match (strict)
    src = src.replace(
        "        hidden_states = self.ffn(self.ln_b(hidden_states))\n",
        "        hidden_states = self.ln_b(hidden_states)\n        hidden_states = self.ffn(hidden_states)\n",
    )
    m = _compile(src)
    assert m is not None and m.template == "pre"
    assert m.roles == {"norm1": "ln_a", "attn": "mixer", "norm2": "ln_b", "mlp": "ffn"}
    # not every parameter passed on to the attention: the fused forward (which passes all) would differ
    assert _compile(src.replace("use_cache=use_cache,", "")) is None


def _compile(src: str):
    import linecache

    name = f"<layer_match_test_{abs(hash(src))}>"
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)  # inspect.getsource reads it from here
    ns: dict = {}
    exec(compile(src, name, "exec"), ns)
    return layer_match.match(ns["Renamed"])


# ---- transformers families pinned to their modeling files ---------------------------------------------------------
# Each row: model_type, config overrides, what the survey must find, and the modeling-file lines behind it.
PINNED = [
    (
        "llama",
        {},
        dict(
            norm="rmsnorm",
            placement="pre",
            eps=1e-6,
            zero_centered_weight=False,
            bias=False,
            final_norm=True,
            qk_norm=False,
            residual_scale=None,
            role="decoder",
            hf_apply="fused",
            hf_ops=["add_norm"],
        ),
    ),
    # residual = hidden_states; hidden_states = self.input_layernorm(...); ...; hidden_states = residual + hidden_states
    ("llama", {"rms_norm_eps": 3e-5}, dict(eps=3e-5)),
    (
        "bert",
        {},
        dict(
            norm="layernorm", placement="post", eps=1e-12, bias=True, final_norm=False, role="encoder", hf_apply="fused"
        ),
    ),
    # BertSelfOutput/BertOutput: hidden_states = self.LayerNorm(hidden_states + input_tensor)
    ("gpt2", {}, dict(norm="layernorm", placement="pre", eps=1e-5, bias=True, final_norm=True, hf_apply="fused")),
    # hidden_states = self.ln_1(hidden_states) ... hidden_states = attn_output + residual; self.ln_f after the blocks
    (
        "gemma2",
        {},
        dict(
            norm="rmsnorm",
            placement="sandwich",
            zero_centered_weight=True,
            final_norm=True,
            hf_apply="fused",
            hf_ops=["norm_add_norm"],
        ),
    ),
    # post_attention_layernorm on the attention output before "residual + hidden_states"; (1.0 + self.weight.float());
    # each post-norm, its add and the next norm (pre_feedforward_layernorm, the next input_layernorm) one call
    (
        "olmo2",
        {},
        dict(
            norm="rmsnorm",
            placement="branch-output",
            qk_norm=True,
            final_norm=True,
            hf_apply="fused",
            hf_ops=["norm_add", "norm_add_norm"],
        ),
    ),
    # hidden_states = self.post_attention_layernorm(self_attn(...)); residual + hidden_states; q_norm/k_norm
    # (fused by hf/rewrite.py as addnorm.norm_add calls; the last layer's last add chained with the final norm)
    ("olmo", {}, dict(norm="layernorm", placement="pre", eps=1e-5, bias=False, hf_apply="fused")),
    # OlmoLayerNorm: F.layer_norm(..., None, None, eps=1e-5): no weight, no bias, eps a literal
    ("cohere", {}, dict(norm="layernorm", placement="parallel", bias=False, hf_apply="fused")),
    # hidden_states = residual + hidden_states_attention + hidden_states_mlp (both read input_layernorm); the sum
    # fused with the next layer's input_layernorm (hf/handoff.py)
    ("gptj", {}, dict(norm="layernorm", placement="parallel", bias=True)),
    # hidden_states = attn_output + feed_forward_hidden_states + residual
    (
        "gpt_neox",
        {"use_parallel_residual": True},
        dict(placement="parallel", hf_apply="fused", hf_fused_not_run=None),
    ),
    ("gpt_neox", {"use_parallel_residual": False}, dict(placement="pre", hf_apply="fused")),
    # if self.use_parallel_residual: mlp_output + attn_output + hidden_states, else attn_output + hidden_states ...
    ("granite", {"residual_multiplier": 0.25}, dict(placement="pre", residual_scale="branch*0.25", hf_apply="fused")),
    # hidden_states = residual + hidden_states * self.residual_multiplier
    ("qwen3", {}, dict(norm="rmsnorm", placement="pre", qk_norm=True, hf_apply="fused")),
    # query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape))
    ("t5", {}, dict(norm="rmsnorm", placement="pre", eps=1e-6, bias=False, role="encoder-decoder", final_norm=True)),
    # T5LayerFF: forwarded_states = self.layer_norm(hidden_states); hidden_states + self.dropout(forwarded)
    ("mixtral", {}, dict(norm="rmsnorm", placement="pre", hf_apply="fused")),
    ("opt", {}, dict(norm="layernorm", placement="pre", bias=True, hf_apply="fused")),
    ("opt", {"do_layer_norm_before": False}, dict(norm="layernorm", hf_apply="fused")),  # OPT-350m's post-norm
    # residual + hidden_states; if not self.do_layer_norm_before: norm; reshape(-1, size(-1)); residual = ...; norm
    ("nemotron", {}, dict(norm="layernorm", zero_centered_weight=True, bias=True, hf_apply="fused")),
    # NemotronLayerNorm1P: F.layer_norm(x, ..., self.weight + 1.0, self.bias, eps)
    ("phi", {}, dict(norm="layernorm", placement="parallel", bias=True, hf_apply="fused")),
    # hidden_states = attn_outputs + feed_forward_hidden_states + residual
    ("modernbert", {}, dict(norm="layernorm", placement="mixed", sublayers=["none", "pre"], final_norm=True)),
    # ModernBertEncoderLayer: self.attn_norm = nn.Identity() if layer_id == 0 else nn.LayerNorm(...): the first
    # layer's attention reads the (embedding-normalized) stream without a norm of its own
    ("llava", {}, dict(role="decoder", norm="rmsnorm", placement="pre", hf_apply="fused")),
    # a vision-language model: on text alone only the language model (Llama) runs; its layers are what is fused
    ("bloom", {}, dict(norm="layernorm", placement="pre", hf_apply="fused")),
    # BloomAttention: output_tensor = dropout_add(output_tensor, residual, ...); the block reads its return value
    # (hf/helper_rewrite.py rewrites dropout_add, hf/links.py links the attention to post_attention_layernorm)
    ("gpt_neox_japanese", {}, dict(norm="layernorm", placement="pre", hf_apply="fused")),
    # attn_output = bias_dropout_add(attn_output, bias=..., residual=residual, ...); self.post_attention_layernorm(.)
    (
        "inkling2_text",
        {},
        dict(
            hf_apply="norms",
            hf_apply_reason="Inkling2SlidingDecoderLayer: the adds are inside calls (self.post_mlp_convolution(...) "
            "-> self.post_attention_layernorm; self.post_mlp_convolution(...) -> self.input_layernorm)",
        ),
    ),
    # a family left unfused: its reason, read from the layer's forward by hf/unfused.py
]


@pytest.mark.parametrize(
    "model_type, overrides, expected",
    PINNED,
    ids=[f"{t}-{'-'.join(map(str, o.values())) or 'default'}" for t, o, _ in PINNED],
)
def test_pinned_families(model_type, overrides, expected):
    pytest.importorskip("transformers")
    from addnorm.integrations.survey import _hf_apply, analyse, build

    built = build(model_type, **overrides)
    row = {"role": built.role, **analyse(built.model, built.batch)}
    if "hf_apply" in expected:
        row.update(_hf_apply(built.model, built.batch))
        assert row["hf_apply_rel_err"] <= 1e-5
    got = {k: row.get(k) for k in expected}
    assert got == expected


# ---- survey() and the CLI ----------------------------------------------------------------------------------------
def test_survey_rows_and_skips():
    pytest.importorskip("transformers")
    from addnorm.integrations.survey import survey

    result = survey(["llama", "wav2vec2"], doctor=True)
    rows = {r["model_type"]: r for r in result["models"]}
    assert set(rows) == {"llama", "wav2vec2"}
    assert rows["llama"]["status"] == "ok" and rows["llama"]["doctor"] == []
    assert rows["wav2vec2"]["status"] == "skipped" and "input_values" in rows["wav2vec2"]["reason"]
    with pytest.raises(ValueError, match="only: unknown model type"):
        survey(["no-such-model"])


def test_cli_json_and_files(tmp_path, capsys):
    pytest.importorskip("transformers")
    from addnorm.cli import main

    assert main(["survey", "--only", "llama", "olmo2", "--json", "--no-progress", "--no-doctor"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["model_type"] for r in result["models"]] == ["llama", "olmo2"]
    assert result["transformers"]
    out = tmp_path / "s"
    docs = tmp_path / "docs" / "survey.md"
    assert main(["survey", "--only", "gpt2", "--out", str(out), "--docs", str(docs), "--no-progress"]) == 0
    for name in ("survey.json", "survey.md", "index.html"):
        mode = stat.S_IMODE(os.stat(out / name).st_mode)
        assert mode == 0o666 & ~_umask()
    page = (out / "index.html").read_text()
    assert "<table" in page and "gpt2" in page and "http" not in page.split("<body>")[1].split("addnorm survey")[0]
    assert "| gpt2 | decoder | layernorm | pre |" in docs.read_text()
    from addnorm.integrations.survey import report

    rows = report.load(docs.with_suffix(".json"))["models"]  # the rows next to the page, for the per-family tests
    assert [r["model_type"] for r in rows] == ["gpt2"] and rows[0]["hf_apply"] == "fused"


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_cli_bad_input(capsys):
    pytest.importorskip("transformers")
    from addnorm.cli import main

    assert main(["survey", "--only", "no-such-model", "--no-progress"]) == 2
    assert "--only: unknown model type(s) no-such-model" in capsys.readouterr().err
    assert main(["survey", "--time-limit", "-1"]) == 2
    assert "--time-limit must be >= 0" in capsys.readouterr().err
    assert main(["survey", "--list"]) == 0
    assert "llama" in capsys.readouterr().out.split()


def _rows_result():
    rows = [
        {
            "model_type": "a",
            "status": "ok",
            "role": "decoder",
            "norm": "rmsnorm",
            "placement": "pre",
            "hf_apply": "fused",
            "hf_fused_layers": ["ALayer"],
            "doctor": [],
        },
        {
            "model_type": "b",
            "status": "ok",
            "role": "decoder",
            "norm": "rmsnorm",
            "placement": "pre",
            "hf_apply": "fused",
            "hf_fused_layers": ["BLayer"],
            "doctor": [],
        },
        {
            "model_type": "c",
            "status": "ok",
            "role": "encoder",
            "norm": "layernorm",
            "placement": "post",
            "hf_apply": "norms",
            "doctor": [],
        },
        {"model_type": "d", "status": "skipped", "reason": "needs input_values"},
    ]
    return {"transformers": "9.9", "torch": "2.x", "seconds": 125.0, "models": rows}


def test_report_json_round_trip_and_readme_blocks(tmp_path):
    from addnorm.integrations.survey import report

    result = _rows_result()
    text = report.dumps(result)
    assert text.count("\n") == len(result["models"]) + 2  # one row per line: a regenerated survey diffs by row
    path = tmp_path / "survey.json"
    path.write_text(text)
    assert report.load(path) == result
    for bad in ("{", '{"models": []}', '{"transformers": "1", "models": [{"status": "ok"}]}'):
        path.write_text(bad)
        with pytest.raises(ValueError, match="survey.json"):
            report.load(path)
    readme = (
        "# x\n<!-- survey:hf-fused -->\nold list\n<!-- /survey:hf-fused -->\nmiddle\n"
        "<!-- survey:summary -->\n<!-- /survey:summary -->\nend\n"
    )
    new = report.update_readme(readme, result)
    fused = " ".join(new.split("<!-- survey:hf-fused -->\n")[1].split("<!-- /survey:hf-fused -->")[0].split())
    assert "old list" not in new and "fuses the residual add and norm in 2 architectures" in fused
    assert "`a`, `b`." in fused and "`c`" not in fused and "norms in 1 more" in fused
    summary = " ".join(new.split("<!-- survey:summary -->\n")[1].split("<!-- /survey:summary -->")[0].split())
    assert "3 of 4 architectures analysed in about 2 minutes" in summary
    assert summary.endswith("placement pre 2; fused by `hf.apply`: pre 2 of 2.")  # every decoder placement, counted
    assert new.startswith("# x\n") and "\nmiddle\n" in new and new.endswith("end\n")
    assert report.update_readme(new, result) == new  # rewriting is idempotent
    # a fused encoder is counted, not named (the README names the decoder LMs; docs/survey.md lists every one)
    encoder = {"model_type": "e", "status": "ok", "role": "encoder", "hf_apply": "fused", "doctor": []}
    with_encoder = " ".join(report.update_readme(readme, {**result, "models": [*result["models"], encoder]}).split())
    assert "in 3 architectures (2 decoder LMs, 1 encoders" in with_encoder and "`e`" not in with_encoder
    with pytest.raises(ValueError, match="no '<!-- survey:summary -->'"):
        report.update_readme(readme.split("middle")[0], result)


def test_cli_from_saved_rows(tmp_path, capsys):
    from addnorm.cli import main
    from addnorm.integrations.survey import report

    saved = tmp_path / "survey.json"
    saved.write_text(report.dumps(_rows_result()))
    readme = tmp_path / "README.md"
    readme.write_text(
        "<!-- survey:hf-fused -->\n<!-- /survey:hf-fused -->\n<!-- survey:summary -->\n<!-- /survey:summary -->\n"
    )
    docs = tmp_path / "docs" / "s.md"
    assert main(["survey", "--from", str(saved), "--readme", str(readme), "--docs", str(docs), "--no-progress"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert "`a`, `b`." in readme.read_text() and "| c | encoder | layernorm | post |" in docs.read_text()
    assert report.load(docs.with_suffix(".json")) == _rows_result()
    # bad input: a clear message and exit status 2, no traceback
    cases = [
        (["--from", str(tmp_path / "missing.json")], "--from: "),
        (["--from", str(saved), "--only", "llama"], "--from and --only cannot be combined"),
        (["--from", str(saved), "--readme", str(saved)], "--readme " + str(saved) + ": no '<!-- survey:"),
    ]
    for args, message in cases:
        assert main(["survey", *args, "--no-progress"]) == 2
        assert message in capsys.readouterr().err


def test_tiny_inputs_follow_the_config():
    pytest.importorskip("transformers")
    from addnorm.integrations import tiny

    t5 = tiny.inputs(tiny.tiny_config("t5"), seed=3, batch_size=1, seq_len=5)
    assert t5["input_ids"].shape == (1, 5) and torch.equal(t5["decoder_input_ids"], t5["input_ids"])
    assert torch.equal(
        tiny.inputs(tiny.tiny_config("t5"), seed=3, batch_size=1, seq_len=5)["input_ids"], t5["input_ids"]
    )
    vit = tiny.inputs(tiny.tiny_config("vit"), "pixel_values", batch_size=2)
    assert vit["pixel_values"].shape == (2, 3, 32, 32)
    with pytest.raises(tiny.SkipModel, match="needs input_values"):
        tiny.inputs(tiny.tiny_config("wav2vec2"), "input_values")


def test_doctor_counts_a_norm_module_run_before_and_after_the_blocks_as_final():
    """NanoChat calls one self.norm before the layers and again after them; the doctor used to see only the first
    call and report a missing final norm (a false positive found by the survey)."""
    from addnorm.diagnostics.doctor import diagnose

    class Pre(nn.Module):  # x + g(N(x)): zero weights make it the identity, as the doctor's skip check expects
        def __init__(self):
            super().__init__()
            self.n, self.g = nn.LayerNorm(16), nn.Linear(16, 16)

        def forward(self, x):
            return x + self.g(self.n(x))

    class Shared(nn.Module):
        def __init__(self, final: bool):
            super().__init__()
            self.layers = nn.ModuleList(Pre() for _ in range(2))
            self.norm = nn.LayerNorm(16)
            self.final = final

        def forward(self, x):
            x = self.norm(x)
            for layer in self.layers:
                x = layer(x)
            return self.norm(x) if self.final else x

    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
    codes = lambda final: {f.code for f in diagnose(Shared(final), x)}  # noqa: E731
    assert "missing-final-norm" not in codes(True)
    assert "missing-final-norm" in codes(False)  # the check still fires when the second call is gone


def test_report_summary_counts_and_page():
    from addnorm.integrations.survey import report

    rows = [
        {
            "model_type": "a",
            "status": "ok",
            "role": "decoder",
            "norm": "rmsnorm",
            "placement": "pre",
            "hf_apply": "fused",
            "hf_fused_layers": ["ALayer"],
            "hf_ops": ["add_norm", "norm_add_norm"],
            "doctor": [{"code": "residual-growth", "severity": "warning", "module": "layers"}],
        },
        {
            "model_type": "b",
            "status": "ok",
            "role": "encoder",
            "norm": "layernorm",
            "placement": "post",
            "hf_apply": "norms",
            "doctor": [],
        },
        {"model_type": "c<script>", "status": "skipped", "reason": "needs pixel_values (not text)"},
        {
            "model_type": "e",
            "status": "ok",
            "role": "encoder",
            "hf_apply": "norms",
            "doctor_error": "_Timeout: over the survey's limit of 20 CPU seconds per architecture",
        },
        {"model_type": "f", "status": "ok", "role": "encoder", "hf_apply": "norms", "doctor_error": "KeyError: 'x'"},
    ]
    result = {"transformers": "9.9", "models": rows}
    s = report.summary(result)
    assert (s["architectures"], s["analysed"], s["skipped"], s["decoder_lms"]) == (5, 4, 1, 1)
    assert s["doctor_crashes"] == ["f"] and s["doctor_timeouts"] == ["e"]  # a timeout is not reported as a crash
    assert s["decoder_placement"] == {"pre": 1} and s["all_norm"] == {"rmsnorm": 1, "layernorm": 1, "None": 2}
    assert s["fused_families"] == ["a"] and s["doctor_findings"] == {"residual-growth": 1}
    assert s["hf_ops"] == {"add_norm": 1, "norm_add_norm": 1, "none": 3}  # a row without hf_ops calls none
    assert s["decoder_fused_by_placement"] == {"pre": "1 of 1"}
    page = report.page(result)
    assert "c&lt;script&gt;" in page and "<script>document" not in page.split("<table")[1].split("</table>")[0]
    md = report.markdown(result)
    assert "| a | decoder | rmsnorm | pre |" in md and "fused (ALayer)" in md and "`c<script>`: needs" in md
    assert "| fused (ALayer) | add_norm, norm_add_norm |" in md and "| norms | none |" in md
    assert "| decoder LMs fused by hf.apply, per placement | pre 1 of 1 |" in md
    assert "| timed out | ok |" in md and "| crashed | ok |" in md and "ran past the time limit on: e." in md


def test_norm_probe_tells_instances_of_one_class_apart():
    """ConvNeXt's LayerNorm is one class for two computations (channels_last, channels_first); a probe result cached
    per class made hf.apply swap a channels-first norm for a last-dim one (found by the survey)."""
    pytest.importorskip("transformers")
    from transformers.models.convnext.modeling_convnext import ConvNextLayerNorm

    assert norm_probe.probe(ConvNextLayerNorm(8, data_format="channels_last")).addnorm == "layernorm"
    assert norm_probe.probe(ConvNextLayerNorm(8, data_format="channels_first")) is None


def test_doctor_batchnorm_in_a_cnn_is_not_a_sequence_model_mistake():
    """The survey ran the doctor on every vision model: BatchNorm2d on (N, C, H, W) images was reported as a
    norm over the batch axis of a sequence model (a false positive); a BatchNorm1d on a (B, T, C) stream still is."""
    from addnorm.diagnostics.doctor import diagnose

    cnn = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8))
    images = torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(0))
    assert "norm-dimension" not in {f.code for f in diagnose(cnn, images)}

    class SeqBN(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.bn = nn.Linear(16, 16), nn.BatchNorm1d(16)

        def forward(self, x):  # (B, T, C) -> BatchNorm1d over (B, C, T): statistics across the batch
            return self.bn(self.proj(x).transpose(1, 2)).transpose(1, 2)

    seq = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
    assert "norm-dimension" in {f.code for f in diagnose(SeqBN(), seq)}


def test_hf_apply_check_is_not_fooled_by_a_random_forward():
    """ViT-MAE masks random patches in every forward: the survey compares the patched and unpatched outputs with the
    same seed, so the comparison sees addnorm's difference only (here none)."""
    pytest.importorskip("transformers")
    from addnorm.integrations.survey import _hf_apply, build

    built = build("vit_mae")
    row = _hf_apply(built.model, built.batch)
    assert row["hf_apply"] in ("norms", "fused") and row["hf_apply_rel_err"] <= 1e-5
