"""The higher-precision reference verification judges ONNX Runtime's error against: the model
run in float64 (float32 for float16/bfloat16 models) on each input set, on a copy - the
user's model is never converted.

The higher-precision model is not a whole copy: each floating weight is seen through an
``_Upcast`` tensor, which reports the higher dtype and hands every op that reads it a converted
copy of the weight, in a buffer kept for the next op's - the model runs exactly as a converted
copy would (every op gets the same values and dtypes, ``weight.dtype`` reads the higher one),
holding the converted weights of one op at a time instead of the whole model twice over (a
2 GiB float32 decoder needed 4 GiB more), in the same pages from op to op. Where that run fails (a model writing its weights), a whole
converted copy is made as before, when it fits.

A reference is not made, and the outputs are judged by the scaled normwise rule instead
(verify/budget.py), when: the model's weights are not floating point, the largest weight (or,
for the whole copy, the model) at the higher precision would need more than MEMORY_SHARE of
the memory available now, the model cannot be copied or run at that precision (no float64
kernel), or - per output - the model computes the output at its own precision anyway (it
casts to float32 internally).
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from onnxmedic._tensors import flatten_tensors, reference_mode, tensor_bytes, to_numpy
from onnxmedic.borrow import copy_inputs
from onnxmedic.inputs import Inputs
from onnxmedic.sandbox import available_memory

logger = logging.getLogger(__name__)

MEMORY_SHARE = 0.4  # of the memory available, at most, for the higher-precision copy
# seconds the float64 runs may take in all: float64 convolutions have no fast CPU kernels (a
# ConvNeXt's depthwise 7x7 take 20x the float32 time); the sets left are judged without it.
# A big model may take TIME_FACTOR times PyTorch's own runs of the same sets instead, so the
# reference's share of the export does not shrink as the model grows (a 1.5 B bf16 decoder's
# float32 reference of one set takes longer than 10 s for all of them would allow)
TIME_LIMIT = 10.0
TIME_FACTOR = 10.0


@dataclass
class Reference:
    """Per input set, per output: the reference array, or None where there is none."""

    outputs: list[list[np.ndarray | None]] = field(default_factory=list)
    # per input set: the run's outputs as they came (None: not run), whatever their shape
    # and dtype - a detection set's count and labels at the higher precision (detections.py)
    raw: list[list[np.ndarray] | None] = field(default_factory=list)
    dtype: str | None = None  # "float64" or "float32"
    why_not: str | None = None  # why there is no reference at all


def reference_precision(model: Any) -> tuple[torch.dtype | None, str | None]:
    """The dtype the reference runs at, or None with the reason: float32 for a model whose
    weights are float16/bfloat16 (its parameters decide: transformers keeps a bf16 model's
    rotary frequencies, a buffer, in float32), float64 otherwise. None for a model that runs
    PyTorch's quantized kernels (torch.ao eager or FX), which have no float64 form (and an
    FX GraphModule would print the failed run's traceback on stderr)."""
    from onnxmedic.quantized import runs_quantized_kernels

    if runs_quantized_kernels(model):
        return None, ("the model runs PyTorch's quantized kernels (torch.ao), which compute "
                      "in float32 only")
    tensors = list(model.parameters()) or list(model.buffers())
    floats = [t.dtype for t in tensors if t.is_floating_point()]
    if not floats:
        return torch.float64, None  # no weights: the inputs decide
    low = {torch.float16, torch.bfloat16}
    if all(d == torch.float64 for d in floats):
        return None, "the model already computes in float64"
    return (torch.float32 if any(d in low for d in floats) and torch.float32 not in floats
            else torch.float64), None


class _TooSlow(Exception):
    """The higher-precision run passed its deadline (stopped between two ops)."""


