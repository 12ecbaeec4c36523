"""Packed-sequence RNNs (issue 15, OM207/OM208): pack_padded_sequence -> nn.GRU/LSTM/RNN ->
pad_packed_sequence captured on the padded batch and its lengths, ONNX's RNN ops with
sequence_lens in the file.

Without the rewrite every capture strategy fails (OM111: the RNN sizes its state from
``batch_sizes[0]``, a tensor; strict mode refuses pack_padded_sequence). The exported files are
run at other batch sizes and lengths (unsorted, a length of 1, all equal) against PyTorch."""

from __future__ import annotations

import inspect

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import onnxmedic
from onnxmedic.capture import packed as packed_mod
from onnxmedic.capture.strategies import CAPTURE_STRATEGIES, PackedSequences, capture


def codes(r):
    return [f.code for f in r.findings]


class Packed(nn.Module):
    """pack -> 2-layer bidirectional RNN -> pad; returns the padded output and the states."""

    def __init__(self, kind: type[nn.RNNBase], batch_first: bool, **kw) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.rnn = kind(5, 6, num_layers=2, bidirectional=True, batch_first=batch_first, **kw)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=self.batch_first,
                                                   enforce_sorted=False)
        out, state = self.rnn(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=self.batch_first)
        return (out, *state) if isinstance(state, tuple) else (out, state)


PACK_LINE = inspect.getsourcelines(Packed.forward)[1] + 1


def _inputs(batch_first: bool, lengths: list[int], steps: int, seed: int = 0):
    x = torch.randn(len(lengths), steps, 5, generator=torch.Generator().manual_seed(seed))
    return (x if batch_first else x.transpose(0, 1).contiguous()), torch.tensor(lengths)


def _run(path, model, args):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    got = sess.run(None, {n: a.numpy() for n, a in zip(names, args)})
    with torch.no_grad():
        want = model(*args)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == tuple(w.shape)
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind,batch_first", [(nn.GRU, True), (nn.LSTM, False)])
def test_packed_rnn_exports_with_dynamic_batch_and_time(kind, batch_first, tmp_path):
    torch.manual_seed(0)
    model = Packed(kind, batch_first).eval()
    args = _inputs(batch_first, [3, 7, 1, 5], 7)
    dims = {0: "batch", 1: "time"} if batch_first else {0: "time", 1: "batch"}
    r = onnxmedic.export(model, args, tmp_path / "m.onnx", dynamic_shapes=(dims, {0: "batch"}))
    assert r.ok, [(f.code, f.message[:300]) for f in r.findings if f.severity == "error"]
    f = next(f for f in r.findings if f.code == "OM207")
    assert f.severity == "info" and f.location.line == PACK_LINE, f
    assert f"nn.{kind.__name__}" in f.message
    ops = {n.op_type for n in r.onnx_model.graph.node}
    assert kind.__name__ in ops, ops  # one ONNX GRU/LSTM per layer, not an unrolled loop
    # other batch sizes and lengths: all equal, the longest shorter than the input, length 1
    for lengths, steps in (([4, 4, 4], 4), ([2, 6], 9), ([1], 3), ([5, 1, 8, 2, 8], 8)):
        _run(tmp_path / "m.onnx", model, _inputs(batch_first, lengths, steps, seed=steps))


def test_plain_rnn_with_initial_state_padding_value_and_total_length(tmp_path):
    class M(nn.Module):  # functions imported by name: the module's own namespace is patched
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.RNN(5, 6, nonlinearity="relu", batch_first=True)

        def forward(self, x, lengths, h0):
            out, h = self.rnn(pack_padded_sequence(x, lengths, True, False), h0)
            return pad_packed_sequence(out, True, padding_value=-1.0, total_length=10)[0], h

    torch.manual_seed(0)
    model = M().eval()
    x, lengths = _inputs(True, [2, 6, 1], 6)
    h0 = torch.randn(1, 3, 6)
    r = onnxmedic.export(model, (x, lengths, h0), tmp_path / "m.onnx",
                         dynamic_shapes=({0: "batch", 1: "time"}, {0: "batch"}, {1: "batch"}))
    assert r.ok and "OM207" in codes(r), codes(r)
    x2, l2 = _inputs(True, [4, 4], 4, seed=3)
    _run(tmp_path / "m.onnx", model, (x2, l2, torch.randn(1, 2, 6)))


