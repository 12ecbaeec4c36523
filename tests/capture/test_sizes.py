"""Sizes kept symbolic where code makes Python numbers or constant tensors of them
(capture.sizes, OM127): ``float(w - 1) / 2`` in ``torch.tensor`` (kornia's rotation centre),
``int(n * 0.5)``, ``torch.as_tensor(3 * n / 4)`` (julius' output length) and
``torch.linspace(-1, 1, n)``. Each exports with the dims dynamic and verifies at other sizes
(1, twice, a prime); without the recovery each is OM401 or OM402."""

from __future__ import annotations

import sys

import pytest
import torch

import onnxmedic
from onnxmedic.capture import sizes, strategies
from onnxmedic.capture.sizes import Kept, sizes_stay_symbolic, symbolic_factories
from onnxmedic.verify.input_sets import next_prime


class Centre(torch.nn.Module):
    """kornia's rotation: the centre of an image as a tensor of Python floats
    (``_compute_tensor_center``) and a base grid over the width (``warp_affine``). The strict
    capture traces ``float()`` symbolically but fixes linspace's steps; the non-strict one
    fixes both."""

    def forward(self, x):
        h, w = x.shape[-2:]
        centre = torch.tensor([float(w - 1) / 2, float(h - 1) / 2])
        grid = torch.linspace(-1.0, 1.0, w)
        return (x - centre[0]) * centre[1] + grid


class Half(torch.nn.Module):
    """A length made an int from a float size."""

    def forward(self, x):
        return x[:, : int(x.shape[1] * 0.5)] * 2


class OutputLength(torch.nn.Module):
    """julius' ResampleFrac: the output length a tensor of a float size, then a slice by it."""

    def forward(self, x):
        length = torch.as_tensor(3 * x.shape[-1] / 4)
        n = torch.floor(length).long()
        return (x / torch.as_tensor(x.shape[-1] * 0.5))[..., :n]


class Ramp(torch.nn.Module):
    """A coordinate axis over the input's width (kornia's warp_affine base grid)."""

    def forward(self, x):
        return x * torch.linspace(-1.0, 1.0, x.shape[-1])


CASES = [
    (Centre(), (2, 3, 8, 10), {2: "h", 3: "w"}, "centre = torch.tensor([float(w - 1) / 2",
     "OM401"),
    # torch.export takes a guard on int(0.5 * n) it cannot solve for n and drops it: the
    # example's length is baked in without a word
    (Half(), (2, 9), {0: "b", 1: "n"}, "return x[:, : int(x.shape[1] * 0.5)]", "OM402"),
    (OutputLength(), (2, 400), {0: "b", 1: "n"},
     "length = torch.as_tensor(3 * x.shape[-1] / 4)", "OM402"),
    (Ramp(), (2, 10), {0: "b", 1: "w"}, "return x * torch.linspace(-1.0, 1.0, x.shape[-1])",
     "OM401"),
]


@pytest.mark.parametrize("model, shape, dims, line, before", CASES,
                         ids=[type(c[0]).__name__ for c in CASES])
def test_sizes_made_numbers_stay_dynamic(tmp_path, model, shape, dims, line, before):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    r = onnxmedic.export(model, (x,), tmp_path / "m.onnx", dynamic_shapes=(dims,))
    assert r.ok, [f.one_paragraph() for f in r.findings]
    (f,) = [f for f in r.findings if f.code == "OM127"]
    assert f.location.file == __file__ and f.location.code.startswith(line), f.location
    assert f"{__file__}:{f.location.line}" in f.message
    # the export's own verification ran each dynamic dim at other sizes, 1 included
    sets = {c.input_set for c in r.verification}
    name = dims[max(dims)]
    assert {f"{name}=1", f"{name}={next_prime(shape[max(dims)])}"} <= sets, sets
    assert all(c.ok for c in r.verification)


@pytest.mark.parametrize("model, shape, dims, line, before", CASES,
                         ids=[type(c[0]).__name__ for c in CASES])
def test_without_the_recovery_the_size_is_fixed(monkeypatch, model, shape, dims, line, before):
    """The same models fail without capture.sizes: OM401 (torch.export refuses the dim) or
    OM402 (torch.as_tensor or an int() baked the example's value in without a guard)."""

    @__import__("contextlib").contextmanager
    def off(*a, **k):
        yield

    monkeypatch.setattr(strategies, "CAPTURE_STRATEGIES", [
        s for s in strategies.CAPTURE_STRATEGIES if s is not strategies.SymbolicSizes])
    monkeypatch.setattr(sizes, "symbolic_factories", off)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    r = onnxmedic.export(model, (x,), dynamic_shapes=(dims,))
    assert not r.ok
    assert before in {f.code for f in r.findings}, [f.code for f in r.findings]


