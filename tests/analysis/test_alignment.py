"""Weight-vs-activation alignment against planted structure, dense numpy oracles and the real MiniLM."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers_analysis import alignment_oracle
from torch import nn

from plate_inspect.analysis.alignment import (
    alignment_from_moments,
    collect_input_moments,
    hf_text_alignment,
    hf_text_inputs,
    load_hf_model,
    sklearn_descr_text,
    weight_activation_alignment,
)
from plate_inspect.errors import PlateInspectError


def test_planted_activation_subspace_equal_to_weight_row_space_gives_al_one():
    d_in, d_out, k, n = 24, 10, 4, 500
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(d_in, k, generator=g, dtype=torch.float64)).Q
    # W = R diag(s) basis^T: its row space (top-k right singular vectors) is span(basis)
    r = torch.linalg.qr(torch.randn(d_out, k, generator=g, dtype=torch.float64)).Q
    w = r @ torch.diag(torch.tensor([5.0, 4.0, 3.0, 2.0], dtype=torch.float64)) @ basis.T
    layer = nn.Linear(d_in, d_out, bias=False).double()
    with torch.no_grad():
        layer.weight.copy_(w)
    # activations live in the same subspace, with distinct variances per direction
    z = torch.randn(n, k, generator=g, dtype=torch.float64) * torch.tensor([3.0, 2.0, 1.5, 1.0], dtype=torch.float64)
    x = z @ basis.T
    model = nn.Sequential(layer)
    recs = weight_activation_alignment(model, [x[:200], x[200:]], ks=[k], target_modules=["0"])
    (rec,) = recs
    assert rec.n_samples == n and rec.d_in == d_in
    assert rec.al_weight == pytest.approx(1.0, abs=1e-10)
    assert rec.ve_weight == pytest.approx(1.0, abs=1e-10)
    assert rec.ve_oracle == pytest.approx(1.0, abs=1e-10)
    assert rec.al_chance == pytest.approx(k / d_in)
    # and the orthogonal complement of the row space captures nothing: a weight with the complement as row space
    comp = torch.linalg.qr(torch.cat([basis, torch.randn(d_in, k, generator=g, dtype=torch.float64)], 1)).Q[:, k:]
    with torch.no_grad():
        layer.weight.copy_(r @ comp.T)
    (rec,) = weight_activation_alignment(model, [x], ks=[k], target_modules=["0"])
    assert rec.al_weight == pytest.approx(0.0, abs=1e-10)
    assert rec.ve_weight == pytest.approx(0.0, abs=1e-10)


def test_metrics_match_numpy_definitions():
    rng = np.random.default_rng(1)
    d_in, d_out, n = 30, 18, 400
    w = rng.standard_normal((d_out, d_in))
    x = rng.standard_normal((n, d_in)) @ rng.standard_normal((d_in, d_in))  # anisotropic
    sigma = torch.from_numpy(x.T @ x / n)
    recs = alignment_from_moments("m", torch.from_numpy(w), sigma, ks=[3, 8, 15], n_random=400, seed=0)
    for rec in recs:
        ve_w, ve_o, al = alignment_oracle(w, x, rec.k)
        assert rec.ve_weight == pytest.approx(ve_w, rel=1e-9)
        assert rec.ve_oracle == pytest.approx(ve_o, rel=1e-9)
        assert rec.al_weight == pytest.approx(al, rel=1e-9)
        assert rec.al_chance == rec.k / d_in
        # E[VE of a Haar-random k-frame] = k / d_in for any Sigma; 400 draws average it closely
        assert rec.ve_random == pytest.approx(rec.k / d_in, rel=0.08)
        assert rec.ve_oracle >= max(rec.ve_weight, rec.ve_random) - 1e-12  # the oracle is optimal (Ky Fan)
        assert rec.ve_ratio == pytest.approx(rec.ve_weight / rec.ve_random)
    assert set(recs[0].to_json()) == {
        "module",
        "k",
        "d_in",
        "ve_weight",
        "ve_oracle",
        "ve_random",
        "al_weight",
        "al_chance",
    }


def test_streamed_moments_equal_stacked_activations():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 4))
    batches = [torch.randn(3, 6, 5), torch.randn(2, 6, 5), torch.randn(4, 6, 5)]  # [B, T, d]: every row counts
    moments = collect_input_moments(model, batches)
    assert set(moments) == {"0", "2"}
    x0 = torch.cat([b.reshape(-1, 5) for b in batches]).double()
    h = torch.relu(model[0](torch.cat([b.reshape(-1, 5) for b in batches]))).detach().double()
    assert moments["0"].n == moments["2"].n == 9 * 6
    np.testing.assert_allclose(moments["0"].xtx.numpy(), (x0.T @ x0).numpy(), rtol=1e-10)
    np.testing.assert_allclose(moments["2"].xtx.numpy(), (h.T @ h).numpy(), rtol=1e-5, atol=1e-5)
    # hooks are removed afterwards
    assert not model[0]._forward_pre_hooks and not model[2]._forward_pre_hooks


def test_dict_and_tuple_inputs_and_custom_forward():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 3)

        def forward(self, x, scale=1.0):
            return self.a(x * scale)

    model = Two()
    x = torch.randn(10, 4)
    m1 = collect_input_moments(model, [{"x": x, "scale": 2.0}])["a"]
    m2 = collect_input_moments(model, [(x, 2.0)])["a"]
    m3 = collect_input_moments(model, [x], forward=lambda m, item: m(item, scale=2.0))["a"]
    want = (2 * x).double().T @ (2 * x).double()
    for m in (m1, m2, m3):
        np.testing.assert_allclose(m.xtx.numpy(), want.numpy(), rtol=1e-6)


def test_errors_are_one_line_plate_inspect_errors():
    model = nn.Sequential(nn.Linear(4, 3))
    with pytest.raises(PlateInspectError, match="no target linear layers"):
        weight_activation_alignment(model, [torch.randn(2, 4)], target_modules=["nope"])
    with pytest.raises(PlateInspectError, match="saw no input"):
        weight_activation_alignment(model, [], ks=[2])
    with pytest.raises(PlateInspectError, match="ks must be a list of positive integers"):
        weight_activation_alignment(model, [torch.randn(2, 4)], ks=[0])
    with pytest.raises(PlateInspectError, match="not a directory"):
        load_hf_model("/nonexistent/model")


def test_sklearn_text_is_real_english():
    text = sklearn_descr_text()
    assert len(text.split()) > 3000
    assert "dataset" in text and "the" in text.split()


# --------------------------------------------------------------------------- the real MiniLM
@pytest.fixture(scope="module")
def minilm(minilm_dir):
    model, tok = load_hf_model(minilm_dir)
    return model, tok


def test_hook_moments_equal_hidden_states_of_real_minilm(minilm):
    model, tok = minilm
    inputs = hf_text_inputs(tok, sklearn_descr_text(), seq_len=64, max_tokens=300)
    assert sum(i["input_ids"].shape[1] for i in inputs) == 300 + 2 * len(inputs)  # [CLS] ... [SEP] per window
    assert inputs[0]["input_ids"][0, 0] == tok.cls_token_id and inputs[0]["input_ids"][0, -1] == tok.sep_token_id
    names = ["encoder.layer.0.attention.self.query", "encoder.layer.1.attention.self.query"]
    moments = collect_input_moments(model, inputs, names)
    for layer, name in enumerate(names):
        xs = []
        with torch.no_grad():
            for item in inputs:
                hs = model(**item, output_hidden_states=True).hidden_states[layer]  # the input of layer `layer`
                xs.append(hs.reshape(-1, hs.shape[-1]).double())
        x = torch.cat(xs)
        assert moments[name].n == x.shape[0]
        np.testing.assert_allclose(moments[name].xtx.numpy(), (x.T @ x).numpy(), rtol=1e-4, atol=1e-3)


def test_hf_text_alignment_on_real_minilm(minilm_dir):
    text = sklearn_descr_text()
    layer0 = [r"encoder\.layer\.0\..*(query|key|value|dense)$"]
    recs = hf_text_alignment(
        minilm_dir, text, ks=(8, 32), max_tokens=400, seq_len=128, n_random=2, target_modules=layer0
    )
    assert len(recs) == 6 * 2  # layer 0's 6 module types x 2 k values
    for r in recs:
        assert r.d_in in (384, 1536)
        assert 0 <= r.al_weight <= 1 + 1e-9
        assert r.ve_oracle >= r.ve_weight - 1e-9 and r.ve_oracle >= r.ve_random - 1e-9
        assert r.n_samples == 400 + 2 * 4


def test_align_cli_json(minilm_dir, tmp_path):
    from plate_inspect.cli.main import cli

    text = tmp_path / "t.txt"
    text.write_text(sklearn_descr_text()[:3000], encoding="utf-8")
    args = ["align", str(minilm_dir), "--text", str(text), "--k", "8", "--max-tokens", "200", "--json"]
    res = CliRunner().invoke(cli, [*args, "--target-modules", "value,intermediate.dense"])
    assert res.exit_code == 0, res.output
    recs = json.loads(res.output)
    assert len(recs) == 12
    keys = ["module", "k", "d_in", "ve_weight", "ve_oracle", "ve_random", "al_weight", "al_chance"]
    assert all(list(r) == keys for r in recs)
    assert {r["module"].split(".", 3)[-1] for r in recs} == {"attention.self.value", "intermediate.dense"}


def test_align_cli_errors(minilm_dir, tmp_path):
    from plate_inspect.cli.main import cli

    res = CliRunner().invoke(cli, ["align", str(minilm_dir), "--text", str(tmp_path / "missing.txt")])
    assert res.exit_code == 2 and "not found" in res.output
    res = CliRunner().invoke(cli, ["align", str(minilm_dir), "--k", "8,x"])
    assert res.exit_code == 2 and "--k" in res.output
    res = CliRunner().invoke(cli, ["align", str(tmp_path)])
    assert res.exit_code == 2 and "config.json" in res.output


def test_k_larger_than_a_target_layer_is_a_config_error():
    from plate_inspect.errors import ConfigError

    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 5))
    with pytest.raises(ConfigError, match=r"k=4 exceeds min\(d_out, d_in\)=3 of 2 target layers \(e.g. 0\)"):
        weight_activation_alignment(model, [torch.randn(2, 4)], ks=[2, 4])
    assert len(weight_activation_alignment(model, [torch.randn(6, 4)], ks=[1, 3], n_random=1)) == 4


def test_k_beyond_the_weights_rank_or_the_samples_is_refused():
    """QA: a 10 x 40 weight with k = 20 ran (its top-20 right singular directions: 10 real, 10 arbitrary null
    vectors; VE moved 0.27 -> 0.58 -> 0.74 with k), and 4 token rows for k = 8 printed "VE oracle 1.0000"."""
    from plate_inspect.errors import AlignmentError, ConfigError

    wide = nn.Sequential(nn.Linear(40, 10))
    with pytest.raises(ConfigError, match=r"min\(d_out, d_in\)=10"):
        weight_activation_alignment(wide, [torch.randn(64, 40)], ks=[20])
    with pytest.raises(AlignmentError, match="only 4 activation rows for k=8"):
        weight_activation_alignment(wide, [torch.randn(4, 40)], ks=[8])
    assert len(weight_activation_alignment(wide, [torch.randn(64, 40)], ks=[8, 10], n_random=1)) == 2


def test_seq_len_beyond_the_position_table_is_capped_and_said(minilm_dir):
    """QA: `align --seq-len 1024` on MiniLM (max_position_embeddings 512) silently used 512-token windows. The cap
    stays (longer windows would index past the position table) but is said: a note (the CLI prints it on stderr)
    or a SeqLenCappedWarning. The rows seen prove which windows ran: 510 text tokens + [CLS] + [SEP] per window."""
    import math
    import warnings

    from plate_inspect.analysis.alignment import SeqLenCappedWarning

    text = sklearn_descr_text()
    model_max = json.loads((minilm_dir / "config.json").read_text())["max_position_embeddings"]
    assert model_max == 512
    tokens = 1100
    common = dict(ks=(8,), max_tokens=tokens, n_random=1, target_modules=["encoder.layer.0.attention.self.query"])
    notes: list[str] = []
    recs = hf_text_alignment(minilm_dir, text, seq_len=1024, notes=notes.append, **common)
    assert len(notes) == 1 and "1024" in notes[0] and "512" in notes[0], notes
    assert recs[0].n_samples == tokens + 2 * math.ceil(tokens / (model_max - 2))
    with pytest.warns(SeqLenCappedWarning, match="max_position_embeddings"):
        hf_text_alignment(minilm_dir, text, seq_len=600, **common)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SeqLenCappedWarning)  # within the table: no note
        recs = hf_text_alignment(minilm_dir, text, seq_len=512, notes=notes.append, **common)
    assert len(notes) == 1 and recs[0].n_samples == tokens + 2 * math.ceil(tokens / 510)


def test_align_cli_says_when_seq_len_is_capped(minilm_dir, tmp_path):
    from plate_inspect.cli.main import cli

    text = tmp_path / "t.txt"
    text.write_text(sklearn_descr_text()[:2000], encoding="utf-8")
    args = ["align", str(minilm_dir), "--text", str(text), "--k", "8", "--max-tokens", "100", "--json"]
    args += ["--target-modules", "encoder.layer.0.attention.self.query", "--random-draws", "1"]
    res = CliRunner().invoke(cli, [*args, "--seq-len", "2048"])
    assert res.exit_code == 0, res.output
    assert "note: windows of 2048 tokens (--seq-len) exceed the model's max_position_embeddings (512)" in res.stderr
    assert json.loads(res.stdout)[0]["module"] == "encoder.layer.0.attention.self.query"  # stdout stays JSON
    res = CliRunner().invoke(cli, [*args, "--seq-len", "128"])
    assert res.exit_code == 0 and "note:" not in res.stderr


def test_conv1d_weights_are_read_as_d_out_by_d_in():
    """GPT-2's Conv1D stores W transposed ([d_in, d_out]); VE/AL use its right singular vectors in input space.
    A square Conv1D is the case a missing transpose would not catch by shape: compare with the numpy definitions
    on W = stored.T and on the explicit activations."""
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(12, 12), nn.Tanh(), Conv1D(7, 12))  # Conv1D(nf=d_out, nx=d_in)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(200, 12, generator=g) @ torch.randn(12, 12, generator=g)
    recs = weight_activation_alignment(model, [x], ks=(2, 5), n_random=1)
    with torch.no_grad():
        acts = {"0": x, "2": torch.tanh(model[0](x))}
    for rec in recs:
        w = model[int(rec.module)].weight.detach().double().numpy().T  # [d_out, d_in]
        ve_w, ve_o, al = alignment_oracle(w, acts[rec.module].double().numpy(), rec.k)
        assert rec.d_in == 12
        assert rec.ve_weight == pytest.approx(ve_w, rel=1e-6)
        assert rec.ve_oracle == pytest.approx(ve_o, rel=1e-6)
        assert rec.al_weight == pytest.approx(al, rel=1e-5, abs=1e-7)
    # the stored (untransposed) square weight's right singular vectors are different: the test can tell them apart
    w0 = model[0].weight.detach().double().numpy()
    ve_wrong, _, _ = alignment_oracle(w0, x.double().numpy(), 2)
    assert abs(ve_wrong - next(r.ve_weight for r in recs if r.module == "0" and r.k == 2)) > 1e-3


def test_align_json_out_writes_the_records_atomically(minilm_dir, tmp_path, monkeypatch):
    """--json-out: the records of --json, written atomically to a file; a directory is refused before the model
    loads (one line, no traceback)."""
    from plate_inspect.analysis import alignment
    from plate_inspect.cli.main import cli

    text = tmp_path / "t.txt"
    text.write_text(sklearn_descr_text()[:2000], encoding="utf-8")
    args = ["align", str(minilm_dir), "--text", str(text), "--k", "8", "--max-tokens", "100", "--random-draws", "1"]
    args += ["--target-modules", "encoder.layer.0.attention.self.query"]
    out = tmp_path / "sub" / "align.json"
    res = CliRunner().invoke(cli, [*args, "--json", "--json-out", str(out)])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text()) == json.loads(res.stdout)
    assert json.loads(out.read_text())[0]["module"] == "encoder.layer.0.attention.self.query"

    def must_not_run(*a, **k):
        raise AssertionError("the model ran before --json-out was checked")

    monkeypatch.setattr(alignment, "hf_text_alignment", must_not_run)
    res = CliRunner().invoke(cli, [*args, "--json-out", str(tmp_path)])
    assert res.exit_code == 2 and "is a directory" in res.output and "Traceback" not in res.output, res.output


def test_tiny_transformer_against_explicit_activations():
    """A float32 torch TransformerEncoderLayer (post-norm, eval): linear1 sees norm1(x + attn(x)), linear2 sees
    relu(linear1(.)); the records equal the numpy definitions on those activations, recomputed by hand from the
    layer's parts (and checked to reproduce the model's output). The attention's out_proj is applied functionally
    by nn.MultiheadAttention, never through its forward: by default it is named in a one-line error with the
    remedy, instead of being reported on no data."""
    torch.manual_seed(0)
    model = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1, enable_nested_tensor=False
    )
    model.eval()
    layer = model.layers[0]
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(3, 10, 16, generator=g) * torch.linspace(0.2, 3, 16) for _ in range(2)]
    names = ["layers.0.linear1", "layers.0.linear2"]
    recs = weight_activation_alignment(model, batches, ks=(2, 6), n_random=1, target_modules=names)
    acts1, acts2 = [], []
    with torch.no_grad():
        for x in batches:
            h = layer.norm1(x + layer.self_attn(x, x, x, need_weights=False)[0])
            a2 = torch.relu(layer.linear1(h))
            torch.testing.assert_close(
                layer.norm2(h + layer.linear2(a2)), model(x)
            )  # the hand recomputation is the model
            acts1.append(h.reshape(-1, 16))
            acts2.append(a2.reshape(-1, 32))
    acts = {names[0]: torch.cat(acts1), names[1]: torch.cat(acts2)}
    assert len(recs) == 4
    for rec in recs:
        w = dict(model.named_modules())[rec.module].weight.detach().double().numpy()
        ve_w, ve_o, al = alignment_oracle(w, acts[rec.module].double().numpy(), rec.k)
        assert rec.n_samples == 60
        assert rec.ve_weight == pytest.approx(ve_w, rel=1e-5)
        assert rec.ve_oracle == pytest.approx(ve_o, rel=1e-5)
        assert rec.al_weight == pytest.approx(al, rel=1e-4, abs=1e-6)
    with pytest.raises(PlateInspectError, match=r"self_attn\.out_proj.*leave them out with target_modules"):
        weight_activation_alignment(model, batches, ks=(2,), n_random=1)


def test_align_on_a_bundle_directory_says_it_is_a_bundle(tmp_path):
    """QA: `plate-inspect align BUNDLE` (a bundle where the model goes) said only "no config.json". It now says the
    directory is a PLATE bundle and that align wants the model it was made from; one line, exit 2."""
    from safetensors.torch import save_file

    import plate_inspect
    from plate_inspect.cli.main import cli

    torch.manual_seed(0)
    layer = nn.Linear(12, 10)
    save_file({"fc.weight": layer.weight.detach().contiguous()}, str(tmp_path / "m.safetensors"))
    plate_inspect.scan(tmp_path / "m.safetensors", tmp_path / "bundle", r=2, tau=0.9, max_rank=4)
    res = CliRunner().invoke(cli, ["align", str(tmp_path / "bundle"), "--k", "2"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "is a PLATE bundle (plate-inspect scan output), not a model" in res.output
