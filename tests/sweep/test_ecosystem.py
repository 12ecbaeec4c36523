"""The ecosystem zoo (bench/zoo/ecosystem.py, issue 15) through `onnxmedic sweep`: a fast
handful in the default run (their libraries are in the test extra), the whole zoo in the slow
group (`make bench-eco`, which installs the `zoo` extra)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from onnxmedic.sweep import import_source, sweep

ROOT = Path(__file__).resolve().parents[2]
ZOO = str(ROOT / "bench" / "zoo" / "ecosystem.py")

# entries that do not export and verify yet, each with the finding it ends in and why. Kept
# honest by the slow test: an entry listed here that starts to pass, or one not listed that
# fails, fails the test.
# (filled from `python bench/peers/zoo_bench.py --zoo bench/zoo/ecosystem.py:ZOO`, 2026-11-25;
# the Dim spelling is expected to end the same way. Since capture.caches (OM118), verified
# with `onnxmedic sweep ... --only NAME,NAME@Dim`: neuralop/fno - tensorly's einsum cache
# switched off, backed sizes, OM408 minimums - and x_transformers/decoder - its einx.where
# over plain axis names computed with torch broadcasting)
KNOWN_FAILURES: dict[str, str] = {
    "transformers/mamba": "OM401: the slow path loops over the sequence (modeling_mamba.py:260)",
    "transformers/encodec": "OM402: the frame loop over samples (modeling_encodec.py:588)",
    "torchdiffeq/dopri5": "OM112: adaptive step count (data-dependent); the finding says to "
                          "use method='rk4' with options={'step_size': h}",
}
KNOWN_FAILURES.update({f"{n}@Dim": r for n, r in list(KNOWN_FAILURES.items())})

# the zoo file, imported once (its libraries are imported by each factory, not here)
ECO = import_source(ZOO)


def test_zoo_has_sixty_models_from_fifteen_libraries() -> None:
    zoo = ECO
    assert len(zoo.ZOO) >= 60
    assert len({name.split("/")[0] for name in zoo.ZOO}) >= 15
    assert set(zoo.ALL) == set(zoo.ZOO) | {f"{n}@Dim" for n in zoo.ZOO}


@pytest.mark.slow  # the suite's 20-minute budget: the ecosystem zoo runs in make test-slow
def test_fast_subset_exports_and_verifies_at_every_size(tmp_path) -> None:
    for lib in ("kornia", "torch_geometric", "zuko"):
        pytest.importorskip(lib, reason="the ecosystem zoo's fast subset (pip install -e '.[test]')")
    fast = ECO.FAST
    names = [*fast, f"{fast[0]}@Dim"]
    res = sweep(ZOO + ":ALL", names=names, jobs=2, timeout=600, results=tmp_path / "r.json")
    by = {e["name"]: e for e in res.entries}
    assert sorted(by) == sorted(names)
    bad = {n: [(f["code"], f["message"][:200]) for f in e["findings"]]
           for n, e in by.items() if not e["ok"]}
    assert not bad, bad
    for e in by.values():
        assert e["stages"]["compare"] == "passed" and e["max_abs"] < 1e-3, e["name"]
        sizes = e["check"]["size_check"]
        # every declared dim run at 1, the example's size, 2x and a prime in a fresh session
        assert sizes["ok"] and sizes["checked"] >= 4, (e["name"], sizes)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # a whole zoo sweep: 14 min alone on 2 cores, more when shared
def test_whole_ecosystem_zoo(tmp_path) -> None:
    res = sweep(ZOO + ":ALL", jobs=os.cpu_count(), timeout=900, results=tmp_path / "r.json",
                report=tmp_path / "eco.html")
    failed = {e["name"]: [f["code"] for f in e["findings"] if f["severity"] == "error"]
              for e in res.entries if not e["ok"]}
    assert len(res.entries) >= 120
    assert set(failed) == set(KNOWN_FAILURES), failed
    for name, codes in failed.items():  # every failure ends in a precise finding
        assert codes and KNOWN_FAILURES[name].split(":")[0] in codes, (name, codes)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ECO.ZOO))
def test_export_leaves_every_ecosystem_model_and_torch_unchanged(name: str, tmp_path) -> None:
    """Issue 15: after export, model and torch state are what they were (modes, parameters,
    buffers, hooks, patched functions, global switches), for every entry of the zoo."""
    import onnxmedic
    from onnxmedic._tensors import reference_mode
    from tests._state import snapshot_state, state_differences

    try:
        case = ECO.ZOO[name]()
    except ImportError as e:
        pytest.skip(f"library not installed: {e}")
    # one plain call first: some models initialise parameters on their first call (gpytorch's
    # variational strategy); export must leave the model as a plain call leaves it
    with reference_mode():
        case.model(*case.args, **case.kwargs)
    before = snapshot_state(case.model)
    onnxmedic.export(case.model, case.args, tmp_path / "m.onnx", kwargs=case.kwargs,
                     dynamic_shapes=case.dynamic_shapes)
    assert state_differences(before, snapshot_state(case.model)) == []