class ReadsData(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(5, 6, batch_first=True)
        self.head = nn.Linear(6, 2)

    def forward(self, x, lengths):
        out, _ = self.rnn(pack_padded_sequence(x, lengths, True, False))
        return self.head(out.data)  # the packed rows: a size only the lengths' values give


class Projected(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(5, 6, proj_size=3, batch_first=True)

    def forward(self, x, lengths):
        return self.rnn(pack_padded_sequence(x, lengths, True, False))[1][0]


@pytest.mark.parametrize("model,says", [(ReadsData(), "PackedSequence.data"),
                                        (Projected(), "proj_size=3")])
def test_unsupported_packed_use_is_om208(model, says):
    r = onnxmedic.export(model.eval(), _inputs(True, [3, 5], 5), verify=False)
    assert not r.ok
    f = next(f for f in r.findings if f.severity == "error")
    assert f.code == "OM208" and says in f.message, (f.code, f.message)
    assert f.location.file == __file__  # the user's line that needs the packed layout


def test_model_and_torch_are_left_as_found():
    model = Packed(nn.GRU, True).eval()
    before = (nn.GRU.forward, nn.LSTM.forward, nn.RNN.forward,
              nn.utils.rnn.pack_padded_sequence, nn.utils.rnn.pad_packed_sequence)
    with packed_mod.packed_as_padded(model, packed_mod.PackedRewrites()):
        assert nn.GRU.forward is not before[0]
        assert nn.utils.rnn.pack_padded_sequence is not before[3]
        assert globals()["pack_padded_sequence"] is not before[3]
    assert (nn.GRU.forward, nn.LSTM.forward, nn.RNN.forward, nn.utils.rnn.pack_padded_sequence,
            nn.utils.rnn.pad_packed_sequence) == before
    assert globals()["pack_padded_sequence"] is before[3]


def test_without_the_rewrite_capture_fails_and_the_strategy_applies():
    model = Packed(nn.LSTM, True).eval()
    others = [s for s in CAPTURE_STRATEGIES if s is not PackedSequences]
    attempts = capture(model, _inputs(True, [3, 5], 5), {}, strategies=others)
    assert not attempts[-1].ok
    s = PackedSequences()
    assert s.check(attempts, (), {}, model=model) is None
    assert s.check([], (), {}, model=model) == "no earlier attempt failed"
    assert "no nn.RNN" in s.check(attempts, (), {}, model=nn.Linear(2, 2))


@pytest.mark.parametrize("mode", ["GRU", "LSTM", "RNN_TANH"])
def test_padded_rnn_eager_kernel_is_the_packed_path(mode):
    """onnxmedic::padded_rnn's eager kernel equals the module on the packed batch."""
    kind = {"GRU": nn.GRU, "LSTM": nn.LSTM, "RNN_TANH": nn.RNN}[mode]
    torch.manual_seed(0)
    rnn = kind(5, 6, num_layers=2, bidirectional=True).eval()
    x, lengths = _inputs(False, [3, 7, 1], 7)
    out, state = rnn(pack_padded_sequence(x, lengths, enforce_sorted=False))
    want, _ = pad_packed_sequence(out, total_length=7)
    params = [w for layer in rnn.all_weights for w in layer]
    got = torch.ops.onnxmedic.padded_rnn(x, lengths, None, None, params, mode, True, 2, 0.0,
                                         False, True)
    torch.testing.assert_close(got[0], want, rtol=0, atol=0)
    states = state if isinstance(state, tuple) else (state,)
    for g, w in zip(got[1:], states):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
