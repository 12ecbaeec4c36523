"""The zoo's independent size check (onnxmedic.sweep.sizes): a written file is run at the sizes
the user declared dynamic, apart from the export's own verification; a file that fixed a
declared dim, or computes another size wrong, fails it."""

from __future__ import annotations

import onnx
import pytest
import torch
from onnx import numpy_helper

import onnxmedic
from onnxmedic.sweep import ZooCase
from onnxmedic.sweep.sizes import (
    check_sizes,
    declared_dims,
    dim_objects,
    size_check,
    with_size_check,
)


class MaskedSum(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, mask, extra=None):
        h = self.lin(x) * mask[..., None]
        return h.sum(1) / mask.sum(1, keepdim=True)


def _case() -> ZooCase:
    x = torch.randn(2, 6, 4)
    mask = torch.ones(2, 6)
    dyn = {"x": {0: "batch", 1: "seq"}, "mask": {0: "batch", 1: "seq"}}
    return ZooCase(MaskedSum().eval(), (x,), {"mask": mask}, dyn)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    case = _case()
    path = tmp_path_factory.mktemp("sizes") / "m.onnx"
    r = onnxmedic.export(case.model, case.args, path, kwargs=case.kwargs,
                         dynamic_shapes=case.dynamic_shapes)
    assert r.ok, [f.one_paragraph() for f in r.findings]
    return path


def test_sizes_are_one_the_example_twice_and_a_prime():
    assert check_sizes(2) == [1, 2, 4, 5]
    assert check_sizes(8) == [1, 8, 16, 17]
    assert check_sizes(1) == [1, 2, 3]


def test_dim_objects_one_dim_per_name():
    spec = {"a": {0: "batch", 1: "seq"}, "b": [{0: "batch"}, None, {2: "past"}], "c": None}
    out = dim_objects(spec)
    assert out["a"][0] is out["b"][0][0]  # the same name is the same Dim
    assert out["a"][0].__name__ == "batch" and out["b"][2][2].__name__ == "past"
    assert out["b"][1] is None and out["c"] is None and isinstance(out["b"], list)


def test_declared_dims_follow_names_positions_and_nesting():
    case = _case()
    got = declared_dims(case.model, case.args, case.kwargs, case.dynamic_shapes)
    assert got == {"batch": [(0, 0), (1, 0)], "seq": [(0, 1), (1, 1)]}
    # a positional tuple spec with a nested list, as the zoo's decoder steps write it
    past = [torch.zeros(2, 1, 5, 3), torch.zeros(2, 1, 5, 3)]
    ids = torch.zeros(2, 3, dtype=torch.long)

    class Step(torch.nn.Module):
        def forward(self, ids, past):
            return ids

    spec = ({0: "batch", 1: "seq"}, [{0: "batch", 2: "past"}, {0: "batch", 2: "past"}])
    got = declared_dims(Step(), (ids, past), {}, dim_objects(spec))
    assert got == {"batch": [(0, 0), (1, 0), (2, 0)], "seq": [(0, 1)],
                   "past": [(1, 2), (2, 2)]}


def test_written_dynamic_file_passes_at_every_declared_size(written):
    out = size_check(str(written), _case())
    assert out["ok"], out
    assert out["symbols"] == ["batch", "seq"]
    assert set(out["sizes"]) == {"batch=1", "batch=2", "batch=4", "batch=5",
                                 "seq=1", "seq=6", "seq=12", "seq=13"}
    assert out["checked"] == 8


def test_a_file_that_fixed_the_mask_dim_fails(written, tmp_path):
    """The seeds' case: the mask's batch came out fixed in the file. The export's own
    verification follows the file's dims and cannot see it; the size check does."""
    m = onnx.load(written)
    mask = next(i for i in m.graph.input if i.name == "mask")
    mask.type.tensor_type.shape.dim[0].ClearField("dim_param")
    mask.type.tensor_type.shape.dim[0].dim_value = 2
    onnx.save(m, tmp_path / "fixed.onnx")
    out = size_check(str(tmp_path / "fixed.onnx"), _case())
    assert not out["ok"]
    assert out["sizes"]["seq=13"] == "ok"  # only the fixed symbol fails
    assert out["sizes"]["batch=1"].startswith("failed") and "mask" in out["sizes"]["batch=1"]
    assert "declared dynamic" in out["message"] and "batch=1" in out["message"]


def test_a_file_wrong_at_another_size_fails(written, tmp_path):
    """A divisor baked in as the example's sequence length: right at seq=6 only."""
    m = onnx.load(written)
    div = next(n for n in m.graph.node if n.op_type == "Div")
    m.graph.initializer.append(numpy_helper.from_array(
        torch.full((1, 1), 6.0).numpy(), "baked_six"))
    div.input[1] = "baked_six"
    onnx.save(m, tmp_path / "baked.onnx")
    out = size_check(str(tmp_path / "baked.onnx"), _case())
    assert not out["ok"]
    assert out["sizes"]["seq=6"] == "ok" and out["sizes"]["batch=5"] == "ok"
    assert all(out["sizes"][f"seq={n}"].startswith("failed: output") for n in (1, 12, 13))


def test_sizes_pytorch_rejects_are_skipped(tmp_path):
    class EvenOnly(torch.nn.Module):
        def forward(self, x):
            torch._check(x.shape[0] % 2 == 0)
            return x.reshape(-1, 2, x.shape[1]).sum(1)

    x = torch.randn(4, 3)
    path = tmp_path / "even.onnx"
    r = onnxmedic.export(EvenOnly(), (x,), path, dynamic_shapes={"x": {0: "n"}})
    if not r.ok:
        pytest.skip("torch.export does not keep this guard: " + str([f.code for f in r.findings]))
    out = size_check(str(path), ZooCase(EvenOnly(), (x,), {}, {"x": {0: "n"}}))
    assert out["sizes"]["n=1"].startswith("skipped") and out["sizes"]["n=11"].startswith("skip")
    assert out["sizes"]["n=8"] == "ok" and out["ok"]


def test_with_size_check_keeps_the_entry_own_check(written):
    calls = []

    def make() -> ZooCase:
        case = _case()
        case.check = lambda p, c: calls.append(p) or {"ok": True, "steps": 3}
        return case

    case = with_size_check(make, dims=True)()
    assert case.dynamic_shapes["x"][0].__name__ == "batch"
    out = case.check(str(written), case)
    assert calls == [str(written)] and out["steps"] == 3 and out["ok"]
    assert out["size_check"]["checked"] == 8
    # the entry's own check failing fails the whole check
    bad = with_size_check(lambda: ZooCase(**{**_case().__dict__,
                                             "check": lambda p, c: {"ok": False,
                                                                    "message": "no"}}))()
    got = bad.check(str(written), bad)
    assert not got["ok"] and got["message"] == "no" and got["size_check"]["ok"]
