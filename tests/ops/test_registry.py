"""The translation registry: keyed by real op objects, bad keys rejected with the fix,
duplicates warn, user entries win, one broken family never breaks the rest."""

from __future__ import annotations

import types

import pytest
import torch

from onnxmedic.ops import RegistrationError, TranslationRegistry, resolve_target, translation


def test_keys_resolve_to_overloads():
    assert resolve_target(torch.ops.aten.hypot.default) is torch.ops.aten.hypot.default
    assert resolve_target(torch.ops.aten.hypot) is torch.ops.aten.hypot.default
    assert resolve_target("aten::hypot") is torch.ops.aten.hypot.default
    assert resolve_target("aten::add.Tensor") is torch.ops.aten.add.Tensor
    assert resolve_target("aten.add.Tensor") is torch.ops.aten.add.Tensor


@pytest.mark.parametrize(("key", "words"), [
    (torch.linalg.inv, "torch.ops.aten.linalg_inv.default"),
    ("nosuchns::op", "no operator nosuchns::op.default"),
    ("just_a_name", "namespace::op"),
    (torch.ops.aten.add, "several overloads"),
    (42, "operator overload"),
])
def test_bad_keys_are_rejected_with_the_fix(key, words):
    with pytest.raises(RegistrationError, match=None) as ei:
        resolve_target(key)
    assert words in str(ei.value)


def test_duplicates_warn_and_user_wins():
    reg = TranslationRegistry(_loaded=True)

    def f1(self):
        return self

    def f2(self):
        return self

    translation(torch.ops.aten.hypot.default, registry=reg)(f1)
    with pytest.warns(UserWarning, match="registered twice"):
        translation(torch.ops.aten.hypot.default, registry=reg)(f2)
    meta = reg.get("aten::hypot")
    assert meta.function is f2 and meta.source == "user" and meta.family == "user"
    # a builtin registered after a user entry does not replace it
    f3 = types.FunctionType(f1.__code__, {}, "f3")
    f3.__module__ = "onnxmedic.ops.fake"
    translation(torch.ops.aten.hypot.default, registry=reg)(f3)
    assert reg.get("aten::hypot").function is f2


def test_table_and_cached_onnx_registry_follow_changes():
    reg = TranslationRegistry(_loaded=True)

    def f(self, other):
        return self

    translation("aten::hypot", registry=reg)(f)
    assert reg.table() == {torch.ops.aten.hypot.default: f}
    r1 = reg.onnx_registry()
    assert reg.onnx_registry() is r1  # cached
    reg.unregister("aten::hypot")
    assert reg.table() == {}
    assert reg.onnx_registry() is not r1


def test_broken_family_is_recorded_and_others_load(tmp_path, monkeypatch):
    (tmp_path / "om_broken_family.py").write_text("raise RuntimeError('broken module')\n")
    (tmp_path / "om_good_family.py").write_text(
        "import torch\nfrom onnxmedic.ops import translation\n"
        "from tests.ops.test_registry import TEST_REGISTRY\n"
        "@translation(torch.ops.aten.hypot.default, registry=TEST_REGISTRY)\n"
        "def aten_hypot(self, other):\n    return self\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    TEST_REGISTRY._entries.clear()
    TEST_REGISTRY._loaded = False
    TEST_REGISTRY.load_errors.clear()
    TEST_REGISTRY.load_builtin(["om_broken_family", "om_missing_family", "om_good_family"])
    assert list(TEST_REGISTRY.load_errors) == ["om_broken_family"]
    assert "broken module" in TEST_REGISTRY.load_errors["om_broken_family"]
    assert "aten::hypot" in TEST_REGISTRY  # the family after the broken one still loaded


TEST_REGISTRY = TranslationRegistry()


def test_load_error_becomes_OM210_finding(monkeypatch):
    from onnxmedic.ops import REGISTRY
    from onnxmedic.stages import translate

    monkeypatch.setitem(REGISTRY.load_errors, "onnxmedic.ops.broken", "ImportError: boom")
    ep = torch.export.export(torch.nn.ReLU(), (torch.randn(2),))
    res = translate.translate(ep, (torch.randn(2),), {})
    assert res.ok
    assert [f.code for f in res.findings if f.code == "OM210"] == ["OM210"]


# scatter.reduce (the legacy `reduce=` form) would read as the scatter_reduce op's translation
NAMING_EXCEPTIONS = {"aten.scatter.reduce": "aten_scatter_reduce_legacy"}


def test_builtin_translations_follow_one_naming_rule():
    """<namespace>_<op> for the default overload, <namespace>_<op>_<overload, lower case>
    otherwise (torchlib's rule), so a translation is found by the op's name; a complex-valued
    translation adds _complex, like torchlib's."""
    from onnxmedic.ops import REGISTRY

    REGISTRY.load_builtin()
    bad = []
    for m in REGISTRY.entries():
        ns, op = m.target._schema.name.split("::")
        overload = m.target._overloadname
        want = f"{ns}_{op}" + ("" if overload == "default" else f"_{overload.lower()}")
        want = NAMING_EXCEPTIONS.get(str(m.target), want) + ("_complex" if m.complex else "")
        name = getattr(m.function, "__name__", None) or getattr(m.function, "name", None)
        if name != want:
            bad.append(f"{m.target}: {name} (want {want})")
    assert not bad, "\n".join(bad)


def test_entry_for_an_op_defined_later_waits_for_it():
    """A translation for a library's custom op (transformers::grouped_mm_fallback exists only
    once transformers' MoE code is imported) waits until the op is defined; without
    defined_later the unknown name is still rejected."""
    reg = TranslationRegistry(_loaded=True)

    def f(x):
        return x

    with pytest.raises(RegistrationError, match="no operator om_later::twice.default"):
        translation("om_later::twice", registry=reg)(f)
    translation("om_later::twice", registry=reg, defined_later=True)(f)
    assert reg.table() == {}
    assert [name for name, _ in reg.pending()] == ["om_later.twice.default"]

    @torch.library.custom_op("om_later::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    assert reg.table() == {torch.ops.om_later.twice.default: f}
    assert reg.pending() == [] and reg.get("om_later::twice").source == "user"
