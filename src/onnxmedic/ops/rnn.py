"""Recurrent layers over padded variable-length batches: ``onnxmedic::padded_rnn``.

PyTorch runs a variable-length batch through an RNN as a ``PackedSequence``
(``pack_padded_sequence`` -> ``nn.GRU``/``nn.LSTM``/``nn.RNN`` -> ``pad_packed_sequence``), whose
flat data has a size computed from the lengths' values; torch.export cannot trace that (it
fails inside ``pack_padded_sequence``) and ONNX has no packed tensors. ONNX's own RNN ops take
the padded batch and a ``sequence_lens`` input instead, and compute exactly what the packed path
does: each sequence runs over its own length only (the reverse direction starts at its own last
valid step), the outputs past a sequence's length are zero, and ``Y_h``/``Y_c`` hold the state
at each sequence's last valid step - no sorting needed.

``onnxmedic::padded_rnn`` is that computation as a custom op (the capture-time rewrite of
``onnxmedic.capture.packed`` puts it in place of the packed path): time-first padded input and
lengths in; the padded output (zeros past each length, all of the input's time steps), h_n and
c_n (LSTM; an empty tensor otherwise) out. Its eager kernel runs PyTorch's own packed kernels
(``aten.gru.data`` ...); its translation is one ONNX GRU/LSTM/RNN node per layer with
``sequence_lens``, the weights re-laid out like torchlib's ``aten_gru``/``aten_lstm`` (gate order
PyTorch r,z,n -> ONNX z,r,h with ``linear_before_reset=1``; i,f,g,o -> i,o,f,c).
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from onnxmedic.ops._common import ints
from onnxmedic.ops._registry import translation

logger = logging.getLogger(__name__)
aten = torch.ops.aten

MODES = ("RNN_TANH", "RNN_RELU", "LSTM", "GRU")
# gates: how many per mode, and the PyTorch chunks in ONNX's order
_GATES = {"RNN_TANH": (0,), "RNN_RELU": (0,), "GRU": (1, 0, 2), "LSTM": (0, 3, 1, 2)}
_PACKED_KERNELS = {"RNN_TANH": aten.rnn_tanh.data, "RNN_RELU": aten.rnn_relu.data,
                   "GRU": aten.gru.data, "LSTM": aten.lstm.data}


def _check(mode: str, params: list[torch.Tensor], has_biases: bool, num_layers: int,
           bidirectional: bool) -> int:
    """The hidden size, after checking the arguments."""
    if mode not in MODES:
        raise ValueError(f"padded_rnn: mode must be one of {', '.join(MODES)}, not {mode!r}")
    per_direction = 4 if has_biases else 2
    want = num_layers * (2 if bidirectional else 1) * per_direction
    if len(params) != want:
        raise ValueError(f"padded_rnn: expected {want} weight tensors (no projections), got "
                         f"{len(params)}")
    return params[1].shape[1]


def _eager(input: torch.Tensor, lengths: torch.Tensor, hx: Optional[torch.Tensor],  # noqa: UP045
           cx: Optional[torch.Tensor], params: list[torch.Tensor], mode: str,  # noqa: UP045
           has_biases: bool, num_layers: int, dropout: float, train: bool,
           bidirectional: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch's packed path on the padded batch (what the RNN modules do)."""
    hidden = _check(mode, params, has_biases, num_layers, bidirectional)
    steps, batch = input.shape[0], input.shape[1]
    states = num_layers * (2 if bidirectional else 1)
    packed = pack_padded_sequence(input, lengths.cpu(), enforce_sorted=False)
    order, back = packed.sorted_indices, packed.unsorted_indices
    zeros = input.new_zeros(states, batch, hidden)
    h0 = (hx if hx is not None else zeros).index_select(1, order)
    args = (params, has_biases, num_layers, dropout, train, bidirectional)
    if mode == "LSTM":
        c0 = (cx if cx is not None else zeros).index_select(1, order)
        out, h_n, c_n = _PACKED_KERNELS[mode](packed.data, packed.batch_sizes, [h0, c0], *args)
        c_n = c_n.index_select(1, back)
    else:
        out, h_n = _PACKED_KERNELS[mode](packed.data, packed.batch_sizes, h0, *args)
        c_n = input.new_empty(0)
    padded, _ = pad_packed_sequence(PackedSequence(out, packed.batch_sizes, order, back),
                                    total_length=steps)
    return padded, h_n.index_select(1, back), c_n


def _fake(input, lengths, hx, cx, params, mode, has_biases, num_layers, dropout, train,
          bidirectional):
    hidden = _check(mode, params, has_biases, num_layers, bidirectional)
    directions = 2 if bidirectional else 1
    steps, batch = input.shape[0], input.shape[1]
    h_n = input.new_empty(num_layers * directions, batch, hidden)
    c_n = input.new_empty(h_n.shape) if mode == "LSTM" else input.new_empty(0)
    return input.new_empty(steps, batch, directions * hidden), h_n, c_n


