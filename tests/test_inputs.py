"""Model and input specs resolve, or fail with a clear finding code."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch

from onnxmedic import inputs
from onnxmedic.findings import InputError
from onnxmedic.verify.input_sets import derived_input_sets
from tests import hostile_files as hf

HERE = os.path.dirname(__file__)
MODELS = os.path.join(HERE, "models.py")


def code_of(excinfo) -> str:
    return excinfo.value.finding.code


@pytest.mark.parametrize("attr", ["ConvLog1p", "make_model"])
def test_file_spec_class_and_factory(attr):
    model, src = inputs.load_model(f"{MODELS}:{attr}")
    assert isinstance(model, torch.nn.Module)
    assert src.kind == "file" and src.attr == attr


def test_module_spec_and_instance():
    model, src = inputs.load_model("tests.models:ConvLog1p")
    assert isinstance(model, torch.nn.Module) and src.kind == "module"


def test_pt2_spec(tmp_path):
    ep = torch.export.export(torch.nn.Linear(3, 2), (torch.randn(1, 3),))
    torch.export.save(ep, tmp_path / "m.pt2")
    model, src = inputs.load_model(str(tmp_path / "m.pt2"))
    assert isinstance(model, torch.export.ExportedProgram) and src.kind == "pt2"


@pytest.mark.parametrize(("spec", "code", "words"), [
    ("missing/dir/model.py:M", "OM001", "does not exist"),
    (f"{MODELS}:NoSuchThing", "OM002", "no attribute 'NoSuchThing'"),
    ("no_such_pkg_xyz.mod:M", "OM002", "no Python module"),
    (f"{MODELS}:not_a_model", "OM003", "not a model"),
    (f"{MODELS}", "OM004", "names a file but no attribute"),
    ("", "OM004", "empty model spec"),
    ("nothing.pt2", "OM001", "does not exist"),
])
def test_bad_model_specs(spec, code, words):
    with pytest.raises(InputError) as ei:
        inputs.load_model(spec)
    assert code_of(ei) == code
    assert words in str(ei.value)


def test_missing_attr_lists_models_found():
    with pytest.raises(InputError) as ei:
        inputs.load_model(f"{MODELS}:ConvLogp")
    assert "ConvLog1p" in str(ei.value)


def test_file_that_raises_on_import(tmp_path):
    f = tmp_path / "broken.py"
    f.write_text("raise RuntimeError('boom at import')\n")
    with pytest.raises(InputError) as ei:
        inputs.load_model(f"{f}:M")
    assert code_of(ei) == "OM002" and "boom at import" in str(ei.value)


def test_pt2_that_is_not_a_program(tmp_path):
    (tmp_path / "x.pt2").write_bytes(b"not a zip")
    with pytest.raises(InputError) as ei:
        inputs.load_model(str(tmp_path / "x.pt2"))
    assert code_of(ei) == "OM003"


@pytest.mark.parametrize(("spec", "shape", "dtype"), [
    ("2x3x4:float32", (2, 3, 4), torch.float32),
    ("7", (7,), torch.float32),
    ("2x2:int64", (2, 2), torch.int64),
    ("3:bool", (3,), torch.bool),
    ("scalar:float64", (), torch.float64),
    ("1x4:bf16", (1, 4), torch.bfloat16),
    ("0x3:float32", (0, 3), torch.float32),
])
def test_shape_specs(spec, shape, dtype):
    ex = inputs.load_inputs([spec])
    (t,) = ex.args
    assert tuple(t.shape) == shape and t.dtype == dtype


def test_shape_spec_range_and_seed():
    a = inputs.load_inputs(["100:float32@-1,1"]).args[0]
    assert a.min() >= -1 and a.max() <= 1
    b = inputs.load_inputs(["100:float32@-1,1"]).args[0]
    assert torch.equal(a, b)  # seeded
    c = inputs.load_inputs(["100:float32@-1,1"], seed=5).args[0]
    assert not torch.equal(a, c)


@pytest.mark.parametrize("spec", ["2x:float32", "2x3:float99", "abc", "2x3:float32@1,0",
                                  "-1x3", "2x3:float32@x,y", " "])
def test_malformed_shape_specs(spec):
    with pytest.raises(InputError) as ei:
        inputs.load_inputs([spec])
    assert code_of(ei) == "OM004"
    assert ei.value.finding.exit_code == 2


def test_make_inputs_function_args_and_kwargs():
    ex = inputs.load_inputs([f"{MODELS}:make_kwargs_inputs"])
    assert len(ex.args) == 1 and set(ex.kwargs) == {"mask"}


def test_npz_positional_and_named(tmp_path):
    np.savez(tmp_path / "pos.npz", np.ones((2, 3), np.float32), np.zeros(2, np.int64))
    ex = inputs.load_inputs([str(tmp_path / "pos.npz")])
    assert [tuple(a.shape) for a in ex.args] == [(2, 3), (2,)]
    np.savez(tmp_path / "named.npz", x=np.ones((2, 3), np.float32))
    ex = inputs.load_inputs([str(tmp_path / "named.npz")])
    assert list(ex.kwargs) == ["x"]


def test_npz_with_objects_is_refused(tmp_path):
    np.savez(tmp_path / "obj.npz", a=np.array([{"x": 1}], dtype=object))
    with pytest.raises(InputError) as ei:
        inputs.load_inputs([str(tmp_path / "obj.npz")])
    assert code_of(ei) == "OM005"


def test_pt_tensors_load(tmp_path):
    torch.save((torch.ones(2), torch.zeros(3)), tmp_path / "in.pt")
    ex = inputs.load_inputs([str(tmp_path / "in.pt")])
    assert len(ex.args) == 2


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/onnxmedic_pwned_marker",))


def test_pt_pickle_with_code_is_refused_and_not_run(tmp_path):
    marker = "/tmp/onnxmedic_pwned_marker"
    if os.path.exists(marker):
        os.unlink(marker)
    with open(tmp_path / "evil.pt", "wb") as fh:
        pickle.dump(_Evil(), fh)
    with pytest.raises(InputError) as ei:
        inputs.load_inputs([str(tmp_path / "evil.pt")])
    assert code_of(ei) == "OM005"
    assert "refused" in str(ei.value) or "cannot read" in str(ei.value)
    assert not os.path.exists(marker)


def test_missing_input_file():
    with pytest.raises(InputError) as ei:
        inputs.load_inputs(["nope/inputs.npz"])
    assert code_of(ei) == "OM005"


def test_derived_sets_keep_shapes_dtypes_and_domain():
    x = torch.rand(50) * 1.8 - 0.9
    idx = torch.randint(0, 5, (10,))
    sets = derived_input_sets(inputs.Inputs((x, idx), {}), 2)
    assert len(sets) == 2
    for s in sets:
        a, i = s.args
        assert a.shape == x.shape and a.dtype == x.dtype
        assert a.min() >= x.min() and a.max() <= x.max()
        assert i.dtype == idx.dtype and sorted(i.tolist()) == sorted(idx.tolist())
        assert not torch.equal(a, x)


@pytest.mark.parametrize(("specs", "expected"), [
    (["x:0=batch"], {"x": {0: "batch"}}),
    (["x:0=batch,2=h", "mask:0=batch"], {"x": {0: "batch", 2: "h"}, "mask": {0: "batch"}}),
])
def test_dynamic_specs(specs, expected):
    assert inputs.parse_dynamic_specs(specs) == expected


@pytest.mark.parametrize("spec", ["x", "x:batch", "x:0", "0=batch", "x:a=b"])
def test_bad_dynamic_specs(spec):
    with pytest.raises(InputError) as ei:
        inputs.parse_dynamic_specs([spec])
    assert code_of(ei) == "OM004"


def test_dynamic_names_checked_against_forward():
    from tests.models import PoolView

    m = PoolView()
    x = torch.randn(2, 3, 8, 8)
    assert inputs.complete_dynamic_shapes(m, {"x": {0: "b"}}, (x,), {}) == {"x": {0: "b"}}
    with pytest.raises(InputError, match="not among forward"):
        inputs.complete_dynamic_shapes(m, {"y": {0: "b"}}, (x,), {})
    with pytest.raises(InputError, match="rank 4"):
        inputs.complete_dynamic_shapes(m, {"x": {5: "b"}}, (x,), {})


# ------------------------------------------------------------------ hostile .pt2 archives

@pytest.mark.parametrize("attack", hf.PT2_ATTACKS)
def test_pt2_with_code_is_refused_and_not_run(tmp_path, attack):
    """torch.export.load itself unpickles these with code execution allowed (torch 2.13
    pt2_archive/_package.py uses weights_only=False / pickle.loads); onnxmedic must not."""
    marker = tmp_path / "pwned"
    bad = hf.hostile_pt2(tmp_path / "bad.pt2", attack, marker)
    with pytest.raises(InputError) as ei:
        inputs.load_model(str(bad))
    assert code_of(ei) == "OM003"
    assert not marker.exists(), "code from the .pt2 ran"
    # the guard is gone afterwards: torch.load is torch's own again
    assert torch.load.__module__ == "torch.serialization"
    # and the file really is hostile: plain torch.export.load runs its code
    try:
        torch.export.load(bad)
    except Exception:
        pass
    assert marker.exists()


def test_pt2_plain_archive_still_loads(tmp_path):
    ep, src = inputs.load_model(str(hf.plain_pt2(tmp_path / "good.pt2")))
    assert src.kind == "pt2"
    x = torch.randn(1, 2)
    assert ep.module()(x).shape == (1, 2)


@pytest.mark.parametrize("damage", ["truncated", "not-a-zip", "empty"])
def test_damaged_pt2_is_a_finding(tmp_path, damage):
    data = hf.plain_pt2(tmp_path / "good.pt2").read_bytes()
    bad = tmp_path / "bad.pt2"
    bad.write_bytes({"truncated": data[: len(data) // 2], "not-a-zip": b"hello" * 50,
                     "empty": b""}[damage])
    with pytest.raises(InputError) as ei:
        inputs.load_model(str(bad))
    assert code_of(ei) == "OM003"


@pytest.mark.parametrize("spec,expected", [
    (["auto"], "auto"),
    (["{'x': [0, 2]}"], {"x": {0: "x_dim0", 2: "x_dim2"}}),
    (['{"x": {0: "batch"}, "m": [1]}'], {"x": {0: "batch"}, "m": {1: "m_dim1"}}),
    (["{'x': [0]}", "y:1=seq"], {"x": {0: "x_dim0"}, "y": {1: "seq"}}),
])
def test_dynamic_spec_forms(spec, expected):
    assert inputs.parse_dynamic_specs(spec) == expected


@pytest.mark.parametrize("spec", ["{'x': [-1]}", "{'x': 'batch'}", "{1: [0]}", "{'x': [0]",
                                  "{'x': {0: 'a b'}}", "{'x': [True]}", "{" * 500])
def test_bad_dynamic_axes(spec):
    with pytest.raises(InputError) as ei:
        inputs.parse_dynamic_specs([spec])
    assert code_of(ei) == "OM004"
