"""Size-keyed library caches switched off for the capture (capture.caches, OM118).

A stand-in library (tests/capture/_sizecache_lib.py) caches a plan under the sizes as Python
ints, like tensorly's opt_einsum plugin and einx's graph cache: under dynamic shapes the key
fixes the declared dims (OM401), and with the sizes kept symbolic it cannot be hashed. With its
switch in the table the capture bypasses the cache, the file runs at other sizes, and the
library's setting and cache are as a plain call leaves them. The tensorly test needs tensorly."""

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


def test_einx_call_named_in_om401(tmp_path):
    einx = pytest.importorskip("einx")

    class Masked(torch.nn.Module):
        def forward(self, mask, x):
            return einx.where("b n, b n d, -> b n d", mask, x, 0.0)

    mask = torch.ones(2, 6, dtype=torch.bool)
    r = onnxmedic.export(Masked(), (mask, _x(2, 6, 4)), tmp_path / "m.onnx",
                         dynamic_shapes=({0: "b", 1: "n"}, {0: "b", 1: "n"}))
    assert not r.ok
    f = next(f for f in r.findings if f.code == "OM401")
    call = next(i for i, t in enumerate(open(__file__), 1) if 'einx.where("b n, b n d' in t)
    assert "einx fixes them at " in f.message and f"called from {__file__}:{call}" in f.message
    assert "einx/_src/frontend/impl/torch.py" in f.details["size_bound"][0]["at"]
    assert f"Write the einx call at {__file__}:{call}" in f.suggestion
    assert "x.masked_fill(~mask[..., None], 0.)" in f.suggestion


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
