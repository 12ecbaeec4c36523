"""Capture-time rewrite of packed-sequence RNNs: the packed path kept padded.

``pack_padded_sequence(x, lengths) -> nn.GRU / nn.LSTM / nn.RNN -> pad_packed_sequence`` cannot be
captured: the packed data and its ``batch_sizes`` have sizes computed from the lengths' values
(torch.export(strict=False) fails in the RNN's forward, ``zeros()`` sized by ``batch_sizes[0]``,
a tensor; strict mode refuses to trace ``pack_padded_sequence``), and ONNX has no packed tensors.
While capturing, ``packed_as_padded`` replaces the three steps by their padded equivalent:

* ``pack_padded_sequence`` returns a :class:`PaddedPack` - the padded batch (time first) and the
  lengths, no sorting;
* the forward of ``nn.RNN``, ``nn.GRU`` and ``nn.LSTM`` given one calls
  ``onnxmedic::padded_rnn`` (``onnxmedic.ops.rnn``: PyTorch's packed kernels eagerly, ONNX's
  RNN ops with ``sequence_lens`` in the ONNX file), which returns the outputs (zero past each
  length) and the states at each sequence's last valid step, in the batch's own order - what
  the packed path returns;
* ``pad_packed_sequence`` of such a result slices the output to ``max(lengths)`` time steps (or
  pads it to ``total_length``) and fills ``padding_value`` past each length.

The values are those of the packed path (verification compares the ONNX model with the eager
model as it is); only the checks ``pack_padded_sequence`` makes on the lengths (sorted when
``enforce_sorted``, each in 1..T) are not made. Every other use of a packed sequence
(``.data``, ``pack_sequence``, a user-built ``PackedSequence``) is left as it is, so it fails as
before; reading ``.data`` of a :class:`PaddedPack` says so. Everything is restored on exit.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.utils import rnn as rnn_utils

from onnxmedic._locate import PKG_DIR, is_user_file
from onnxmedic.findings import Location

logger = logging.getLogger(__name__)

_TORCH_DIR = torch.__file__.replace("\\", "/").rsplit("/", 1)[0] + "/"
_RNN_CLASSES = (nn.RNN, nn.GRU, nn.LSTM)
_PACK = rnn_utils.pack_padded_sequence
_PAD = rnn_utils.pad_packed_sequence


class PackedUseUnsupported(NotImplementedError):
    """A packed sequence used other than by an RNN module or pad_packed_sequence."""


@dataclass
class PackedRewrites:
    """What ``packed_as_padded`` rewrote: (module class, pack_padded_sequence's caller)."""

    calls: list[tuple[str, Location | None]] = field(default_factory=list)


class PaddedPack(rnn_utils.PackedSequence):
    """Stands for a ``PackedSequence`` while capturing: the padded batch, time first, and the
    lengths (int64, the batch's own order)."""

    def __new__(cls, padded: torch.Tensor, lengths: torch.Tensor, *, zero_past: bool,
                where: Location | None) -> PaddedPack:
        obj = tuple.__new__(cls, (None, None, None, None))
        obj.padded, obj.lengths, obj.zero_past, obj.where = padded, lengths, zero_past, where
        return obj

    def _unsupported(self, what: str) -> Any:
        raise PackedUseUnsupported(
            f"onnxmedic captures a packed sequence only as pack_padded_sequence -> nn.RNN/GRU/"
            f"LSTM -> pad_packed_sequence (kept padded, as ONNX's RNN ops take it); this code "
            f"reads PackedSequence.{what}, whose size depends on the lengths' values")

    data = property(lambda self: self._unsupported("data"))
    batch_sizes = property(lambda self: self._unsupported("batch_sizes"))
    sorted_indices = property(lambda self: self._unsupported("sorted_indices"))
    unsorted_indices = property(lambda self: self._unsupported("unsorted_indices"))


def caller_location() -> Location | None:
    """The innermost caller outside torch and onnxmedic (the user's own line preferred)."""
    frame, found = sys._getframe(1), []
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if not path.startswith("<") and not path.startswith(_TORCH_DIR) \
                and PKG_DIR not in path:
            found.append(frame)
        frame = frame.f_back
    if not found:
        return None
    f = next((f for f in found if is_user_file(f.f_code.co_filename)), found[0])
    import linecache

    code = linecache.getline(f.f_code.co_filename, f.f_lineno).strip() or None
    return Location(file=f.f_code.co_filename, line=f.f_lineno, function=f.f_code.co_name,
                    code=code)


def pack_padded(input: torch.Tensor, lengths: Any, batch_first: bool = False,
                enforce_sorted: bool = True) -> PaddedPack:
    """``pack_padded_sequence`` kept padded (time first); no sorting is needed."""
    lengths = (lengths.to(torch.int64) if isinstance(lengths, torch.Tensor)
               else torch.as_tensor(lengths, dtype=torch.int64))
    padded = input.transpose(0, 1) if batch_first else input
    return PaddedPack(padded, lengths, zero_past=False, where=caller_location())


def pad_padded(sequence: Any, batch_first: bool = False, padding_value: float = 0.0,
               total_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``pad_packed_sequence`` of a :class:`PaddedPack`: ``max(lengths)`` time steps (or
    ``total_length``), ``padding_value`` past each length; anything else goes to torch's."""
    if not isinstance(sequence, PaddedPack):
        return _PAD(sequence, batch_first, padding_value, total_length)
    out, lengths = sequence.padded, sequence.lengths
    if total_length is None:
        steps = lengths.max().item()  # data dependent: a Slice by ReduceMax(lengths) in ONNX
        torch._check(steps >= 0)
        torch._check(steps <= out.shape[0])
        out = out.narrow(0, 0, steps)
    else:  # PyTorch raises where max(lengths) > total_length
        out = out[:total_length]
        pad = [0, 0] * (out.dim() - 1) + [0, total_length - out.shape[0]]
        out = nn.functional.pad(out, pad)
    if not sequence.zero_past or padding_value != 0:
        t = torch.arange(out.shape[0], device=out.device).unsqueeze(1)
        valid = (t < lengths.to(out.device).unsqueeze(0)).view(*out.shape[:2],
                                                               *[1] * (out.dim() - 2))
        out = torch.where(valid, out, torch.full((), padding_value, dtype=out.dtype))
    return (out.transpose(0, 1) if batch_first else out), lengths


def _padded_forward(original: Any, record: PackedRewrites) -> Any:
    """An RNN class's forward that runs a :class:`PaddedPack` through ``padded_rnn``."""

    def forward(self: nn.RNNBase, input: Any, hx: Any = None) -> Any:
        if not isinstance(input, PaddedPack):
            return original(self, input, hx)
        if getattr(self, "proj_size", 0) > 0:
            raise PackedUseUnsupported(
                f"an nn.LSTM with proj_size={self.proj_size} runs over a packed sequence"
                + (f" (packed at {input.where})" if input.where is not None else "")
                + "; ONNX's LSTM has no projection")
        is_lstm = self.mode == "LSTM"
        h0, c0 = hx if (is_lstm and hx is not None) else (hx, None)
        params = [w for layer in self.all_weights for w in layer]
        out, h_n, c_n = torch.ops.onnxmedic.padded_rnn(
            input.padded, input.lengths, h0, c0, params, self.mode, bool(self.bias),
            self.num_layers, float(self.dropout), self.training, self.bidirectional)
        record.calls.append((type(self).__name__, input.where))
        result = PaddedPack(out, input.lengths, zero_past=True, where=input.where)
        return result, ((h_n, c_n) if is_lstm else h_n)

    return forward


def _namespaces(model: nn.Module) -> list[dict[str, Any]]:
    """torch.nn.utils.rnn's namespace and the modules' own (``from torch.nn.utils.rnn import
    pack_padded_sequence`` binds the function there)."""
    spaces = {id(vars(rnn_utils)): vars(rnn_utils)}
    for m in model.modules():
        g = getattr(type(m).forward, "__globals__", None)
        if isinstance(g, dict):
            spaces.setdefault(id(g), g)
    return list(spaces.values())


@contextlib.contextmanager
def packed_as_padded(model: nn.Module, record: PackedRewrites) -> Iterator[None]:
    """Within the block, the packed path runs padded (see the module docstring); restored on
    exit."""
    import onnxmedic.ops.rnn  # noqa: F401 - defines onnxmedic::padded_rnn

    swaps = {_PACK: pack_padded, _PAD: pad_padded}
    undo: list[tuple[Any, str, Any]] = []
    try:
        for ns in _namespaces(model):
            for name, value in list(ns.items()):
                if any(value is f for f in swaps):
                    undo.append((ns, name, value))
                    ns[name] = swaps[value]
        for cls in _RNN_CLASSES:
            original = cls.__dict__["forward"]
            undo.append((cls, "forward", original))
            cls.forward = _padded_forward(original, record)
        yield
    finally:
        for where, name, value in reversed(undo):
            if isinstance(where, dict):
                where[name] = value
            else:
                setattr(where, name, value)
