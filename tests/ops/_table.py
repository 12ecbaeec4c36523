"""Op-test tables: one entry per op, samples from PyTorch's OpInfo database plus edge values.

A family's test module declares ``ENTRIES = [OpEntry(...), ...]`` and calls
``make_tests(ENTRIES, globals())``: one parametrised test per (entry, dtype, sample). Each sample
is exported through onnxmedic's registry, run in ONNX Runtime and compared with PyTorch using the
entry's tolerance for the dtype. ``xfail`` maps a dtype name (or "*") to a required reason; it is
strict, so an op that starts passing shows up.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from onnxmedic.ops.testing import Comparator, check_call

Sample = tuple[tuple[Any, ...], dict[str, Any]]

# The suite (``-m "not slow"``) checks each op's first FAST_SAMPLES OpInfo samples and all of its
# edge values; the rest of its OpInfo samples run with ``-m slow`` (make test-slow) as a case of
# their own ("...-more"), so that the two together check every sample, as one case did before.
FAST_SAMPLES = 4
# A float64 case of an op that also has a float32 case runs with ``-m slow``: both go through the
# same translation, and float32 is the dtype exported models compute in.


@functools.cache
def _op_db() -> dict[tuple[str, str], Any]:
    from torch.testing._internal.common_methods_invocations import op_db

    return {(o.name, o.variant_test_name): o for o in op_db}


def opinfo(name: str, variant: str = "") -> Any:
    try:
        return _op_db()[(name, variant)]
    except KeyError:
        raise KeyError(f"no OpInfo named {name!r} (variant {variant!r})") from None


def opinfo_samples(name: str, variant: str, dtype: torch.dtype, limit: int) -> list[Sample]:
    info = opinfo(name, variant)
    torch.manual_seed(0)
    out: list[Sample] = []
    for s in info.sample_inputs("cpu", dtype, requires_grad=False):
        out.append(((s.input, *s.args), dict(s.kwargs)))
        if len(out) >= limit:
            break
    return out


@dataclass
class OpEntry:
    """One op in a test table."""

    name: str  # OpInfo name ("linalg.inv"); also the test id
    variant: str = ""  # OpInfo variant_test_name
    fn: Callable[..., Any] | None = None  # defaults to the OpInfo's op
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    tolerance: dict[str, tuple[float, float]] = field(default_factory=dict)  # dtype -> (rtol, atol)
    use_opinfo: bool = True
    max_samples: int = 12
    # extra samples (edge values): a function of dtype returning [(args, kwargs), ...]
    edge: Callable[[torch.dtype], list[Sample]] | None = None
    # sample filter: return a reason to skip a sample PyTorch itself rejects in export
    skip_sample: Callable[[Sample], str | None] | None = None
    xfail: dict[str, str] = field(default_factory=dict)  # dtype name or "*" -> reason
    # outputs defined only up to sign: onnxmedic.ops.testing.comparator_for's comparator
    comparator: Comparator | None = None
    # dtype names whose case runs with -m slow only (make test-slow): a second dtype of an op
    # whose exports are long (a Jacobi solver's unrolled sweeps), its first dtype in the suite
    slow: tuple[str, ...] = ()

    @property
    def callable(self) -> Callable[..., Any]:
        return self.fn if self.fn is not None else opinfo(self.name, self.variant).op

    def samples(self, dtype: torch.dtype, part: str = "all") -> list[Sample]:
        """The samples of one case: ``all``; ``first`` (the first FAST_SAMPLES OpInfo samples
        and the edge values); ``more`` (the OpInfo samples after those)."""
        out: list[Sample] = []
        if self.use_opinfo:
            found = [s for s in opinfo_samples(self.name, self.variant, dtype, self.max_samples)
                     if self.skip_sample is None or not self.skip_sample(s)]
            out += {"all": found, "first": found[:FAST_SAMPLES], "more": found[FAST_SAMPLES:]}[part]
        if self.edge is not None and part != "more":
            out += [s for s in self.edge(dtype) if self.skip_sample is None or not self.skip_sample(s)]
        return out

    def is_slow(self, dtype_name: str) -> bool:
        """Whether this dtype's whole case runs with ``-m slow`` only."""
        return dtype_name in self.slow or (dtype_name == "float64"
                                           and torch.float32 in self.dtypes)

    def splits(self, dtype_name: str) -> bool:
        """Whether this dtype's case is cut in two (first samples in the suite, the rest slow):
        not for a strict xfail (its failing sample may be in either part), nor for a case that
        is slow already."""
        return (self.use_opinfo and self.max_samples > FAST_SAMPLES and not self.is_slow(dtype_name)
                and not (self.xfail.get(dtype_name) or self.xfail.get("*")))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _cases(entries: Iterable[OpEntry]) -> list[Any]:
    cases = []
    for e in entries:
        for dtype in e.dtypes:
            dn = _dtype_name(dtype)
            reason = e.xfail.get(dn) or e.xfail.get("*")
            marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
            marks += [pytest.mark.slow] if e.is_slow(dn) else []
            test_id = f"{e.name}{'.' + e.variant if e.variant else ''}-{dn}"
            if not e.splits(dn):
                cases.append(pytest.param(e, dtype, "all", id=test_id, marks=marks))
                continue
            cases.append(pytest.param(e, dtype, "first", id=test_id, marks=marks))
            cases.append(pytest.param(e, dtype, "more", id=f"{test_id}-more",
                                      marks=[*marks, pytest.mark.slow]))
    return cases


def run_entry(entry: OpEntry, dtype: torch.dtype, part: str = "all") -> None:
    """Check every sample of the case; fail with a per-sample table of what went wrong."""
    dn = _dtype_name(dtype)
    tol = entry.tolerance.get(dn)
    failures = []
    samples = entry.samples(dtype, part)  # without the ones skip_sample filters out
    if part == "more" and not samples:
        pytest.skip(f"{entry.name} ({dn}): OpInfo has no samples after the first {FAST_SAMPLES}")
    assert samples, f"{entry.name}: no samples for {dn} (or every sample was skipped)"
    checked = len(samples)
    for i, (args, kwargs) in enumerate(samples):
        res = check_call(entry.callable, args, kwargs, tolerance=tol,
                         comparator=entry.comparator)
        if not res.ok and res.stage != "eager":
            shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
            failures.append(f"  sample {i} {shapes} {kwargs}: [{res.stage}] {res.error}")
    assert not failures, f"{entry.name} ({dn}): {len(failures)}/{checked} samples failed\n" + \
        "\n".join(failures)


def make_tests(entries: list[OpEntry], namespace: dict[str, Any]) -> None:
    """Define ``test_op`` in the calling test module, parametrised over the table."""

    @pytest.mark.parametrize(("entry", "dtype", "part"), _cases(entries))
    def test_op(entry: OpEntry, dtype: torch.dtype, part: str) -> None:
        run_entry(entry, dtype, part)

    namespace["test_op"] = test_op