def _define() -> None:
    """Define ``onnxmedic::padded_rnn`` (once: a reloaded module finds it defined)."""
    if hasattr(torch.ops.onnxmedic, "padded_rnn"):
        return
    lib = torch.library.Library("onnxmedic", "FRAGMENT")
    lib.define("padded_rnn(Tensor input, Tensor lengths, Tensor? hx, Tensor? cx, Tensor[] params, "
               "str mode, bool has_biases, int num_layers, float dropout, bool train, "
               "bool bidirectional) -> (Tensor, Tensor, Tensor)")
    lib.impl("padded_rnn", _eager, "CompositeExplicitAutograd")
    torch.library.register_fake("onnxmedic::padded_rnn", _fake, lib=lib)
    _LIBS.append(lib)


_LIBS: list[torch.library.Library] = []  # a Library's definitions live as long as it does
_define()


def _gates(w, order: tuple[int, ...], hidden: int):
    """``w``'s gate blocks of ``hidden`` rows (along axis 0) in ONNX's order (Slices, not a
    Split: the optimizer folds them into the initializers)."""
    if len(order) == 1:
        return w
    return op.Concat(*[op.Slice(w, ints([i * hidden]), ints([(i + 1) * hidden]), ints([0]))
                       for i in order], axis=0)


def _cat(xs: list):
    """The values concatenated along axis 0 (one is itself)."""
    return xs[0] if len(xs) == 1 else op.Concat(*xs, axis=0)


def _layer_weights(params, layer: int, directions: int, has_biases: bool, order, hidden: int):
    """ONNX's W (D, G*H, in), R (D, G*H, H) and B (D, 2*G*H) or None for one layer."""
    per = 4 if has_biases else 2
    ws, rs, bs = [], [], []
    for d in range(directions):
        at = (layer * directions + d) * per
        ws.append(op.Unsqueeze(_gates(params[at], order, hidden), ints([0])))
        rs.append(op.Unsqueeze(_gates(params[at + 1], order, hidden), ints([0])))
        if has_biases:
            b = op.Concat(_gates(params[at + 2], order, hidden),
                          _gates(params[at + 3], order, hidden), axis=0)
            bs.append(op.Unsqueeze(b, ints([0])))
    return _cat(ws), _cat(rs), (_cat(bs) if bs else None)


@translation("onnxmedic::padded_rnn",
             note="ONNX GRU/LSTM/RNN with sequence_lens, one node per layer")
def onnxmedic_padded_rnn(input, lengths, hx, cx, params, mode: str, has_biases: bool,
                         num_layers: int, dropout: float, train: bool, bidirectional: bool):
    """padded_rnn(Tensor input, Tensor lengths, Tensor? hx, Tensor? cx, Tensor[] params,
    str mode, bool has_biases, int num_layers, float dropout, bool train, bool bidirectional)
    -> (Tensor, Tensor, Tensor)"""
    if train and dropout > 0 and num_layers > 1:
        raise ValueError("padded_rnn: dropout between layers in training mode has no ONNX form; "
                         "export the model in eval mode")
    hidden = int(params[1].shape[1])
    directions = 2 if bidirectional else 1
    order = _GATES[mode]
    lens = op.Cast(lengths, to=ir.DataType.INT32)
    attrs = {"hidden_size": hidden, "direction": "bidirectional" if bidirectional else "forward"}
    if mode == "GRU":
        attrs["linear_before_reset"] = 1
    elif mode != "LSTM":
        attrs["activations"] = ["Tanh" if mode == "RNN_TANH" else "Relu"] * directions
    x, hs, cs = input, [], []
    for layer in range(num_layers):
        w, r, b = _layer_weights(params, layer, directions, has_biases, order, hidden)
        span = (ints([layer * directions]), ints([(layer + 1) * directions]), ints([0]))
        h0 = op.Slice(hx, *span) if hx is not None else None
        if mode == "LSTM":
            c0 = op.Slice(cx, *span) if cx is not None else None
            y, h_n, c_n = op.LSTM(x, w, r, b, lens, h0, c0, **attrs)
            cs.append(c_n)
        elif mode == "GRU":
            y, h_n = op.GRU(x, w, r, b, lens, h0, **attrs)
        else:
            y, h_n = op.RNN(x, w, r, b, lens, h0, **attrs)
        hs.append(h_n)
        # (T, D, B, H) -> (T, B, D*H): the next layer's input and the output
        x = op.Reshape(op.Transpose(y, perm=[0, 2, 1, 3]), ints([0, 0, -1]))
    empty = op.CastLike(op.Constant(value=ir.tensor(np.zeros(0, dtype=np.float32))), input)
    return x, _cat(hs), _cat(cs) if cs else empty
