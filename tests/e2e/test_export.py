"""End to end through the API: each stage's success and failure on small models."""

from __future__ import annotations

import json

import onnx
import pytest
import torch

import onnxmedic
from tests import models


def _codes(result) -> list[str]:
    return [f.code for f in result.findings]


def _assert_verified(r):
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert all(v == "passed" for k, v in r.stages.items() if k != "write" or r.path)
    sets = {c.input_set for c in r.verification}
    # two further sets of the example's shapes; one where size variants draw fresh values
    sized = any("=" in s for s in sets)
    assert {"example", "random#1"} <= sets and ("random#2" in sets) != sized, sets
    for c in r.verification:
        assert c.ok and c.max_abs < 1e-3


def test_conv_log1p(tmp_path):
    r = onnxmedic.export(models.ConvLog1p(), (torch.randn(1, 3, 16, 16),), tmp_path / "m.onnx")
    _assert_verified(r)
    assert (tmp_path / "m.onnx").is_file() and r.path == str(tmp_path / "m.onnx")
    onnx.checker.check_model(str(tmp_path / "m.onnx"))
    assert r.exit_code == 0


def test_pool_view_dynamic_batch(tmp_path):
    r = onnxmedic.export(models.PoolView(), (torch.randn(2, 3, 8, 8),), tmp_path / "m.onnx",
                         dynamic_shapes={"x": {0: "batch"}})
    _assert_verified(r)
    m = onnx.load(tmp_path / "m.onnx")
    dim0 = m.graph.input[0].type.tensor_type.shape.dim[0]
    assert dim0.dim_param == "batch"
    # the exported file really runs at another batch size
    import onnxruntime as ort

    s = ort.InferenceSession(str(tmp_path / "m.onnx"))
    x = torch.randn(5, 3, 8, 8)
    (y,) = s.run(None, {s.get_inputs()[0].name: x.numpy()})
    torch.testing.assert_close(torch.from_numpy(y), models.PoolView()(x), rtol=1e-4, atol=1e-5)


def test_bilinear_align_corners():
    r = onnxmedic.export(models.BilinearAlignCorners(), (torch.randn(1, 2, 5, 7),))
    _assert_verified(r)
    assert r.path is None  # nothing asked to be written


def test_custom_norm():
    _assert_verified(onnxmedic.export(models.CustomNorm(), (torch.randn(4, 8),)))


def test_kwargs_and_dict_outputs():
    r = onnxmedic.export(models.KwargsModel(), (torch.randn(2, 3),),
                         kwargs={"mask": torch.ones(2, 3)})
    _assert_verified(r)
    r = onnxmedic.export(models.MultiOutput(), (torch.randn(3, 5),))
    _assert_verified(r)
    assert len({c.name for c in r.verification}) == 3
    idx = [c for c in r.verification if c.expected_dtype == "int64"]
    assert idx and all(c.rtol == 0 and c.atol == 0 for c in idx)  # indices match exactly


def test_onnxmedic_translation_makes_plain_failure_work(tmp_path):
    x = (torch.randn(3, 4),)
    with pytest.raises(Exception, match="No ONNX function found|erf_inv"):
        torch.onnx.export(models.Erfinv(), x, dynamo=True, verbose=False)
    r = onnxmedic.export(models.Erfinv(), x, tmp_path / "e.onnx")
    _assert_verified(r)
    assert "aten.special_erfinv.default" in r.used_translations
    assert "OM204" in _codes(r)


@pytest.mark.parametrize(("dtype", "words"), [(torch.int32, "int32"), (torch.float16, "float16")])
def test_preflight_dtype_mismatch(dtype, words, tmp_path):
    x = torch.ones(2, 10, dtype=dtype)
    r = onnxmedic.export(models.TwoLinear(), (x,), tmp_path / "m.onnx")
    assert not r.ok and r.stages["preflight"] == "failed" and r.stages["capture"] == "not run"
    (f,) = r.errors
    assert f.code == "OM101"
    assert words in f.message and "float32" in f.suggestion and ".float()" in f.suggestion
    assert f.location is not None and f.location.file.endswith("models.py")
    assert not (tmp_path / "m.onnx").exists()
    assert r.exit_code == 1


def test_preflight_forward_raises():
    r = onnxmedic.export(models.Raises(), (torch.ones(2),))
    (f,) = r.errors
    assert f.code == "OM100" and "broken on purpose" in f.message
    assert f.location.file.endswith("models.py") and "raise ValueError" in f.location.code


