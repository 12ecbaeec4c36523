"""Size-keyed library caches switched off for the capture (capture.caches, OM118).

A stand-in library (tests/capture/_sizecache_lib.py) caches a plan under the sizes as Python
ints, like tensorly's opt_einsum plugin and einx's graph cache: under dynamic shapes the key
fixes the declared dims (OM401), and with the sizes kept symbolic it cannot be hashed. With its
switch in the table the capture bypasses the cache, the file runs at other sizes, and the
library's setting and cache are as a plain call leaves them. einx, with no switch, has its
elementwise calls over plain axis names computed with torch broadcasting (the same values as
einx's, checked against einx), and OM401 names any other einx call. The tensorly, einx and
neuraloperator tests need those libraries."""

from __future__ import annotations

import re

import pytest
import torch

import onnxmedic
from onnxmedic.capture import caches
from onnxmedic.capture.caches import CachesOff, CacheSwitch
from tests.capture import _sizecache_lib as lib


def _off(mod):
    was = mod.PLANNED
    mod.use_plain()
    return lambda: mod.use_planned() if was else mod.use_plain()


STANDIN = CacheSwitch("sizecache", lib.__name__, ("tests/capture/_sizecache_lib.py",),
                      "sizecache.use_plain()", "row_sums caches its plan under the sizes",
                      lambda mod: mod.PLANNED, _off, lambda mod: [mod.PLANS])


class RowSums(torch.nn.Module):
    def forward(self, x):
        return lib.row_sums(x * 2) + 1


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def fresh():
    lib.PLANS.clear()
    lib.use_planned()
    yield
    lib.PLANS.clear()
    lib.use_planned()


def test_without_the_switch_the_cache_fixes_the_dims(fresh, monkeypatch, tmp_path):
    monkeypatch.setattr(caches, "SWITCHES", [])
    r = onnxmedic.export(RowSums(), (_x(3, 5),), tmp_path / "m.onnx",
                         dynamic_shapes=({0: "b", 1: "n"},))
    assert not r.ok
    f = next(f for f in r.findings if f.code == "OM401")
    assert "_sizecache_lib.py" in f.message and "int(s) for s in x.shape" in f.message
    assert "OM118" not in [f.code for f in r.findings]
    # the attempt that kept the sizes symbolic could not hash them
    assert any("unhashable" in (a["error"] or "") for a in r.attempts), r.attempts


def test_switch_bypasses_the_cache_and_the_file_runs_at_other_sizes(fresh, monkeypatch,
                                                                    tmp_path):
    monkeypatch.setattr(caches, "SWITCHES", [STANDIN])
    model, x = RowSums(), _x(3, 5)
    model(x)  # a plain call fills the cache for the example's sizes
    plain = dict(lib.PLANS)
    r = onnxmedic.export(model, (x,), tmp_path / "m.onnx", dynamic_shapes=({0: "b", 1: "n"},))
    assert r.ok, [f.one_paragraph() for f in r.findings]
    (f,) = [f for f in r.findings if f.code == "OM118"]
    assert "sizecache.use_plain()" in f.message and f.details["switches"] == [
        "sizecache.use_plain()"]
    assert r.attempts[0]["ok"] is False
    assert r.attempts[-1]["strategy"] == "torch.export(strict=False), size-keyed caches off"
    # the library as plain calls leave it: cache on, plans of concrete sizes only (the
    # example's and those verification ran eagerly), none made of the trace's symbolic sizes
    assert lib.PLANNED is True and plain == {(3, 5): (3, 5)} and (3, 5) in lib.PLANS
    assert all(type(n) is int for k, v in lib.PLANS.items() for n in (*k, *v))
    assert all(v == (k[0], k[-1]) for k, v in lib.PLANS.items())
    # the written file at other sizes, in ONNX Runtime, against the eager model
    import onnxruntime as ort

    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    for shape in [(1, 1), (6, 10), (7, 13)]:
        xi = _x(*shape)
        (got,) = sess.run(None, {sess.get_inputs()[0].name: xi.numpy()})
        torch.testing.assert_close(torch.from_numpy(got), model(xi))