def test_patches_are_scoped():
    """torch's factories and the module's builtins are as they were after the block."""
    mod = sys.modules[__name__]
    before = (torch.as_tensor, torch.asarray, torch.linspace)
    rec = Kept()
    with symbolic_factories(rec), sizes_stay_symbolic([__name__], rec):
        assert torch.as_tensor is not before[0] and torch.linspace is not before[2]
        shadow_float, shadow_int = vars(mod)["float"], vars(mod)["int"]
        # every other argument: the builtin's result; isinstance means the builtin
        assert type(shadow_float("1.5")) is type(1.5) and shadow_int("7", 8) == 7
        assert isinstance(1.5, shadow_float) and not isinstance(1, shadow_float)
        assert isinstance(True, shadow_int) and issubclass(bool, shadow_int)
        assert torch.as_tensor([1, 2]).dtype == torch.int64
        assert torch.equal(torch.linspace(0, 1, 5), before[2](0, 1, 5))
    assert (torch.as_tensor, torch.asarray, torch.linspace) == before
    assert "float" not in vars(mod) and "int" not in vars(mod)
    assert rec.modules == [__name__] and not rec.lines


def test_a_module_that_compares_types_keeps_its_builtins():
    """``type(v) is int`` would answer differently with a shadowing class: such a module is
    left alone (its line then fixes the dim as before)."""
    name = "int"
    assert sizes.compares_types(f"if type(v) is {name}:\n    pass", name)
    assert sizes.compares_types(f"ok = type(v) in ({name}, bool)", name)
    assert not sizes.compares_types(f"ok = isinstance(v, ({name}, float))", name)
    assert not sizes.compares_types(f"n: {name} = {name}(x)", name)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 24, 101])
@pytest.mark.parametrize("ends", [(-1.0, 1.0), (0.3, 17.1)])
def test_symbolic_linspace_matches_torch(n, ends):
    """Same values as torch.linspace to the last bit of float32 rounding, both ends exact."""
    a, b = ends
    ref = torch.linspace(a, b, n)
    got = sizes.linspace_symbolic(a, b, n, torch.float32, None)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    torch.testing.assert_close(got, ref, rtol=2.0**-23, atol=2.0**-23 * max(abs(a), abs(b)))
    if n > 1:
        assert got[0] == a and got[-1] == torch.tensor(b)


def test_kornia_rotate_captures_with_the_size_dynamic():
    """kornia.geometry.rotate: the centre is ``float(width - 1) / 2`` (affwarp.py) and the
    base grid a linspace over the width (imgwarp.py): captured with height and width dynamic
    by keeping both symbolic."""
    kornia = pytest.importorskip("kornia")
    from torch.export import Dim

    class Rotate(torch.nn.Module):
        def forward(self, x):
            return kornia.geometry.transform.rotate(x, torch.full((x.shape[0],), 30.0))

    x = torch.rand(2, 3, 24, 32, generator=torch.Generator().manual_seed(0))
    dims = ({0: Dim.DYNAMIC, 2: Dim.DYNAMIC, 3: Dim.DYNAMIC},)
    attempts = strategies.capture(Rotate(), (x,), {}, dims)
    assert attempts[-1].ok, [a.summary() for a in attempts]
    assert attempts[-1].strategy == strategies.SymbolicSizes.name
    kept = {(f.rsplit("/", 1)[-1], w.split()[0]) for f, _, _, w in attempts[-1].kept.lines}
    assert {("affwarp.py", "float()"), ("imgwarp.py", "torch.linspace")} <= kept, kept
    program = attempts[-1].program
    y = torch.rand(3, 3, 17, 41, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(program.module()(y), Rotate()(y), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model, shape, dims, line, before", [CASES[0], CASES[3]],
                         ids=["Centre", "Ramp"])
def test_recovery_works_in_a_program_that_silenced_logging(tmp_path, model, shape, dims, line,
                                                           before):
    """A notebook's ``logging.disable(logging.WARNING)`` stopped torch from making the INFO
    records that name the line which fixed a dim, so the recovery never started (OM401: what
    the ecosystem benchmark saw on kornia's rotate). The program's setting is kept."""
    import logging

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    logging.disable(logging.WARNING)
    try:
        r = onnxmedic.export(model, (x,), tmp_path / "m.onnx", dynamic_shapes=(dims,))
        assert logging.root.manager.disable == logging.WARNING
        log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
        assert not log.isEnabledFor(logging.INFO) and "isEnabledFor" not in vars(log)
    finally:
        logging.disable(logging.NOTSET)
    assert r.ok, [f.one_paragraph() for f in r.findings]
    (f,) = [f for f in r.findings if f.code == "OM127"]
    assert f.location.code.startswith(line)