def test_data_dependent_branch_is_specialised_loudly_and_the_divergence_found():
    """torch.export gives up on `if x.sum() > 0`; draft_export follows the example's branch.
    onnxmedic says so at the user's line (OM114, with the torch.cond rewrite) and verifies on
    inputs meant to take the other branch: the zero input does, and the mismatch is reported."""
    r = onnxmedic.export(models.DataDependentIf(), (torch.ones(3),))
    assert r.stages["capture"] == "passed" and not r.ok
    (w,) = [f for f in r.findings if f.code == "OM114"]
    assert w.severity.value == "warning"
    assert w.location.file.endswith("models.py") and "x.sum() > 0" in w.location.code
    assert "torch.cond" in w.suggestion
    # torch.export (non-strict, strict, with validation off) fails; draft_export works
    assert [a["ok"] for a in r.attempts] == [False] * (len(r.attempts) - 1) + [True]
    assert "draft_export" in r.attempts[-1]["strategy"]
    bad = [c.input_set for c in r.verification if not c.ok]
    assert bad == ["zeros"]  # x.sum() == 0 takes the other branch
    assert [f.code for f in r.errors] == ["OM601"]


class _LoopOverCount(torch.nn.Module):
    def forward(self, x, k):
        return sum(x[i] for i in range(k.item()))  # loop count from a tensor value


class _SplitByCount(torch.nn.Module):
    def forward(self, x, k):
        return torch.split(x, k.item())[0] * 2  # chunk size from a tensor value


@pytest.mark.parametrize("model", [_LoopOverCount(), _SplitByCount()],
                         ids=["range(k.item())", "split(x, k.item())"])
def test_count_from_a_tensor_specialised_is_caught_by_the_integer_probe(model):
    """torch.export gives up on these (GuardOnDataDependentSymNode); draft_export bakes the
    example's count in. The 0-d integer input is probed at k+1: the divergence is reported."""
    r = onnxmedic.export(model, (torch.randn(6), torch.tensor(2)))
    assert "draft_export" in r.attempts[-1]["strategy"] and not r.ok
    assert "OM114" in [f.code for f in r.findings]
    bad = {c.input_set for c in r.verification if not c.ok}
    assert bad == {"integer scalars +1"}
    # wrong values (the loop) or a wrong shape (the split: 2 elements where k+1 gives 3)
    assert [f.code for f in r.errors] in (["OM601"], ["OM602"])


def test_branch_probe_pytorch_rejects_is_skipped_not_fatal():
    class IndexByK(torch.nn.Module):
        def forward(self, x, k):
            y = x.index_select(0, k.reshape(1))
            if x.sum() > 0:
                return y * 2
            return y

    r = onnxmedic.export(IndexByK(), (torch.ones(3), torch.tensor(2)))  # k+1 = 3: out of range
    skipped = [f for f in r.findings if f.code == "OM403"]
    assert skipped and "integer scalars +1" in skipped[0].message
    assert {"negated", "zeros"} <= {c.input_set for c in r.verification}
    assert {c.input_set for c in r.verification if not c.ok} == {"negated"}


def test_branch_specialisation_that_holds_everywhere_verifies():
    class AlwaysTrue(torch.nn.Module):
        def forward(self, x):
            if x.abs().sum() >= 0:  # data-dependent, but true for every input
                return x * 2
            return x

    r = onnxmedic.export(AlwaysTrue(), (torch.ones(3),))
    assert r.ok and "OM114" in [f.code for f in r.findings]
    assert {"negated", "zeros", "scaled x100"} <= {c.input_set for c in r.verification}


def test_data_dependent_control_flow_without_draft_export_is_om112():
    from onnxmedic.capture import capture, classify_capture_error
    from onnxmedic.capture.strategies import TorchExportNonStrict, TorchExportStrict

    attempts = capture(models.DataDependentIf(), (torch.ones(3),), {},
                       strategies=[TorchExportNonStrict, TorchExportStrict])
    f = classify_capture_error(attempts)
    assert f.code == "OM112"
    assert f.location.file.endswith("models.py") and "x.sum() > 0" in f.location.code
    assert "torch.cond" in f.suggestion


