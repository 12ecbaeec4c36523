"""Models whose forward writes their own state on a call (issue 15/16): a cache filled on the
first call and the Python-int length it is filled to (rotary-embedding-torch), a first-call,
data-dependent initialisation behind a flag buffer (normflows' ActNorm). Capture must trace
what a plain call of the model as passed computes (OM125), a first call that initialises the
model from the example is said so (OM126), and the model comes back as it was - its plain
attributes included."""

from __future__ import annotations

import torch
from torch import nn

import onnxmedic
from onnxmedic import borrow
from tests._state import snapshot_state, state_differences


def codes(r):
    return [f.code for f in r.findings]


class LazyRotary(nn.Module):
    """A sin/cos frequency table filled lazily into a buffer, its filled length a plain Python
    int (rotary-embedding-torch's cached_freqs / cached_freqs_seq_len); called twice per
    forward (queries and keys), the second call reads the cache."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cached", torch.zeros(64, 8), persistent=False)
        self.cached_len = 0
        self.register_buffer("inv", 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8),
                             persistent=False)
        self.proj = nn.Linear(8, 8)

    def freqs(self, n: int) -> torch.Tensor:
        if n <= self.cached_len:
            return self.cached[:n]
        f = torch.outer(torch.arange(n, dtype=torch.float32), self.inv).repeat_interleave(2, -1)
        self.cached[:n] = f.detach()
        self.cached_len = n
        return f

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        q = self.proj(x)
        return q * self.freqs(n).cos() + q.flip(-1) * self.freqs(n).sin()


def test_a_lazily_filled_cache_is_traced_as_a_fresh_call_fills_it(tmp_path):
    """Before: the example run left cached_len = 6 and a table filled to 6; capture read it
    as constants (a slice of an initializer) and the file was wrong at seq 13 (OM402)."""
    torch.manual_seed(0)
    model = LazyRotary().eval()
    before = snapshot_state(model)
    path = tmp_path / "rot.onnx"
    r = onnxmedic.export(model, (torch.randn(2, 6, 8),), path,
                         dynamic_shapes=({0: "batch", 1: "seq"},))
    assert r.ok, [f.one_paragraph() for f in r.findings]
    om125 = next(f for f in r.findings if f.code == "OM125")
    assert om125.details["restored"] is True
    assert {d["name"]: d["kind"] for d in om125.details["state"]} == {
        "cached": "buffer", "cached_len": "attribute"}
    assert "cached_len (attribute, 0 -> 6" in om125.message
    assert "self.cached[:n] = f.detach()" in om125.message  # the line that writes it
    assert "self.cached_len = n" in om125.message  # not __init__'s
    # the model comes back as it was: the table empty AND its length 0 (not a stale 13)
    assert state_differences(before, snapshot_state(model)) == []
    assert model.cached_len == 0
    for seq in (1, 13, 40):
        v = onnxmedic.verify(path, model, (torch.randn(3, seq, 8),))
        assert v.ok, (seq, [f.one_paragraph() for f in v.findings])


def test_restored_buffers_beside_a_stale_length_would_be_wrong():
    """Why the attribute must come back with the buffer: the table put back empty while the
    length says 6 makes the model's own next call wrong. borrow puts both back."""
    torch.manual_seed(0)
    model = LazyRotary().eval()
    x = torch.randn(1, 6, 8)
    with torch.no_grad():
        fresh = model(x)
        state = borrow.record_state(model)
        model(torch.randn(1, 9, 8))
        written = borrow.written_since(state)
        assert (written.buffers, written.attributes) == (["cached"], ["cached_len"])
        restored, params = borrow.restore_state(state)
        assert sorted(restored) == ["cached", "cached_len"] and params == []
        assert model.cached_len == 6
        assert torch.equal(model(x), fresh)


class ActNormish(nn.Module):
    """normflows' ActNorm: scale and shift set from the first batch (``.data`` replaced, no
    version bump), a float flag buffer replaced by a new tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.zeros(1, 4))
        self.t = nn.Parameter(torch.zeros(1, 4))
        self.register_buffer("done", torch.tensor(0.0))

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.done:
            self.s.data = torch.log(z.std(0, keepdim=True) + 1e-6)
            self.t.data = z.mean(0, keepdim=True)
            self.done = torch.tensor(1.0)
        return (z - self.t) * torch.exp(-self.s), -self.s.sum()


class Flow(nn.Module):
    """normflows' NormalizingFlow.log_prob: ``torch.zeros(len(x))`` then the flows."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = ActNormish()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        log_q = torch.zeros(len(x), dtype=x.dtype)
        z, log_det = self.norm(x)
        return log_q + log_det - 0.5 * self.lin(z).pow(2).sum(1)


def test_an_initialised_flow_keeps_the_batch_dynamic(tmp_path):
    """Before: len(x) turned the batch into the example's 6 in every non-strict capture (the
    only ones that can read the flag buffer), so draft_export specialised it and the file
    failed at batch 1 and 13 (OM402). Now the flag is decided by its value (OM116) and the
    batch stays symbolic."""
    torch.manual_seed(0)
    model = Flow()
    model(torch.randn(16, 4))  # initialised on its first batch, as the zoo's factory does
    model.eval()
    before = snapshot_state(model)
    path = tmp_path / "flow.onnx"
    r = onnxmedic.export(model, (torch.randn(6, 4),), path, dynamic_shapes=({0: "batch"},))
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert "OM116" in codes(r) and "OM114" not in codes(r)
    assert not {"OM125", "OM126"} & set(codes(r))  # an initialised model writes nothing
    assert state_differences(before, snapshot_state(model)) == []
    for batch in (1, 13):
        v = onnxmedic.verify(path, model, (torch.randn(batch, 4),))
        assert v.ok, (batch, [f.one_paragraph() for f in v.findings])


def test_a_model_initialised_by_the_example_run_is_said_so():
    """Not initialised before export: the example run initialises it from the example's
    statistics (OM126 names the parameters and the flag's line); it is captured as that run
    left it, and afterwards the flag is back, so the next call initialises from its data."""
    torch.manual_seed(0)
    model = Flow().eval()
    r = onnxmedic.export(model, (torch.randn(6, 4),), dynamic_shapes=({0: "batch"},))
    assert r.ok, [f.one_paragraph() for f in r.findings]
    om126 = next(f for f in r.findings if f.code == "OM126")
    assert om126.severity.value == "warning"
    assert om126.details["parameters"] == ["norm.s", "norm.t"]
    assert "self.done = torch.tensor(1.0)" in om126.message
    assert "OM125" not in codes(r)
    assert float(model.norm.done) == 0.0


class DictCache(nn.Module):
    """A per-length cache kept in a plain dict, filled in place."""

    def __init__(self) -> None:
        super().__init__()
        self.grids: dict[int, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1]
        if n not in self.grids:
            self.grids[n] = torch.linspace(0, 1, n)
        return x * self.grids[n]


def test_a_dict_cache_filled_in_place_gets_its_items_back():
    model = DictCache().eval()
    cache = model.grids
    r = onnxmedic.export(model, (torch.randn(2, 5),))
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert "OM125" in codes(r)
    assert model.grids is cache and cache == {}