class _Scratch:
    """Buffers the converted weights of an op are written into, kept for the next op's.
    A converted weight lives only during its op (the op's output never aliases it: views
    of a weight stay _Upcast, see _Upcast), so a buffer is free again after it; fresh memory
    for each would be a page fault per 4 KiB - 4 GiB of them in a 0.5 B decoder's pass, two
    seconds of system time, as long as its arithmetic."""

    def __init__(self) -> None:
        self.free: list[torch.Tensor] = []

    def take(self, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """A buffer laid out as ``like`` (its strides: what ``like.to(dtype)`` gives), or
        None where ``like`` is not dense (a copy of its own then)."""
        n = like.numel()
        if not _dense(like) or n == 0:
            return None
        fits = [i for i, b in enumerate(self.free) if b.dtype == dtype and b.numel() >= n]
        if fits:  # the smallest that fits (by position: == on tensors compares elements)
            buf = self.free.pop(min(fits, key=lambda i: self.free[i].numel()))
        else:
            buf = torch.empty(n, dtype=dtype)
        return buf.as_strided(like.shape, like.stride(), 0)

    def give_back(self, views: list[torch.Tensor]) -> None:
        for v in views:
            self.free.append(v.as_strided((v.untyped_storage().nbytes() // v.element_size(),),
                                          (1,), 0))


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its storage span without gaps or overlaps, in some order
    of its dims (a contiguous weight, or its transpose)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


class _Upcast(torch.Tensor):
    """A weight seen at a higher precision (see the module's docstring): the dtype it reports
    is ``high``; each op gets ``inner`` converted, into a buffer of ``scratch`` kept for the
    next op. A view op (a transpose, a reshape) gives a view of ``inner`` seen the same way,
    converted by the op that reads it. An op that would write it is refused (a converted copy
    would keep the write; a temporary would lose it). Past ``deadline[0]`` (perf_counter
    seconds; None: none) an op raises _TooSlow."""

    deadline: list[float | None]
    scratch: _Scratch

    @staticmethod
    def __new__(cls, inner: torch.Tensor, high: torch.dtype) -> _Upcast:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=high, device=inner.device, requires_grad=False)

    def __init__(self, inner: torch.Tensor, high: torch.dtype) -> None:
        self.inner, self.high = inner, high

    def __repr__(self) -> str:  # type: ignore[override]
        return f"_Upcast({self.inner.dtype} -> {self.high}, shape={tuple(self.shape)})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    def seen(self, inner: torch.Tensor) -> _Upcast:
        """``inner`` (a view of this one's) seen at the same precision, in the same run."""
        out = _Upcast(inner, self.high)
        out.deadline, out.scratch = self.deadline, self.scratch
        return out

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        upcast = [a for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, _Upcast)]
        if func._schema.is_mutable and upcast:
            raise RuntimeError(f"{func} would write a weight of the model")
        end = upcast[0].deadline[0] if upcast else None
        if end is not None and time.perf_counter() > end:
            raise _TooSlow
        only_first = bool(args) and isinstance(args[0], _Upcast) and len(upcast) == 1
        if func in _GATHERS and only_first:
            # rows picked, then converted: the same values (a conversion to the higher
            # precision is exact, element by element), without converting the whole table -
            # a 150k-token embedding is 1 GiB in float64, for the few rows a prompt reads
            return func(args[0].inner, *args[1:], **kwargs).to(args[0].high)
        if only_first and _one_view(func):  # w.t(), w.view(...): converted where read
            return args[0].seen(func(args[0].inner, *args[1:], **kwargs))
        return _converted_call(func, args, kwargs, upcast[0].scratch if upcast else None)


# ops that only pick elements of their first argument (no arithmetic on them)
_GATHERS = (torch.ops.aten.embedding.default, torch.ops.aten.index_select.default)


def _one_view(func: Any) -> bool:
    """Whether ``func`` returns one tensor, a view of its first argument (schema: Tensor(a))."""
    rets = func._schema.returns
    args = func._schema.arguments
    return (len(rets) == 1 and rets[0].alias_info is not None and bool(args)
            and args[0].alias_info is not None
            and rets[0].alias_info.before_set == args[0].alias_info.before_set
            and not rets[0].alias_info.is_write and str(rets[0].type) == "Tensor")


def _converted_call(func: Any, args: Any, kwargs: dict[str, Any],
                    scratch: _Scratch | None) -> Any:
    """``func`` on its arguments with every _Upcast converted: into buffers of ``scratch``
    where the op's outputs alias none of its inputs (given back after it), else copies."""
    taken: list[torch.Tensor] = []
    reuse = scratch is not None and all(r.alias_info is None for r in func._schema.returns)

    def unwrap(t: Any) -> Any:
        if not isinstance(t, _Upcast):
            return t
        buf = scratch.take(t.inner, t.high) if reuse and scratch is not None else None
        if buf is None:
            return t.inner.to(t.high)
        taken.append(buf)
        return buf.copy_(t.inner)

    tree_map = torch.utils._pytree.tree_map
    try:
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
    finally:
        if scratch is not None:
            scratch.give_back(taken)


def _upcast_weights(model: torch.nn.Module, dtype: torch.dtype,
                    deadline: list[float | None]) -> dict[str, Any]:
    """The model's floating parameters and buffers as ``_Upcast`` tensors sharing
    ``deadline`` and a scratch (_Scratch), by name (tied ones one tensor), for
    torch.func.functional_call."""
    by_id: dict[int, Any] = {}
    scratch = _Scratch()
    out = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        if t.is_floating_point() and t.dtype != dtype:
            if id(t) not in by_id:
                by_id[id(t)] = _Upcast(t.detach(), dtype)
                by_id[id(t)].deadline, by_id[id(t)].scratch = deadline, scratch
            out[name] = by_id[id(t)]
    return out


def _largest_bytes(model: Any, dtype: torch.dtype) -> int:
    size = torch.tensor([], dtype=dtype).element_size()
    return max((t.numel() * size for t in list(model.parameters()) + list(model.buffers())
                if t.is_floating_point()), default=0)


