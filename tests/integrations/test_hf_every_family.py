"""hf.apply on every family the survey fuses: the patched model's output equals the unpatched one's, and generate()
gives the same tokens where the family has a generation head.

The families are not typed here: they are the rows of docs/survey.json (written by ``addnorm survey --docs
docs/survey.md``) whose ``hf_apply`` is ``fused`` (or ``mismatch`` / ``error``: a row the survey found wrong fails
here too). A family that stops fusing fails its test below; one that starts fusing fails the test of the unfused
rows until the survey is regenerated, which puts it in the list. Each model is built tiny by the survey's own rules
and input builders (addnorm.integrations.tiny), with norm weights and biases randomised (HF initialises them
to constants, which would hide a weight applied in the wrong place or order).
One family per structure the survey tells apart also gets a bf16 check and a train-mode gradient check.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

from addnorm.integrations.hf.handoff import fused_ops
from addnorm.integrations.hf.norm_probe import randomize_norms
from addnorm.integrations.survey import report

ROOT = Path(__file__).resolve().parents[2]
SURVEY = report.load(ROOT / "docs" / "survey.json")
CHECKED = ("fused", "mismatch", "error")  # what the survey's hf.apply column says of a model apply patched
ROWS = {r["model_type"]: r for r in SURVEY["models"] if r.get("hf_apply") in CHECKED}
SEQ = 6
NEW_TOKENS = 3


@pytest.fixture(scope="module")
def transformers():
    t = pytest.importorskip("transformers")
    if t.__version__ != SURVEY["transformers"]:
        pytest.skip(
            f"docs/survey.json is for transformers {SURVEY['transformers']}, installed {t.__version__}: "
            "regenerate it with `addnorm survey --docs docs/survey.md --readme README.md`"
        )
    t.logging.set_verbosity_error()
    return t


def _generation_auto(transformers, model_type: str):
    """The Auto class of the family's generation head (causal LM, image-text-to-text, seq2seq LM), or None."""
    from transformers.models.auto import modeling_auto as ma

    for names, auto in (
        (ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, transformers.AutoModelForCausalLM),
        (ma.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, transformers.AutoModelForImageTextToText),
        (ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, transformers.AutoModelForSeq2SeqLM),
    ):
        if model_type in names:
            return auto
    return None