def test_unsupported_ops_are_all_reported_with_location(registry_snapshot):

    # implementations that leave PyTorch (numpy): they cannot be inlined, only translated
    @torch.library.custom_op("omtest::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(x.numpy() * 2)

    @twice.register_fake
    def _(x):
        return torch.empty_like(x)

    @torch.library.custom_op("omtest::thrice", mutates_args=())
    def thrice(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(x.numpy() * 3)

    @thrice.register_fake
    def _(x):
        return torch.empty_like(x)

    class Custom(torch.nn.Module):
        def forward(self, x):
            y = torch.ops.omtest.twice(x)
            return torch.ops.omtest.thrice(y) + torch.ops.omtest.twice(y)

    r = onnxmedic.export(Custom(), (torch.randn(2, 3),))
    assert r.stages["translate"] == "failed"
    errs = {f.op: f for f in r.errors}
    assert set(errs) == {"omtest.twice.default", "omtest.thrice.default"}
    assert errs["omtest.twice.default"].details["count"] == 2
    assert errs["omtest.twice.default"].code == "OM201"
    assert "float32[2, 3]" in errs["omtest.twice.default"].message
    assert errs["omtest.thrice.default"].location.file.endswith("test_export.py")
    assert "@onnxmedic.translation('omtest::thrice')" in errs["omtest.thrice.default"].suggestion
    assert "could not be inlined" in errs["omtest.thrice.default"].message

    # a user translation makes it export
    from onnxscript import opset18 as op

    from onnxmedic.ops import REGISTRY

    @onnxmedic.translation("omtest::twice")
    def _twice(x):
        return op.Add(x, x)

    @onnxmedic.translation(torch.ops.omtest.thrice.default)
    def _thrice(x):
        return op.Mul(x, op.CastLike(op.Constant(value_float=3.0), x))

    r = onnxmedic.export(Custom(), (torch.randn(2, 3),))
    _assert_verified(r)
    assert REGISTRY.get("omtest::twice").source == "user"


def test_wrong_translation_is_caught_and_existing_file_kept(tmp_path, registry_snapshot):
    from onnxscript import opset18 as op


    out = tmp_path / "m.onnx"
    out.write_bytes(b"previous good model")
    with pytest.warns(UserWarning, match="registered twice"):
        @onnxmedic.translation(torch.ops.aten.special_erfinv.default)
        def wrong_erfinv(self):
            return op.Mul(self, op.CastLike(op.Constant(value_float=0.9), self))

    r = onnxmedic.export(models.Erfinv(), (torch.randn(3, 4),), out)
    assert not r.ok and r.stages["compare"] == "failed"
    f = next(f for f in r.errors)
    assert f.code == "OM601" and "max abs error" in f.message
    assert out.read_bytes() == b"previous good model"
    assert any(x.code == "OM010" and "left unchanged" in x.message for x in r.findings)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".onnxmedic-")]


def test_keep_unverified(tmp_path, registry_snapshot):
    from onnxscript import opset18 as op


    with pytest.warns(UserWarning, match="registered twice"):
        @onnxmedic.translation(torch.ops.aten.special_erfinv.default)
        def wrong_erfinv(self):
            return op.Identity(self)

    r = onnxmedic.export(models.Erfinv(), (torch.randn(3, 4),), tmp_path / "m.onnx",
                         keep_unverified=True)
    assert not r.ok and (tmp_path / "m.onnx").is_file()
    assert any(f.code == "OM010" and f.severity.value == "warning" for f in r.findings)