def test_switch_only_when_the_failure_is_in_the_cache_and_the_cache_is_on(fresh, monkeypatch):
    monkeypatch.setattr(caches, "SWITCHES", [STANDIN])

    class Failed:
        def __init__(self, error, specialised=None):
            self.error, self.specialised = error, specialised or {}

    def raised_in_lib():
        try:
            lib.row_sums(object())  # AttributeError inside the library's file
        except AttributeError as e:
            return e

    with CachesOff() as off:
        assert off.implicated(Failed(ValueError("elsewhere"))) == []
        assert off.implicated(Failed(raised_in_lib())) == [STANDIN]
        lib.use_plain()  # the user switched it off already: nothing to do
        assert off.implicated(Failed(raised_in_lib())) == []
        lib.use_planned()


def test_setting_and_cache_put_back_when_the_capture_raises(fresh, monkeypatch):
    monkeypatch.setattr(caches, "SWITCHES", [STANDIN])
    lib.PLANS[(2, 2)] = (2, 2)
    with pytest.raises(RuntimeError), CachesOff() as off:
        assert off.switch([STANDIN]) and off.on == ["sizecache.use_plain()"]
        assert lib.PLANNED is False
        lib.PLANS[("s0", 2)] = "a plan of the trace"
        raise RuntimeError("capture failed")
    assert lib.PLANNED is True and lib.PLANS == {(2, 2): (2, 2)}


def test_tensorly_opt_einsum_switched_off_and_restored():
    tl = pytest.importorskip("tensorly")
    pytest.importorskip("opt_einsum")
    from tensorly import plugins

    previous_backend = tl.get_backend()
    tl.set_backend("pytorch")
    # tensorly's state as this test found it (neuraloperator, if imported, turned the plugin
    # on): put back at the end
    backend_cls = type(tl.backend.current_backend())
    found = vars(backend_cls).get("einsum"), plugins.PREVIOUS_EINSUM
    try:
        plugins.use_opt_einsum("optimal")
        cls = type(tl.backend.current_backend())
        cached, previous = vars(cls)["einsum"], plugins.PREVIOUS_EINSUM
        a, b = torch.randn(3, 4), torch.randn(4, 5)
        tl.einsum("ij,jk->ik", a, b)
        store = dict(plugins.OPT_EINSUM_PATH_CACHE)
        (switch,) = [s for s in caches.SWITCHES if s.library == "tensorly"]
        with CachesOff() as off:
            assert off.switch([switch])
            assert plugins.PREVIOUS_EINSUM is None and vars(cls)["einsum"] is not cached
            torch.testing.assert_close(tl.einsum("ij,jk->ik", a, b), a @ b)
            plugins.OPT_EINSUM_PATH_CACHE["ij,jk->ik,(s0, 4),(4, 5)"] = None
        assert vars(cls)["einsum"] is cached and plugins.PREVIOUS_EINSUM is previous
        assert plugins.OPT_EINSUM_PATH_CACHE == store
    finally:
        plugins.use_default_einsum()
        if found[1] is not None:
            setattr(backend_cls, "einsum", found[0])
            plugins.PREVIOUS_EINSUM = found[1]
        tl.set_backend(previous_backend)


def test_om401_names_a_size_bound_librarys_line_the_call_into_it_and_the_change(
        fresh, monkeypatch, tmp_path):
    """A library that computes with Python ints by design (einx) and has no switch: OM401 says
    so, names its line and the call into it, and says what to change there."""
    bound = caches.SizeBound("sizecache", ("tests/capture/_sizecache_lib.py",),
                             "sizecache plans with Python ints", "Rewrite the call at {call}.")
    monkeypatch.setattr(caches, "SWITCHES", [])
    monkeypatch.setattr(caches, "SIZE_BOUND", [bound])
    r = onnxmedic.export(RowSums(), (_x(3, 5),), tmp_path / "m.onnx",
                         dynamic_shapes=({0: "b", 1: "n"},))
    assert not r.ok
    f = next(f for f in r.findings if f.code == "OM401")
    line = next(i for i, t in enumerate(open(lib.__file__), 1) if "int(s) for s in" in t)
    call = next(i for i, t in enumerate(open(__file__), 1) if "lib.row_sums(x * 2)" in t)
    assert f"sizecache fixes them at {lib.__file__}:{line}, called from {__file__}:{call}" \
        in f.message
    assert "sizecache plans with Python ints, so no capture can keep these dims dynamic" \
        in f.message
    assert f.suggestion == f"Rewrite the call at {__file__}:{call} (`return lib.row_sums(x * 2) + 1`)."
    assert f.details["size_bound"] == [{"library": "sizecache", "at": f"{lib.__file__}:{line}",
                                        "call": f"{__file__}:{call}"}]