def _build(transformers, model_type: str, dtype=torch.float32):
    """The family's generation model where it has one and takes input_ids, else the survey's base model; its batch
    (the survey's input builder: one row of SEQ tokens, or one image); whether it can generate."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    from addnorm.integrations import tiny

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = tiny.tiny_config(model_type)
        base = MODEL_MAPPING[type(config)]
        batch = tiny.inputs(config, base.main_input_name, batch_size=1, seq_len=SEQ)
        auto = _generation_auto(transformers, model_type)
        generates = auto is not None and "input_ids" in batch
        torch.manual_seed(0)
        model = (auto if generates else transformers.AutoModel).from_config(config).eval()
        fused = set(ROWS.get(model_type, {}).get("hf_fused_layers", []))
        if generates and fused and not fused & {type(m).__name__ for m in model.modules()}:
            # the generation head holds none of the layers the survey fused in the base model (ProphetNet's causal
            # LM is its decoder alone; the survey fused its encoder): check the base model's output instead
            torch.manual_seed(0)
            model, generates = transformers.AutoModel.from_config(config).eval(), False
    randomize_norms(model)
    return model.to(dtype), batch, generates


def _main_output(out) -> torch.Tensor:
    """What the model returns first: logits, else last_hidden_state, else its first tensor."""
    from addnorm.diagnostics.blocks import first_tensor

    for name in ("logits", "last_hidden_state"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value
    return first_tensor(out)


def _forward(model, batch) -> torch.Tensor:
    torch.manual_seed(0)  # models that draw random numbers in forward draw the same ones each time
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _main_output(model(**batch))


def _generate(model, batch) -> torch.Tensor:
    kw = dict(max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True, eos_token_id=None, pad_token_id=0)
    config = model.config
    if config.is_encoder_decoder and getattr(config, "decoder_start_token_id", None) is None:
        # T5's tiny config (and mT5, LongT5, Switch) names no start token; HF's published configs use the pad id 0
        kw["decoder_start_token_id"] = 0
    inputs = {k: v for k, v in batch.items() if k != "decoder_input_ids"}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(**inputs, **kw)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return (got.double() - ref.double()).abs().max().item() / max(ref.abs().max().item(), 1e-30)


# Families whose generation head fails on the unpatched tiny model, with transformers' error: their tokens are not
# compared (their output still is, and the patched generate() must fail with the same error). Each must still fail
# unpatched (else the entry is stale and the test says so), and the list is held short, so skipping cannot grow
# silently. The hybrid linear-attention models came in with hf/rewrite.py (their layers fuse since).
_LINEAR_CACHE = "transformers' cache of a linear-attention layer has no get_seq_length on the tiny config"
GENERATE_FAILS_UNPATCHED = {
    "qwen3_omni_moe_thinker": "the thinker config has no vision_start_token_id, which its generate() reads",
    "jamba": _LINEAR_CACHE,
    "qwen3_5_moe_text": _LINEAR_CACHE,
    "qwen3_5_text": _LINEAR_CACHE,
    "qwen3_next": _LINEAR_CACHE,
    "recurrent_gemma": _LINEAR_CACHE,
    # the tiny configs' layers are all Mamba (linear-attention) layers: the cache has no attention layer to ask
    "nemotron_h": _LINEAR_CACHE,
    "zamba": _LINEAR_CACHE,
    "rwkv": "its generate() sizes a state by the published width (4096), not the tiny config's",
    # its layers run in H and L cycles, each cycle's calls at cache slots past the last layer's: the cache has
    # config.num_hidden_layers slots, which the tiny config sets to its 2 layers, not layers x cycles
    "hrm_text": "the tiny config's num_hidden_layers is fewer than the cache slots its H/L cycles write",
}
MAX_GENERATE_SKIPS = 10


def _fused_calls(model) -> set[str]:
    """Records the class of each fused layer of ``model`` that makes a fused call (hooks, kept on the model)."""
    from addnorm.integrations.hf.rewrite import record_fused_layers

    ran, model._addnorm_test_hooks = record_fused_layers(model)
    return ran


@pytest.mark.parametrize("model_type", sorted(ROWS))
def test_fused_family_output_and_generate_unchanged(transformers, model_type):
    """apply_status "fused", a fused layer runs, the fp32 output within 1e-5 of its scale of the unpatched one's,
    and greedy generate() gives the same tokens."""
    from addnorm.integrations import hf

    model, batch, generates = _build(transformers, model_type)
    ref = _forward(model, batch)
    ref_tokens = ref_failure = None
    if generates:
        try:
            ref_tokens = _generate(model, batch)
        except Exception as e:  # noqa: BLE001 - transformers' own generate() on the tiny config
            assert model_type in GENERATE_FAILS_UNPATCHED, f"{model_type}: unpatched generate() fails: {e!r}"
            ref_failure = e
        else:
            assert model_type not in GENERATE_FAILS_UNPATCHED, f"{model_type} generates now: drop its entry"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf.apply(model)
    assert hf.apply_status(model) == "fused", f"{model_type}: no layer fused (the survey fused it)"
    ran = _fused_calls(model)
    before = fused_ops()
    err = _rel_err(_forward(model, batch), ref)
    ops = [op for op, n in fused_ops().items() if n > before[op]]
    assert ran, f"{model_type}: no fused layer made a fused call in the forward"
    # the survey's hf_ops column: the fused ops its layers call (add_norm, norm_add, norm_add_norm)
    assert ops == ROWS[model_type].get("hf_ops", ops), f"{model_type}: calls {ops}, the survey says otherwise"
    assert err <= 1e-5, f"{model_type}: fp32 output differs by {err:.3g} of its scale"
    if ref_tokens is not None:
        tokens = _generate(model, batch)
        prompt = 1 if model.config.is_encoder_decoder else SEQ  # a decoder starts from its start token
        assert tokens.shape[1] == prompt + NEW_TOKENS
        assert torch.equal(tokens, ref_tokens), f"{model_type}: generate() gives other tokens"
    elif generates:
        with pytest.raises(type(ref_failure)) as failure:  # apply changes nothing about how it fails
            _generate(model, batch)
        assert str(failure.value) == str(ref_failure)


# One family per distinct structure the survey measured (norm, placement, zero-centred weight, bias, residual
# scale, QK-norm): the first in alphabetical order. These get the bf16 and the gradient checks.
def _one_per_structure() -> list[str]:
    keys = ("norm", "placement", "zero_centered_weight", "bias", "residual_scale", "qk_norm")
    first: dict[tuple, str] = {}
    for model_type in sorted(ROWS):
        first.setdefault(tuple(str(ROWS[model_type].get(k)) for k in keys), model_type)
    return sorted(first.values())


STRUCTURES = _one_per_structure()


def _bf16_ulps(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Max |got - ref| in bf16 ulps of ref's largest magnitude (the spacing of bf16 numbers there)."""
    top = ref.abs().max().item()
    ulp = 2.0 ** (math.floor(math.log2(top)) - 7) if top > 0 else 2.0**-133
    return (got.double() - ref.double()).abs().max().item() / ulp


