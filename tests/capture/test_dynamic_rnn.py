"""A dynamic sequence length through nn.LSTM / nn.GRU stays dynamic: tracing used to run the
RNN on fake tensors with torch's default decomposition, a Python loop over the time steps, which
fixed the length to the example's (OM401 "Constraints violated ... specialized it to be a
constant (11)"). Capture and translation now use torch's while_loop shape rule for them, the op
stays one aten.lstm/gru and becomes one ONNX LSTM/GRU."""

from __future__ import annotations

import onnx
import pytest
import torch

import onnxmedic
from onnxmedic._torch_compat import rnn_loop_decompositions


class BiRNN(torch.nn.Module):
    def __init__(self, cell: type[torch.nn.Module]):
        super().__init__()
        self.rnn = cell(16, 24, num_layers=2, bidirectional=True, batch_first=True)
        self.head = torch.nn.Linear(48, 5)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


@pytest.mark.parametrize("cell", [torch.nn.LSTM, torch.nn.GRU])
def test_rnn_time_dim_declared_dynamic_stays_dynamic(tmp_path, cell):
    torch.manual_seed(0)
    model = BiRNN(cell).eval()
    x = torch.randn(2, 11, 16, generator=torch.Generator().manual_seed(0))
    r = onnxmedic.export(model, (x,), tmp_path / "m.onnx",
                         dynamic_shapes=({0: "batch", 1: "time"},))
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert not {"OM401", "OM406", "OM407"} & {f.code for f in r.findings}
    m = onnx.load(tmp_path / "m.onnx")
    dims = m.graph.input[0].type.tensor_type.shape.dim
    assert dims[1].dim_param == "time", dims
    assert cell.__name__ in {n.op_type for n in m.graph.node}  # one ONNX LSTM/GRU, no unrolling
    # the export's own verification ran other sequence lengths, 1 included
    sets = {c.input_set for c in r.verification}
    assert {"time=1", "time=22"} <= sets, sets
    assert all(c.ok for c in r.verification)


def test_rnn_loop_decompositions_restore_torch():
    """The patch is scoped: torch's decomposition table and kernels are as they were after."""
    from torch._decomp import decomposition_table

    ops = (torch.ops.aten.lstm.input, torch.ops.aten.gru.input)
    before = [(decomposition_table.get(op), dict(op.py_kernels)) for op in ops]
    with rnn_loop_decompositions():
        assert [decomposition_table.get(op) for op in ops] != [b[0] for b in before]
    assert [(decomposition_table.get(op), dict(op.py_kernels)) for op in ops] == before