def test_einx_call_outside_the_plain_subset_named_in_om401(tmp_path):
    einx = pytest.importorskip("einx")

    class Flat(torch.nn.Module):
        def forward(self, x):
            return einx.rearrange("b n d -> b (n d)", x) * 2

    r = onnxmedic.export(Flat(), (_x(2, 6, 4),), tmp_path / "m.onnx",
                         dynamic_shapes=({0: "b", 1: "n"},))
    assert not r.ok
    f = next(f for f in r.findings if f.code == "OM401")
    call = next(i for i, t in enumerate(open(__file__), 1) if 'einx.rearrange("b n d' in t)
    assert "einx fixes them at " in f.message and f"called from {__file__}:{call}" in f.message
    assert "einx/_src/frontend/impl/torch.py" in f.details["size_bound"][0]["at"]
    assert f"Write the einx call at {__file__}:{call}" in f.suggestion
    assert "x.masked_fill(~mask[..., None], 0.)" in f.suggestion


@pytest.mark.parametrize("description, ok", [
    ("b n, b n d, -> b n d", True), ("j, i -> 1 i j", True), ("i, j -> i j", True),
    ("b n h, b h n d -> b h n d", True),
    ("b n, b n d -> b n", False),  # d only in an input: a reduction
    ("b n, b n -> b n d", False),  # d in no input: its size must be given
    ("b (n d), d -> b n d", False), ("b [n], b -> b", False), ("... n, n -> ... n", False),
    ("b n, b n", False), ("b b, b -> b", False), ("1 n, n -> n", False),
])
def test_einx_plain_subset(description, ok):
    operands = [torch.zeros([2] * len(p.split())) if p.strip() else 0.0
                for p in description.split("->")[0].split(",")]
    assert (caches.einx_plain(description, tuple(operands)) is not None) is ok
    if ok:  # the same description with a tensor of the wrong rank goes to einx
        bad = (torch.zeros(2, 2, 2, 2, 2), *operands[1:])
        assert caches.einx_plain(description, bad) is None


def test_einx_calls_computed_with_torch_broadcasting_and_put_back():
    """A stand-in einx module: the plain calls are computed with torch, others go to it."""
    import types

    calls = []
    fake = types.ModuleType("einx_standin")

    def where(description, *operands):
        calls.append(description)
        return "einx"

    fake.where = where
    undo = caches.einx_off(fake)
    mask, x = torch.rand(2, 3) > 0.5, _x(2, 3, 4)
    out = fake.where("b n, b n d, -> b n d", mask, x, 0.0)
    torch.testing.assert_close(out, x.masked_fill(~mask[..., None], 0.0), rtol=0, atol=0)
    h = fake.where("n b, b n d, -> b n d", mask.T, x, -1)  # axes moved to the output's order
    torch.testing.assert_close(h, torch.where(mask[..., None], x, -1.0), rtol=0, atol=0)
    assert fake.where("b (n d), b n d, -> b n d", mask, x, 0.0) == "einx"
    assert calls == ["b (n d), b n d, -> b n d"]
    undo()
    assert fake.where is where