@pytest.mark.parametrize("model_type", STRUCTURES)
def test_bf16_output_per_structure(transformers, model_type, monkeypatch):
    """The README's bf16 claim beyond the hand-sized FAMILIES, with the torch backend and every weight in bf16 (input
    and weight share a dtype): RMSNorm families bitwise equal. LayerNorm families (and those whose norm the survey
    did not name): the fused output bitwise equal to ``fuse_residual=False``'s (the fused add costs no bit), and
    that within LN_ULPS bf16 ulps of the output's largest magnitude (addnorm sums LayerNorm's fp32 statistics in
    another order than torch's kernel; GPT-2 and BERT stay within one, test_hf_integration checks them). A family
    whose unpatched model does not run in bf16 must fail the same way patched. Two seeds of the norms' weights."""
    from addnorm.integrations import hf

    monkeypatch.setenv("ADDNORM_BACKEND", "torch")
    model, batch, _ = _build(transformers, model_type, torch.bfloat16)
    batch = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in batch.items()}
    rms = ROWS[model_type].get("norm") == "rmsnorm"
    for seed in (1, 2):
        randomize_norms(model, seed)
        model.to(torch.bfloat16)
        try:
            ref = _forward(model, batch)
        except Exception as e:  # noqa: BLE001 - the family itself in bf16 (FastSpeech2-Conformer: fp32 internals)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                hf.apply(model)
            with pytest.raises(type(e)):
                _forward(model, batch)
            return
        outputs = {}
        for fuse in (False, True):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                hf.apply(model, fuse_residual=fuse)
            outputs[fuse] = _forward(model, batch)
            hf.revert(model)
        got = outputs[True]
        assert got.dtype == ref.dtype  # bf16, or the dtype the family casts its logits to (Nemotron-H: fp32)
        if rms:
            assert torch.equal(got, ref), f"{model_type} seed {seed}: {_bf16_ulps(got, ref):.3g} ulps"
        else:
            assert torch.equal(got, outputs[False]), f"{model_type} seed {seed}: the fused add changed bits"
            assert _bf16_ulps(got, ref) <= LN_ULPS, f"{model_type} seed {seed}: {_bf16_ulps(got, ref):.3g} ulps"


# Vision towers with many LayerNorms in a row (Hiera, PVT v2) amplify the one-ulp statistics difference of each
# norm to ~3 ulps at the output, with the norms swapped alone (fuse_residual=False) as much as fused.
LN_ULPS = 4.0


def _grads(model, batch, probe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)  # train mode: dropout draws the same numbers in both runs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = _main_output(model(**batch))
    terms = out.float() * probe  # a fixed random direction: every output element carries gradient
    loss = terms.sum()
    loss.backward()
    # the loss cancels terms of either sign; its rounding error follows their total magnitude, kept as its scale
    scale = terms.detach().abs().sum()
    return loss.detach(), scale, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", STRUCTURES)
def test_training_step_gradients_per_structure(transformers, model_type, monkeypatch):
    """One backward in train mode: loss within 1e-5 (see below), each parameter's gradient within 1e-5 of its own scale (the
    scale floored at 1e-4 of the largest gradient: a gradient that is zero in exact arithmetic holds only rounding
    noise, which another order of summation changes completely). With the torch backend, which auto picked at these
    sizes until it stopped choosing by size (issue 26): the numba cpu backend's fp32 sums move a few families'
    gradients past 1e-5 (diffllama, doge, lara_mini)."""
    from addnorm.integrations import hf

    monkeypatch.setenv("ADDNORM_BACKEND", "torch")

    model, batch, _ = _build(transformers, model_type)
    model.train()
    try:
        probe = torch.randn(_forward(model, batch).shape, generator=torch.Generator().manual_seed(4))
    except Exception as e:  # noqa: BLE001 - the family itself in train mode (FastSpeech2-Conformer wants labels)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf.apply(model)
        with pytest.raises(type(e)):
            _forward(model, batch)
        return
    loss_ref, scale, ref = _grads(model, batch, probe)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf.apply(model)
    loss, _, got = _grads(model, batch, probe)
    # within 1e-5 of the loss, or 1e-7 of the terms' total magnitude (about one fp32 ulp of it: PVT v2's loss of 5.2
    # sums terms of magnitude 8e3, and swapping its norms alone moves it by 7e-5)
    assert abs(loss.item() - loss_ref.item()) <= max(1e-5 * max(abs(loss_ref.item()), 1.0), 1e-7 * scale.item())
    assert got.keys() == ref.keys() and ref
    floor = 1e-4 * max(g.abs().max().item() for g in ref.values())
    for name, g in ref.items():
        err = (got[name].double() - g.double()).abs().max().item()
        assert err <= 1e-5 * max(g.abs().max().item(), floor), f"{model_type} grad {name}: max abs err {err:.3g}"