def test_external_data_for_large_models(tmp_path, monkeypatch):
    from onnxmedic import onnxfile

    monkeypatch.setattr(onnxfile, "EXTERNAL_DATA_THRESHOLD", 100)
    r = onnxmedic.export(models.ConvLog1p(), (torch.randn(1, 3, 8, 8),), tmp_path / "big.onnx")
    _assert_verified(r)
    assert (tmp_path / "big.onnx.data").is_file()
    m = onnx.load(tmp_path / "big.onnx", load_external_data=False)
    locs = {e.value for init in m.graph.initializer for e in init.external_data
            if e.key == "location"}
    assert locs == {"big.onnx.data"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.onnx", "big.onnx.data"]


@pytest.mark.parametrize("kind", ["missing_folder", "is_folder"])
def test_unwritable_output_fails_fast(tmp_path, kind):
    f = tmp_path / "nope" / "m.onnx" if kind == "missing_folder" else tmp_path
    r = onnxmedic.export(models.ConvLog1p(), (torch.randn(1, 3, 8, 8),), f)
    (e,) = r.errors
    assert e.code == "OM006"
    assert r.stages["preflight"] == "not run"  # failed before the slow work


def test_reports_json_and_html(tmp_path):
    r = onnxmedic.export(models.NamedScript(), (torch.randn(2, 4),),
                         report=tmp_path / "r.html")
    assert r.ok
    html = (tmp_path / "r.html").read_text()
    assert "<script>alert(1)" not in html
    onnxmedic.export(models.DataDependentIf(), (torch.ones(3),), report=tmp_path / "r.json")
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["ok"] is False and d["failed_stage"] == "compare"
    (w,) = [f for f in d["findings"] if f["code"] == "OM114"]
    assert w["severity"] == "warning" and w["location"]["line"] > 0


def test_html_report_escapes_and_shows_snippet(tmp_path):
    r = onnxmedic.export(models.DataDependentIf(), (torch.ones(3),), report=tmp_path / "r.html")
    html = (tmp_path / "r.html").read_text()
    assert "OM114" in html and "x.sum() &gt; 0" in html
    assert 'class="hl"' in html and "http://" not in html.replace("http://www.w3.org", "")
    assert r.exit_code == 1


def test_training_mode_model_is_exported_in_eval_mode_and_restored():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.BatchNorm1d(4))
    m.train()
    r = onnxmedic.export(m, (torch.randn(3, 4),))
    _assert_verified(r)
    assert "OM011" in _codes(r)
    assert m.training


def test_exported_program_input(tmp_path):
    ep = torch.export.export(models.ConvLog1p(), (torch.randn(1, 3, 8, 8),))
    r = onnxmedic.export(ep, (torch.randn(1, 3, 8, 8),))
    _assert_verified(r)
    assert r.attempts[0]["strategy"] == "given ExportedProgram"


def test_caller_errors_raise():
    with pytest.raises(TypeError, match="nn.Module"):
        onnxmedic.export("not a model", (torch.ones(1),))
    with pytest.raises(TypeError, match="tuple"):
        onnxmedic.export(models.Identity(), {"x": 1})
    with pytest.raises(ValueError, match="target"):
        onnxmedic.export(models.Identity(), (torch.ones(1),), target="tpu")


def test_verify_api(tmp_path):
    from tests import onnx_models as om

    good = om.identity_model(tmp_path / "id.onnx")
    r = onnxmedic.verify(good, models.Identity(), (torch.randn(2, 3),))
    assert r.ok and r.exit_code == 0
    bad = om.scaled_model(tmp_path / "sc.onnx", 1.01)
    r = onnxmedic.verify(bad, models.Identity(), (torch.randn(2, 3),))
    assert not r.ok and r.errors[0].code == "OM601"
    trunc = tmp_path / "t.onnx"
    trunc.write_bytes(good.read_bytes()[:40])
    r = onnxmedic.verify(trunc, models.Identity(), (torch.randn(2, 3),))
    assert r.errors[0].code == "OM007"


def test_verify_hang_is_a_finding(tmp_path):
    from tests import onnx_models as om

    p = om.endless_loop_model(tmp_path / "hang.onnx")
    r = onnxmedic.verify(p, models.Identity(), (torch.randn(2, 3),), timeout=8)
    assert not r.ok and r.stages["runtime"] == "failed"
    assert r.errors[0].code == "OM512"


