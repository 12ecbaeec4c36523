"""Which opset and IR version an ONNX Runtime release can load, and fitting a model to one.

The table is ONNX Runtime's own compatibility matrix (docs/reference/compatibility.md in
microsoft/onnxruntime: "ONNX Runtime version | ONNX version | ONNX opset version | ONNX ML
opset version | ONNX IR version"). Releases after the last row are given that row's figures,
a lower bound: they load at least what it did. For the installed onnxruntime the figure is
read from the runtime itself: the newest opset any of its ai.onnx kernels is registered for.

The default export opset is the highest the target supports (:func:`choose_opset`): the lowest
of what torch.onnx can export (``ONNX_MAX_OPSET``), onnxmedic's verified ceiling
(``VERIFIED_MAX_OPSET``), what the ONNX Runtime release loads, and, for ``--target tensorrt``,
the opset range of ONNX-TensorRT's support matrix.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import onnx

from onnxmedic import _torch_compat
from onnxmedic.findings import error, info
from onnxmedic.fixes import try_fix

# ORT (major, minor) -> (max ai.onnx opset, max IR version)
ORT_MATRIX: dict[tuple[int, int], tuple[int, int]] = {
    (1, 20): (21, 10), (1, 19): (21, 10), (1, 18): (21, 10), (1, 17): (20, 9),
    (1, 16): (19, 9), (1, 15): (19, 8), (1, 14): (18, 8), (1, 13): (17, 8), (1, 12): (17, 8),
    (1, 11): (16, 8), (1, 10): (15, 8), (1, 9): (15, 8), (1, 8): (14, 7), (1, 7): (13, 7),
    (1, 6): (13, 7), (1, 5): (12, 7), (1, 4): (12, 7), (1, 3): (12, 7), (1, 2): (11, 6),
    (1, 1): (11, 6), (1, 0): (11, 6),
}
NATIVE_OPSET = 18  # torchlib's translations are written for opset 18


def default_opset() -> int:
    """The opset torch.onnx exports at when none is asked for (20 in torch 2.13)."""
    try:
        return _torch_compat.default_opset()
    except Exception:
        return NATIVE_OPSET


# The highest opset onnxmedic exports at by default. At 23 torch.onnx fuses rotary embeddings,
# attention and RMS norms into opset-23 ops, and ONNX Runtime 1.32 rejects the fused
# RotaryEmbedding of a Llama decoder with past key values (OM511 "cos_cache and sin_cache are
# expected to have the same shape", found by the zoo's llama+past); 22 verifies there. --opset 23
# is still honoured (and verified).
VERIFIED_MAX_OPSET = 22
VERIFIED_MAX_REASON = ("onnxmedic's default ceiling (opset 23's fused RotaryEmbedding fails in "
                       "ONNX Runtime on Llama with past key values)")


def exporter_max_opset() -> int:
    """The highest opset torch.onnx exports at (23 in torch 2.13): its opset-18 translation is
    converted up with the ONNX version converter."""
    try:
        return _torch_compat.exporter_max_opset()
    except Exception:
        return default_opset()


@functools.lru_cache(maxsize=1)
def installed_max_opset() -> int | None:
    """The newest ai.onnx opset the installed onnxruntime has a kernel for (None when it cannot
    be asked)."""
    from onnxmedic.fixes.dtypes import registered_kernels

    found = [rng[0] for _, dom, _, rng, _ in registered_kernels() if dom in ("", "ai.onnx")]
    return max(found) if found else None


def installed_version() -> tuple[int, int] | None:
    try:
        import onnxruntime

        return parse_version(onnxruntime.__version__)
    except Exception:
        return None


def runtime_max_opset(version: tuple[int, int] | None) -> tuple[int, str] | None:
    """(max opset, where that figure comes from) for a release, None before 1.0; ``None`` as the
    version means the installed onnxruntime."""
    here = installed_version()
    if version is None or version == here:
        found = installed_max_opset()
        if found is not None:
            name = ".".join(map(str, here)) if here else "installed"
            return found, f"ONNX Runtime {name} (installed)"
        if version is None:
            version = here
    if version is None:
        return None
    lim = limits(version)
    if lim is None:
        return None
    return lim[0], f"ONNX Runtime {version[0]}.{version[1]}"


def target_max_opset(target: str) -> tuple[int, str] | None:
    """A target's own opset ceiling beyond ONNX Runtime's: TensorRT's parser's range."""
    if target == "tensorrt":
        from onnxmedic.fixes.dtypes import tensorrt_table

        t = tensorrt_table()
        return int(t["opset"][1]), f"TensorRT {t['tensorrt']}"
    return None


def choose_opset(target: str = "cpu", version: tuple[int, int] | None = None
                 ) -> tuple[int, str]:
    """The default export opset for ``target`` on ONNX Runtime ``version`` (None: the installed
    one): the highest all of them support, and which of them sets it."""
    bounds = [(exporter_max_opset(), "torch.onnx"), (VERIFIED_MAX_OPSET, VERIFIED_MAX_REASON)]
    for b in (runtime_max_opset(version), target_max_opset(target)):
        if b is not None:
            bounds.append(b)
    best = min(b[0] for b in bounds)
    return best, next(b[1] for b in bounds if b[0] == best)


def parse_version(text: str) -> tuple[int, int] | None:
    m = re.fullmatch(r"\s*(\d+)\.(\d+)(?:\.\d+)?\s*", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def limits(version: tuple[int, int]) -> tuple[int, int] | None:
    """(max opset, max IR version) for an ONNX Runtime release; None before 1.0."""
    if version in ORT_MATRIX:
        return ORT_MATRIX[version]
    newest = max(ORT_MATRIX)
    if version > newest:
        return ORT_MATRIX[newest]
    return None


def resolve_opset(ctx: Any) -> int:
    """The export opset: the one asked for, or (chosen on first use, see stages/plan.py)
    the highest the target supports."""
    if ctx.opset is None:  # the highest opset the target supports
        ctx.opset, ctx.opset_bound = choose_opset(ctx.opts.target, ctx.opts.ort_version)
    return ctx.opset


def parse_ort_version(text: str | None, fn: str) -> tuple[int, int] | None:
    if text is None:
        return None
    v = parse_version(str(text))
    if v is None:
        raise ValueError(f"onnxmedic.{fn}: ort_version must look like '1.17' or '1.17.3', not "
                         f"{text!r}")
    return v


@dataclass
class IrVersionFit:
    """A fix: lower the model's IR version to what ONNX Runtime ``ort`` loads (the checker then
    says whether the model used anything newer)."""

    ort: tuple[int, int]
    name: str = "IR version fit"

    def check(self, model: Any) -> str | None:
        max_ir = limits(self.ort)[1]  # type: ignore[index]
        if model.ir_version <= max_ir:
            return (f"IR version {model.ir_version} already loads in ONNX Runtime "
                    f"{self.ort[0]}.{self.ort[1]}")
        return None

    def apply(self, model: Any) -> str:
        max_ir = limits(self.ort)[1]  # type: ignore[index]
        change = f"IR version {model.ir_version} -> {max_ir}"
        model.ir_version = max_ir
        return change


def fit_ir_version(result: Any, prog: Any, ort: tuple[int, int],
                   opset: int | None) -> None:
    """Fit the model to ONNX Runtime ``ort`` (IrVersionFit) and say what was fitted (OM323),
    including an opset chosen lower than the exporter's for that release."""
    max_opset, max_ir = limits(ort)  # type: ignore[misc]
    changes = [c for c in [try_fix(IrVersionFit(ort), prog.model)] if c]
    unconstrained = min(exporter_max_opset(), VERIFIED_MAX_OPSET)
    if opset is not None and opset < unconstrained:
        changes.append(f"opset {unconstrained} -> {opset}")
    if changes:
        result.findings.append(info(
            "OM323", "translate", f"fitted to ONNX Runtime {ort[0]}.{ort[1]} (opsets up to "
            f"{max_opset}, IR up to {max_ir}): {', '.join(changes)}; verified below.",
            details={"changes": changes}))