UNFUSED = {r["model_type"]: r for r in SURVEY["models"] if r.get("hf_apply") in ("norms", "unsupported")}


@pytest.mark.parametrize("model_type", sorted(UNFUSED))
def test_unfused_family_is_still_what_the_survey_says(transformers, model_type):
    """The other side of the list: a family the survey found unfused (norms swapped only, or no norm addnorm
    reproduces) is still so, so that a family apply starts fusing (a new template, a fixed matcher) cannot go
    untested: its row must be regenerated, which puts it in the per-family test above. A fused layer class that does
    not run on the survey's input (a VLM's vision tower on text alone) is listed in the row and must match."""
    from addnorm.integrations import hf
    from addnorm.integrations.survey import build

    row = UNFUSED[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build(model_type, batch_size=1, seq_len=SEQ).model
        if row["hf_apply"] == "unsupported":
            with pytest.raises(ValueError, match="no norm module that addnorm reproduces"):
                hf.apply(model)
            return
        hf.apply(model)
    assert hf.fused_layer_classes(model) == row.get("hf_fused_not_run", []), (
        f"{model_type}: hf.apply fuses {hf.fused_layer_classes(model)} now; regenerate docs/survey.json "
        "(`addnorm survey --docs docs/survey.md --readme README.md`) so that the per-family test checks it"
    )


def test_generate_skips_stay_few():
    assert set(GENERATE_FAILS_UNPATCHED) <= set(ROWS), "an entry for a family the survey does not fuse"
    assert len(GENERATE_FAILS_UNPATCHED) <= MAX_GENERATE_SKIPS


def test_the_survey_data_is_for_the_installed_transformers():
    """The per-family tests skip when docs/survey.json was written for another transformers; this one fails then,
    so stale data cannot hide."""
    t = pytest.importorskip("transformers")
    assert t.__version__ == SURVEY["transformers"], (
        f"docs/survey.json is for transformers {SURVEY['transformers']}, installed {t.__version__}: regenerate it "
        "with `addnorm survey --docs docs/survey.md --readme README.md`"
    )
    assert len(ROWS) >= 25  # the issue's target; far fewer would mean the survey data lost its fused rows


def test_readme_lists_the_survey_fused_families():
    """README's generated paragraphs are what `addnorm survey --readme` writes from docs/survey.json."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert report.update_readme(text, SURVEY) == text, (
        "README.md's survey paragraphs differ from docs/survey.json: run "
        "`addnorm survey --from docs/survey.json --readme README.md`"
    )
    block = text.split("<!-- survey:hf-fused -->")[1].split("<!-- /survey:hf-fused -->")[0]
    decoders = report.readme_fused_decoders(SURVEY)
    assert decoders and set(decoders) <= {t for t in ROWS if ROWS[t]["hf_apply"] == "fused"}
    assert all(f"`{t}`" in block for t in decoders)


# The families issue 25 found with their norms swapped but no add fused. Fused since by hf/rewrite.py (their own
# forwards rewritten), addnorm.norm_add (the branch-output ones), OnePlusWeightLayerNorm (Nemotron),
# hf/handoff.py (the parallel blocks: the add a layer returns fused with the next layer's input norm) and
# hf/helper_rewrite.py + hf/links.py (BLOOM and GPT-NeoX-Japanese: adds made in dropout_add / bias_dropout_add, by
# child modules); each is in ROWS, so the per-family test above checks its output and generate().
ISSUE_25_FUSED = (
    "biogpt",
    "bloom",
    "cohere",
    "cohere2",
    "doge",
    "exaone4",
    "gpt_bigcode",
    "gpt_neox",
    "gpt_neox_japanese",
    "granitemoeshared",
    "jetmoe",
    "minimax",
    "mpt",
    "nemotron",
    "nemotron_h",
    "olmo2",
    "olmo3",
    "opt",
    "persimmon",
    "phi",
    "stablelm",
    "xglm",
)


def test_the_families_issue_25_listed_unfused_are_fused():
    rows = {r["model_type"]: r for r in SURVEY["models"]}
    not_fused = {t: rows.get(t, {}).get("hf_apply", rows.get(t, {}).get("status")) for t in ISSUE_25_FUSED}
    assert {t: v for t, v in not_fused.items() if v != "fused"} == {}