def test_explain_inventory_names_who_translates_each_op(registry_snapshot):
    @torch.library.custom_op("omtest::explained", mutates_args=())
    def explained(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(x.numpy() + 1)  # leaves PyTorch: cannot be inlined

    @explained.register_fake
    def _(x):
        return torch.empty_like(x)

    class M(torch.nn.Module):
        def forward(self, x):
            return torch.ops.omtest.explained(torch.special.erfinv(torch.tanh(x))) * 2

    r = onnxmedic.export(M(), (torch.randn(3, 4),), explain=True)
    assert not r.ok and r.stages["translate"] == "failed"
    by = {row["op"]: row for row in r.inventory}
    assert by["aten.special_erfinv.default"]["translated_by"] == "onnxmedic"
    assert by["aten.tanh.default"]["translated_by"] == "torchlib"
    assert by["omtest.explained.default"]["translated_by"] == "none"
    assert by["omtest.explained.default"]["count"] == 1
    assert "test_export.py" in by["omtest.explained.default"]["first_use"]


def test_cuda_target_without_cuda_says_it_verified_on_cpu():
    import onnxruntime as ort

    r = onnxmedic.export(models.CustomNorm(), (torch.randn(4, 8),), target="cuda")
    assert r.ok
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine has CUDA: nothing falls back")
    (f,) = [f for f in r.findings if f.code == "OM535"]
    assert "CUDAExecutionProvider" in f.message and "CPU" in f.message
    assert f.severity.value == "warning"
    r = onnxmedic.export(models.CustomNorm(), (torch.randn(4, 8),))
    assert "OM535" not in _codes(r)


def test_opset_conversion_is_verified_and_failure_is_not_silent():
    """torch.onnx keeps opset 18 with only a log warning when its version converter fails;
    onnxmedic says so (OM321) instead of returning a model of another opset."""
    x = (torch.randn(1, 3, 8, 8),)
    r = onnxmedic.export(models.ConvLog1p(), x, opset=21)
    assert r.ok and r.opset == 21 and "OM320" in [f.code for f in r.findings]
    assert r.onnx_model.opset_import[0].version == 21 or any(
        o.version == 21 for o in r.onnx_model.opset_import if o.domain == "")
    bad = onnxmedic.export(models.ConvLog1p(), x, opset=40)
    assert not bad.ok and [f.code for f in bad.errors] == ["OM321"]
    assert bad.stages["translate"] == "failed" and bad.stages["runtime"] == "not run"


def test_custom_op_made_of_torch_ops_is_inlined(registry_snapshot):
    """A torch.library custom op has no ONNX translation, so plain torch.onnx fails on it; its
    implementation is PyTorch ops, so onnxmedic inlines it (OM205) and the export verifies.
    An untraceable one next to it is still reported, with the reason."""

    @torch.library.custom_op("omtest::softclip", mutates_args=())
    def softclip(x: torch.Tensor, limit: float) -> torch.Tensor:
        return limit * torch.tanh(x / limit)

    @softclip.register_fake
    def _(x, limit):
        return torch.empty_like(x)

    @torch.library.custom_op("omtest::opaque", mutates_args=())
    def opaque(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(x.numpy().copy())

    @opaque.register_fake
    def _(x):
        return torch.empty_like(x)

    class Soft(torch.nn.Module):
        def forward(self, x):
            return torch.ops.omtest.softclip(x * 3, 2.0) + 1

    x = (torch.randn(4, 5),)
    with pytest.raises(Exception):
        torch.onnx.export(Soft(), x, dynamo=True, verbose=False)
    r = onnxmedic.export(Soft(), x)
    _assert_verified(r)
    (f,) = [f for f in r.findings if f.code == "OM205"]
    assert f.op == "omtest::softclip"

    class Both(torch.nn.Module):
        def forward(self, x):
            return torch.ops.omtest.opaque(torch.ops.omtest.softclip(x, 2.0))

    r = onnxmedic.export(Both(), x)
    assert not r.ok
    assert [f.op for f in r.findings if f.code == "OM205"] == ["omtest::softclip"]
    (err,) = r.errors
    assert err.code == "OM201" and err.op == "omtest.opaque.default"
    assert "could not be inlined" in err.message


def _item_cat(x, n):
    return torch.cat([torch.zeros(n), x]) * 2


def _item_narrow(x, n):
    return x.narrow(0, 0, n) * 2


def _item_pad(x, n):
    return torch.nn.functional.pad(x, (0, n))


def _item_slice_max(x, n):
    return x[: max(n, 1)] * 2


def _item_reshape(x, n):
    return x.reshape(n, -1).softmax(-1)


@pytest.mark.parametrize("fn", [_item_cat, _item_narrow, _item_pad, _item_slice_max,
                                _item_reshape], ids=lambda f: f.__name__[6:])
def test_item_driven_shapes_stay_data_dependent(tmp_path, fn):
    """Sizes from ``k.item()`` are captured as unbacked symbols by torch 2.13 (no specialisation,
    no torch._check needed): the ONNX model computes the right shape for another k too."""
    import onnxruntime as ort

    class M(torch.nn.Module):
        def forward(self, x, k):
            return fn(x, k.item())

    out = tmp_path / "m.onnx"
    r = onnxmedic.export(M(), (torch.randn(6), torch.tensor(2)), out)
    assert r.ok and "draft_export" not in r.attempts[-1]["strategy"]
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    for k in (2, 3):
        x = torch.randn(6)
        (got,) = sess.run(None, dict(zip(names, (x.numpy(), torch.tensor(k).numpy()))))
        torch.testing.assert_close(torch.from_numpy(got), M()(x, torch.tensor(k)))