@pytest.mark.parametrize("op, description, shapes", [
    ("where", "b n, b n d, -> b n d", [(2, 5), (2, 5, 3), None]),
    ("subtract", "i, j -> i j", [(4,), (6,)]),
    ("subtract", "j, i -> 1 i j", [(4,), (3,)]),
    ("multiply", "b n h, b h n d -> b h n d", [(2, 5, 3), (2, 3, 5, 4)]),
    ("add", "b n, n b d -> d b n", [(2, 1), (1, 2, 3)]),
    ("add", "b n, -> n b", [(2, 3), None]),
    ("less", "j, i -> i j", [(5,), (1,)]),
])
def test_einx_plain_calls_equal_einx(op, description, shapes):
    einx = pytest.importorskip("einx")
    g = torch.Generator().manual_seed(3)
    operands = [0.5 if s is None else torch.randn(*s, generator=g) for s in shapes]
    if op == "where":
        operands[0] = operands[0] > 0
    expected = getattr(einx, op)(description, *operands)
    undo = caches.einx_off(einx)
    try:
        got = getattr(einx, op)(description, *operands)
    finally:
        undo()
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_einx_where_exports_with_dims_dynamic(tmp_path):
    einx = pytest.importorskip("einx")
    original = einx.where

    class Masked(torch.nn.Module):
        def forward(self, mask, x):
            return einx.where("b n, b n d, -> b n d", mask, x, 0.0) * 2

    model = Masked()
    mask = torch.rand(2, 6, generator=torch.Generator().manual_seed(1)) > 0.3
    r = onnxmedic.export(model, (mask, _x(2, 6, 4)), tmp_path / "m.onnx",
                         dynamic_shapes=({0: "b", 1: "n"}, {0: "b", 1: "n"}))
    assert r.ok, [f.one_paragraph() for f in r.findings]
    (f,) = [f for f in r.findings if f.code == "OM118"]
    assert f.details["switches"][0].startswith("einx's elementwise calls over plain axis names")
    assert einx.where is original
    import onnxruntime as ort

    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    for b, n in [(1, 1), (3, 7), (5, 13)]:
        m, x = torch.rand(b, n) > 0.5, _x(b, n, 4)
        (got,) = sess.run(None, dict(zip(names, (m.numpy(), x.numpy()), strict=True)))
        torch.testing.assert_close(torch.from_numpy(got), model(m, x), rtol=0, atol=0)


def test_neuralop_fno_exports_past_tensorlys_cache_and_leaves_it_on(tmp_path):
    """neuraloperator turns tensorly's opt_einsum plugin on when imported; the capture switches
    it off (OM118) and puts it back; FNO then exports with its minimum sizes (OM408)."""
    pytest.importorskip("neuralop")
    import tensorly as tl
    from neuralop.models import FNO
    from tensorly import plugins

    torch.manual_seed(0)
    model = FNO(n_modes=(4, 4), hidden_channels=8, in_channels=1, out_channels=1,
                n_layers=2).eval()
    cls = type(tl.backend.current_backend())
    cached, previous = vars(cls)["einsum"], plugins.PREVIOUS_EINSUM
    assert previous is not None  # neuralop's use_opt_einsum("optimal")
    store = dict(plugins.OPT_EINSUM_PATH_CACHE)
    r = onnxmedic.export(model, (_x(2, 1, 16, 16),), tmp_path / "m.onnx",
                         dynamic_shapes=({0: "batch", 2: "height", 3: "width"},))
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert vars(cls)["einsum"] is cached and plugins.PREVIOUS_EINSUM is previous
    assert set(store) <= set(plugins.OPT_EINSUM_PATH_CACHE)
    # no plan keyed on the trace's symbolic sizes (s0, u1) left behind
    assert not [k for k in plugins.OPT_EINSUM_PATH_CACHE if re.search(r"\b[su]\d+\b", k)]
    strategies = [a["strategy"] for a in r.attempts]
    assert strategies[:2] == ["torch.export(strict=False)",
                              "torch.export(strict=False), size-keyed caches off"], strategies
    assert all(s.endswith(", size-keyed caches off") for s in strategies[1:]), strategies
    (f,) = [f for f in r.findings if f.code == "OM118"]
    assert f.details["switches"] == ["tensorly.plugins.use_default_einsum()"]
    rules = {f.details["dim"]: f.details["rule"] for f in r.findings if f.code == "OM408"}
    assert sorted(rules) == ["height", "width"], rules
