"""The capture stage keeps the reasons strategies were not tried (the report's not_applied)."""

from __future__ import annotations

import torch

import onnxmedic


class Branchy(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent: torch.export fails, draft_export specialises
            return x * 2
        return x - 1


def test_skipped_capture_strategies_are_reported_with_their_reason():
    r = onnxmedic.export(Branchy(), (torch.ones(2, 3),))
    skipped = {n["what"]: n["reason"] for n in r.to_dict()["not_applied"]}
    pytree = [w for w in skipped if "pytree registration" in w]
    assert pytree, skipped
    assert "unknown output or input type" in skipped[pytree[0]]
    assert "OM114" in [f.code for f in r.findings]  # draft_export was tried and worked
