"""The hybrid and state-space families of 2025-26 through ``onnxmedic export hf:FOLDER``
(bench/zoo/family_sweep.py's tiny configs, the CLI in a child process): verified, or refused
with a precise code."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.zoo import family_sweep  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("family,outcome,codes", [
    ("mamba2", "verified", []),  # Mamba-2 states alone
    ("qwen3_next", "verified", []),  # gated delta-net (conv + recurrent) beside attention
    ("jamba", "verified", []),  # Mamba states, attention, MoE
    ("bamba", "verified", []),  # Mamba-2 states beside attention
    ("zamba", "verified", []),  # Mamba states, hybrid layers sharing one attention block
    ("granitemoehybrid", "verified", []),  # Mamba-2 states, attention, MoE
    # Mamba-2 states, attention, and MoE / MLP layers that keep no cache (DummyLayer)
    ("nemotron_h", "verified", []),
    # its experts loop over torch.nonzero's rows: Python control flow on tensor values
    ("dbrx", "refused", ["OM112", "OM810", "OM818"]),
])
def test_state_and_hybrid_families(family, outcome, codes, tmp_path, monkeypatch):
    monkeypatch.setattr(family_sweep, "OUT", tmp_path)
    row = family_sweep.run(family, "causal", timeout=600, exporters=False)
    assert (row["outcome"], row["codes"]) == (outcome, codes), row