def check_opset(result: Any, wanted: int, explicit: bool = True,
                 bound: str = "asked for") -> bool:
    """torch.onnx converts its opset-18 translation to the requested opset with the version
    converter and, when that fails, only logs a warning and keeps 18: say so. An opset asked for
    stops the export there (OM321); the default (the highest the target supports) falls back to
    what the converter reached when the target loads that too (OM324)."""
    native = NATIVE_OPSET
    why = "asked for" if explicit else f"the highest the target supports; set by {bound}"
    if result.opset == wanted:
        if wanted != native:
            result.findings.append(info(
                "OM320", "translate", f"opset {wanted} ({why}): converted from opset {native} "
                "with the version converter; the converted model is checked and verified below.",
                details={"opset": wanted, "bound": bound}))
        return True
    if not explicit and result.opset is not None and result.opset < wanted:
        result.findings.append(info(
            "OM324", "translate", f"opset {wanted} is {why}, but the version converter could not "
            f"convert this model to it; it stays at opset {result.opset}, which that target "
            "loads too.", suggestion=f"Nothing to do; --opset {wanted} would stop with the "
            "converter's error instead.", details={"opset": result.opset, "wanted": wanted}))
        return True
    result.fail("translate", error(
        "OM321", "translate", f"opset {wanted} was {why}, but the version converter could "
        f"not convert the model (it stayed at opset {result.opset}).",
        suggestion=f"Use an opset the converter supports (about 18 to {onnx.defs.onnx_opset_version()} "
        "with this onnx), or drop --opset to keep 18."))
    return False