def converted_inputs(value: Any, dtype: torch.dtype) -> Any:
    def cast(t: Any) -> Any:
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    return torch.utils._pytree.tree_map(cast, value)


def reference_outputs(model: Any, sets: list[Inputs], expected: list[list[np.ndarray]],
                      torch_seconds: float = 0.0) -> Reference:
    """The reference outputs of ``model`` (an nn.Module) on ``sets`` (``expected``: its outputs
    at its own precision, to tell which outputs the higher precision reaches), within
    max(TIME_LIMIT, TIME_FACTOR x ``torch_seconds``: PyTorch's own time for these sets)."""
    limit = max(TIME_LIMIT, TIME_FACTOR * torch_seconds)
    if not isinstance(model, torch.nn.Module):
        return Reference(why_not="the model is not an nn.Module")
    dtype, why = reference_precision(model)
    if dtype is None:
        return Reference(why_not=why)
    name = str(dtype)[6:]
    avail = available_memory()
    need = _largest_bytes(model, dtype)
    if avail is not None and need > MEMORY_SHARE * avail:
        return Reference(why_not=f"a {name} copy of the model's largest weight needs "
                         f"{need / 2**30:.2f} GiB, more than {MEMORY_SHARE:.0%} of the "
                         f"{avail / 2**30:.1f} GiB available")
    need = tensor_bytes(model, dtype)
    fits = avail is None or need <= MEMORY_SHARE * avail
    no_copy = (f"a {name} copy of the model needs {need / 2**30:.2f} GiB, more than "
               f"{MEMORY_SHARE:.0%} of the {avail / 2**30:.1f} GiB available" if not fits
               else "")
    # where a whole copy would not fit (a model that had no reference before), TIME_LIMIT
    # bounds the first run too: a 1.5 B decoder's float64 run takes over a minute here
    deadline: list[float | None] = [None]
    weights = _upcast_weights(model, dtype, deadline)

    def upcast(*args: Any, **kwargs: Any) -> Any:
        if not fits and deadline[0] is None:
            deadline[0] = time.perf_counter() + limit
        return torch.func.functional_call(model, weights, args, kwargs, tie_weights=True,
                                          strict=False)

    try:
        return _runs(upcast, sets, expected, dtype, limit)
    except _TooSlow:
        return Reference(why_not=f"the {name} run took over {limit:.0f} s and was "
                         f"stopped ({no_copy})")
    except Exception:  # e.g. a model that writes its weights: a whole copy, where it fits
        logger.debug("no %s reference through upcast weights", name, exc_info=True)
    if not fits:
        return Reference(why_not=no_copy)
    try:
        high = copy.deepcopy(model).to(dtype)
    except Exception as e:
        return Reference(why_not=f"the model cannot be copied ({type(e).__name__}: "
                         f"{str(e)[:160]})")
    try:
        return _runs(high, sets, expected, dtype, limit)
    except Exception as e:  # no kernel at that precision, or the model insists on float32
        logger.debug("no %s reference", name, exc_info=True)
        return Reference(why_not=f"the model does not run in {name} ({type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0][:160] if str(e).strip() else ''})")
    finally:
        del high


def _runs(fn: Any, sets: list[Inputs], expected: list[list[np.ndarray]],
          dtype: torch.dtype, limit: float = TIME_LIMIT) -> Reference:
    """``fn`` (the model at ``dtype``) on each set, until ``limit`` seconds; raises what it
    raises."""
    name = str(dtype)[6:]
    out = Reference(dtype=name)
    t0 = time.perf_counter()
    with reference_mode():
        for s, exp in zip(sets, expected):
            if out.outputs and time.perf_counter() - t0 > limit:
                out.outputs.append([None] * len(exp))
                out.raw.append(None)
                out.why_not = (f"the {name} runs took over {limit:.0f} s; the "
                               "remaining input sets are judged without them")
                continue
            # a copy of its own (a model may write its inputs; converted_inputs keeps float64 ones)
            args, kwargs = copy_inputs((converted_inputs(s.args, dtype), converted_inputs(s.kwargs, dtype)))
            got = [to_numpy(t) for t in flatten_tensors(fn(*args, **kwargs))]
            out.outputs.append(_matched(got, exp, name))
            out.raw.append(got)
    return out


def _matched(ref: list[np.ndarray], expected: list[np.ndarray],
             name: str) -> list[np.ndarray | None]:
    """Per output, the reference where it is at the higher precision and of the same shape."""
    if len(ref) != len(expected):
        return [None] * len(expected)
    return [r if str(r.dtype) == name and r.shape == np.asarray(e).shape
            and _is_float(np.asarray(e)) else None for r, e in zip(ref, expected)]


def _is_float(a: np.ndarray) -> bool:
    """A floating array, bfloat16 included (ml_dtypes' bfloat16 is numpy kind 'V')."""
    return a.dtype.kind == "f" or a.dtype.name == "bfloat16"
