"""A dynamic-shape spec must name something (issue 41): a dynamic_axes key or dynamic_shapes
entry that matches no input of forward(), or a positional spec longer than the inputs, is an
error listing the inputs that exist (API: ValueError before anything runs; CLI: OM004, exit
2) - never a key dropped and a static file."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.export import Dim

import onnxmedic
from onnxmedic import inputs


class Two(nn.Module):
    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return x * 2 if mask is None else x * mask


X = torch.ones(4, 3)


@pytest.mark.parametrize("spec", [
    {"input_1": [0]},  # torch.onnx's dynamic_axes, a stale default name
    {"x": [0], "output": [0]},  # an output's entry: not an input
    {"input_1": {0: "batch"}},  # dynamic_axes with names
    {"y": {0: Dim("b")}},  # torch.export's form, a wrong name
    {"mask": {0: "batch"}},  # a parameter of forward() given no example input
])
def test_a_key_that_names_no_input_is_a_value_error_listing_the_inputs(spec) -> None:
    with pytest.raises(ValueError, match=r"not among forward\(\)'s inputs.*x \(position 0\)"):
        onnxmedic.export(Two(), (X,), dynamic_shapes=spec)


@pytest.mark.parametrize("spec", [({0: "batch"}, {0: "n"}), [{0: "batch"}, None],
                                  ({0: "batch"}, None, None)])
def test_a_positional_spec_longer_than_the_inputs_is_a_value_error(spec) -> None:
    with pytest.raises(ValueError, match="positional entries but the model is given 1 input"):
        onnxmedic.export(Two(), (X,), dynamic_shapes=spec)


def test_specs_that_name_inputs_pass_the_check() -> None:
    ok = [None, "auto", {"x": [0]}, {"x": {0: "batch"}}, ({0: "batch"},), ({0: "b"}, None)]
    for spec in ok[:5]:
        assert inputs.dynamic_names_problem(Two(), spec, (X,), {}) is None
    assert inputs.dynamic_names_problem(Two(), ok[5], (X, X), {}) is None
    assert inputs.dynamic_names_problem(Two(), {"mask": [0]}, (X,), {"mask": X}) is None


def test_a_valid_spec_still_exports_dynamic() -> None:
    result = onnxmedic.export(Two(), (X,), dynamic_shapes={"x": [0]}, verify=False)
    assert result.ok
    dim0 = result.onnx_model.graph.input[0].type.tensor_type.shape.dim[0]
    assert dim0.dim_param


def test_cli_names_nothing_exits_2_listing_the_inputs(tmp_path) -> None:
    p = subprocess.run([sys.executable, "-m", "onnxmedic", "export", "tests/models.py:PoolView",
                        "--input", "2x3x8x8", "--dynamic", "{'input_1': [0]}", "--json",
                        "-o", str(tmp_path / "m.onnx")], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2, p.stderr
    found = json.loads(p.stdout)["findings"]
    assert found[0]["code"] == "OM004"
    assert "input_1" in found[0]["message"] and "x (position 0)" in found[0]["message"]
    assert not (tmp_path / "m.onnx").exists()
