"""Rewrites of a captured program that keep its meaning and make the next stage succeed.

Each is a pass with a ``check(error)`` that returns the reason it does not apply (None when it
does) and an ``apply(program)`` that rewrites in place and returns how many nodes it changed.

``contiguous_before_views``: torch's decompositions (run by torch.onnx) re-trace the program
with symbolic shapes, and ``aten.reshape`` / ``aten.view`` of a transposed tensor - Hugging
Face attention's ``attn_output.transpose(1, 2).reshape(b, s, -1)`` in T5, Swin, XLNet ... - can
then be lowered to a ``view`` that fake-tensor stride propagation rejects ("Cannot view a
tensor with shape ... and strides ..."), although eager PyTorch runs it. A contiguous
``clone`` in front of each view/reshape makes the strides provably viewable; in ONNX, which
has no strides, the clone is an Identity the optimiser removes.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from onnxmedic._locate import exception_chain

logger = logging.getLogger(__name__)

VIEW_CRASH = re.compile(r"Cannot view a tensor with shape|view size is not compatible with "
                        r"input tensor's size and stride", re.IGNORECASE)
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default)


def _chain_text(error: BaseException | None) -> str:
    return "".join(f"\n{e}" for e in exception_chain(error))


def _error_check(pattern: re.Pattern[str], reason: str) -> Any:
    """A rewrite's check: None when the decomposition error matches ``pattern``, else why not."""
    def check(error: BaseException | None) -> str | None:
        text = _chain_text(error)
        if not text:
            return "there is no error"
        return None if pattern.search(text) else reason
    return check


# a view of a non-contiguous tensor inside a decomposition (T5, BEiT, Swin)
check_view_crash = _error_check(VIEW_CRASH, "the error is not a view of a non-contiguous tensor")


def _calls(program: torch.export.ExportedProgram, match: Any) -> Any:
    """(graph, node) for every call_function node whose target ``match`` accepts, in every
    graph module of ``program``; each module is recompiled once its nodes are done."""
    for gm in program.graph_module.modules():
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and match(node.target):
                yield gm.graph, node
        gm.recompile()


def contiguous_before_views(program: torch.export.ExportedProgram) -> int:
    """Insert ``aten.clone(x, memory_format=torch.contiguous_format)`` in front of every
    ``aten.view`` / ``aten.reshape`` of a computed tensor, in place; returns how many."""
    count = 0
    for graph, node in _calls(program, lambda t: t in _VIEWS):
        src = node.args[0]
        if not isinstance(src, torch.fx.Node) or src.op == "placeholder" or (
                src.op == "call_function" and src.target is torch.ops.aten.clone.default):
            continue
        with graph.inserting_before(node):
            clone = graph.call_function(torch.ops.aten.clone.default, (src,),
                                        {"memory_format": torch.contiguous_format})
        clone.meta = dict(src.meta)
        node.replace_input_with(src, clone)
        count += 1
    return count


RSUB_CRASH = re.compile(r"Cannot find a compatible OpOverload for aten\.sub.*?"
                        r"target=torch\.ops\.aten\.sub\.Tensor\]\(args = \(-?[\d.e+-]+,",
                        re.DOTALL)


# the decomposition of aten.rsub.Scalar (1.0 - mask in XLNet) produces aten.sub.Tensor(1.0, x),
# which no overload accepts
check_rsub_crash = _error_check(RSUB_CRASH, "the error is not the decomposition of rsub(scalar)")


def rsub_as_add(program: torch.export.ExportedProgram) -> int:
    """Rewrite ``aten.rsub.Scalar(x, other, alpha)`` (= other - alpha * x) as
    ``aten.add.Tensor(aten.neg(x), other)`` (times alpha when it is not 1), in place."""
    count = 0
    for graph, node in _calls(program, lambda t: t is torch.ops.aten.rsub.Scalar):
        x, other = node.args[0], node.args[1]
        alpha = node.args[2] if len(node.args) > 2 else node.kwargs.get("alpha", 1)
        with graph.inserting_before(node):
            neg = graph.call_function(torch.ops.aten.neg.default, (x,))
            neg.meta = dict(node.meta)
            if alpha != 1:
                neg = graph.call_function(torch.ops.aten.mul.Tensor, (neg, alpha))
                neg.meta = dict(node.meta)
            new = graph.call_function(torch.ops.aten.add.Tensor, (neg, other))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        count += 1
    return count


MIXED_SCALARS_CRASH = re.compile(r"Cannot find a compatible OpOverload for aten\.\w+ with the "
                                 r"provided arguments")


# torch.onnx's type-promotion pass turns an int Scalar argument of a float op into a tensor
# (aten.scalar_tensor) but leaves a float one as it is: clamp(x, 50, 4000.0) (SincNet's
# ``torch.clamp(low + band, self.min_low_hz, self.sample_rate / 2)``) becomes
# clamp(x, tensor, 4000.0), which neither clamp.default (Scalars) nor clamp.Tensor accepts.
check_mixed_scalars_crash = _error_check(
    MIXED_SCALARS_CRASH, "the error is not an op with no overload for its promoted arguments")

_EXACT_INT = 2 ** 53  # ints a float (double) holds exactly


def _is_scalar_arg(arg: Any) -> bool:
    """A schema argument of type Scalar or Scalar?."""
    t = arg.type
    inner = t.getElementType() if isinstance(t, torch.OptionalType) else t
    return isinstance(inner, torch.NumberType)


def mixed_scalars_as_floats(program: torch.export.ExportedProgram) -> int:
    """In every op call that takes int and float Python numbers in its Scalar arguments and
    returns a floating tensor, write the ints as floats (same value: PyTorch computes with
    the Scalar in the op's floating dtype anyway), in place; returns how many calls."""
    count = 0

    def match(target: Any) -> bool:
        return isinstance(target, torch._ops.OpOverload) and any(
            _is_scalar_arg(a) for a in target._schema.arguments)

    for _, node in _calls(program, match):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
            continue
        schema = node.target._schema.arguments
        slots = [(i, a.name) for i, a in enumerate(schema) if _is_scalar_arg(a)]
        values = {name: (node.args[i] if i < len(node.args) else node.kwargs.get(name))
                  for i, name in slots}
        numbers = [v for v in values.values() if isinstance(v, (int, float))
                   and not isinstance(v, bool)]
        ints = [v for v in numbers if isinstance(v, int)]
        if not ints or len(ints) == len(numbers) or any(abs(v) > _EXACT_INT for v in ints):
            continue
        args, kwargs = list(node.args), dict(node.kwargs)
        for i, name in slots:
            v = values[name]
            if isinstance(v, int) and not isinstance(v, bool):
                if i < len(args):
                    args[i] = float(v)
                else:
                    kwargs[name] = float(v)
        node.args, node.kwargs = tuple(args), kwargs
        count += 1
    return count


SET_INPUT_CRASH = re.compile(r"Encountered a set_ on a graph input")

# ``x.set_(y)`` on an input: functionalization (torch's decompositions) cannot express the
# input's new storage and shape and asserts
check_set_input_crash = _error_check(SET_INPUT_CRASH, "the error is not a set_ on an input")
_SET_SOURCE = (torch.ops.aten.set_.source_Tensor,)


def set_inputs_as_sources(program: torch.export.ExportedProgram) -> int:
    """Replace each ``aten.set_.source_Tensor(x, src)`` whose ``x`` is a user input by
    ``src``, in place: after ``x.set_(src)``, ``x`` is ``src`` (the same storage, shape and
    strides), so every later read of ``x`` - the set_'s result, or the input itself after it -
    reads ``src``, and a later write to ``x`` writes ``src``, as in eager PyTorch. ONNX has
    no aliasing and torch.onnx returns no input mutation: the new value of ``x`` reaches the
    caller only where forward() returns it (OM013). Returns how many calls."""
    inputs = set(program.graph_signature.user_inputs)
    count = 0
    for graph, node in _calls(program, lambda t: t in _SET_SOURCE):
        target, src = node.args[0], node.args[1]
        if not (isinstance(target, torch.fx.Node) and target.op == "placeholder"
                and target.name in inputs and isinstance(src, torch.fx.Node)):
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        for user in [u for u in target.users if u is not node and order[u] > order[node]]:
            user.replace_input_with(target, src)
        node.replace_all_uses_with(src)
        graph.erase_node(node)
        count += 1
    return count


@dataclass(frozen=True)
class Rewrite:
    """A program rewrite as a fix: ``check(error)`` says why it does not apply to that
    decomposition error; ``apply(program)`` rewrites in place and returns the nodes changed."""

    code: str  # the finding that reports it
    name: str
    check: Callable[[BaseException | None], str | None]
    apply: Callable[[torch.export.ExportedProgram], int]
    what: str  # "{n}" is replaced by the count


REWRITES: tuple[Rewrite, ...] = (
    Rewrite("OM122", "rewrite: contiguous before views", check_view_crash,
            contiguous_before_views, "made the input of {n} view/reshape op(s) contiguous"),
    Rewrite("OM123", "rewrite: rsub as add", check_rsub_crash, rsub_as_add,
            "rewrote {n} rsub(x, scalar) as add(neg(x), scalar)"),
    Rewrite("OM124", "rewrite: mixed int/float scalars as floats", check_mixed_scalars_crash,
            mixed_scalars_as_floats, "wrote the int Scalar arguments of {n} op call(s) that "
            "also take a float one (e.g. clamp(x, 50, 4000.0)) as floats"),
    Rewrite("OM213", "rewrite: set_ on an input as its source", check_set_input_crash,
            set_inputs_as_sources, "read the source tensor wherever the program read a model "
            "input after `input.set_(source)` ({n} call(s))"),
)


def strides_from_sizes(program: torch.export.ExportedProgram) -> tuple[int, list[torch.fx.Node]]:
    """Replace each ``aten.sym_stride.int(x, d)`` whose value is provably the contiguous stride
    of ``x`` (``prod(max(size[k], 1) for k > d)``, as c10 computes it) by that product of
    ``aten.sym_size.int`` calls, in place. ONNX tensors have no strides: a stride query (left by
    code such as julius's ``padded.stride(dim)`` before ``as_strided``) has no translation, and
    the sizes are what it means for a contiguous tensor. A query on a tensor not provably
    contiguous at that dim (a transposed view, say) is left alone: it then fails translation
    (OM201) rather than be replaced by a stride the tensor does not have.
    Returns (how many were replaced, the nodes left)."""
    from onnxmedic._torch_compat import contiguous_strides, statically_known_true

    count, left = 0, []
    for graph, node in _calls(program, lambda t: t is torch.ops.aten.sym_stride.int):
        src, dim = node.args[0], node.args[1]
        val = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or not isinstance(dim, int):
            left.append(node)
            continue
        shape = tuple(val.shape)
        dim = dim + len(shape) if dim < 0 else dim
        try:
            contiguous = statically_known_true(
                val.stride()[dim] == contiguous_strides(shape)[dim])
        except Exception:  # a symbolic expression sympy cannot decide
            contiguous = False
        if not contiguous:
            left.append(node)
            continue
        total: Any = 1
        with graph.inserting_before(node):
            for k in range(dim + 1, len(shape)):
                size = shape[k]
                if isinstance(size, int):
                    factor: Any = max(size, 1)
                else:
                    n_size = graph.call_function(torch.ops.aten.sym_size.int, (src, k))
                    n_size.meta = {**node.meta, "val": size}
                    factor = graph.call_function(torch.sym_max, (n_size, 1))
                    factor.meta = {**node.meta, "val": torch.sym_max(size, 1)}
                if isinstance(total, int) and isinstance(factor, int):
                    total = total * factor
                elif total == 1:
                    total = factor
                else:
                    prod = graph.call_function(operator.mul, (total, factor))
                    prod.meta = {**node.meta, "val": _meta_val(total) * _meta_val(factor)}
                    total = prod
        if isinstance(total, torch.fx.Node):
            node.replace_all_uses_with(total)
        else:
            _replace_with_int(node, total)
        graph.erase_node(node)
        count += 1
    return count, left


def _hint(v: Any) -> int | None:
    """A size or stride's value at the example (a SymInt's hint), None when it has none."""
    if isinstance(v, int):
        return v
    hint = getattr(getattr(v, "node", None), "hint", None)
    return int(hint) if hint is not None else None


def storage_order(val: Any) -> list[int] | None:
    """The permutation of ``val``'s dims that lists its elements in storage order (largest
    stride first), when ``val`` provably fills its storage densely from offset 0 (each stride
    the product of the sizes after it in that order; dims of size 1 anywhere); None when that
    is not provable, or when the order is the identity (contiguous)."""
    from onnxmedic._torch_compat import statically_known_true

    shape, strides = tuple(val.shape), tuple(val.stride())
    hints = [(_hint(st), _hint(sz)) for st, sz in zip(strides, shape)]
    if any(h is None for pair in hints for h in pair) or not statically_known_true(
            val.storage_offset() == 0):
        return None
    order = sorted(range(len(shape)), key=lambda d: (-hints[d][0], d))
    expected: Any = 1
    for d in reversed(order):
        if hints[d][1] == 1:
            continue
        if not statically_known_true(strides[d] == expected):
            return None
        expected = expected * shape[d]
    moved = [d for d in order if hints[d][1] != 1]
    if moved == sorted(moved):
        return None  # already in storage order (size-1 dims aside)
    return order


def storage_order_before_as_strided(program: torch.export.ExportedProgram) -> int:
    """``aten.as_strided(x, ...)`` reads ``x``'s storage, which ONNX does not have; its
    translation flattens x's values row-major, which is the storage only when x is contiguous.
    For an x laid out densely in another order (a transposed view that a ``reshape`` kept as a
    view: Longformer's and LED's ``_chunk``), x is permuted to its storage order and made
    contiguous first, which PyTorch reads the same (as_strided's view of the same elements)
    and ONNX then flattens right. Returns how many as_strided were given such an input."""
    count = 0
    for graph, node in _calls(program, lambda t: t is torch.ops.aten.as_strided.default):
        src = node.args[0]
        val = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor):
            continue
        try:
            order = storage_order(val)
        except Exception as e:  # noqa: BLE001 - sympy could not decide: left as it is
            logger.debug("as_strided input's storage order not known: %s", e)
            continue
        if order is None:
            continue
        with graph.inserting_before(node):
            permuted = graph.call_function(torch.ops.aten.permute.default, (src, order))
            dense = graph.call_function(torch.ops.aten.clone.default, (permuted,),
                                        {"memory_format": torch.contiguous_format})
        permuted.meta = {**src.meta, "val": val.permute(order)}
        dense.meta = {**src.meta,
                      "val": val.permute(order).clone(memory_format=torch.contiguous_format)}
        node.replace_input_with(src, dense)
        count += 1
    return count


def _meta_val(x: Any) -> Any:
    return x.meta["val"] if isinstance(x, torch.fx.Node) else x


def _replace_with_int(node: torch.fx.Node, value: int) -> None:
    """Put the number ``value`` where ``node`` was used."""
    for user in list(node.users):
        user.args = torch.fx.node.map_arg(user.args, lambda a: value if a is node else a)
        user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda a: value if a is node else a)


def constant_outputs_as_tensors(program: torch.export.ExportedProgram
                                ) -> list[tuple[int, Any, torch.dtype]]:
    """Make each output that is a Python number (``return x.shape[1] / 2`` at static shapes:
    torch.export records the value 1.5, not a node) a 0-d tensor of that value, in place:
    ``torch.tensor(value)``'s dtype (float32 for a float, int64 for an int, bool), as
    torch.onnx's TorchScript exporter did and as verification compares it. ONNX outputs are
    tensors; torch.onnx fails on such an output ("'float' object has no attribute 'name'").
    Returns (index among the user outputs, value, dtype) of each output made a tensor."""
    from torch.export.graph_signature import (
        ConstantArgument,
        OutputKind,
        OutputSpec,
        TensorArgument,
    )

    specs = program.graph_signature.output_specs
    todo = [(i, spec.arg.value) for i, spec in enumerate(specs)
            if spec.kind == OutputKind.USER_OUTPUT and isinstance(spec.arg, ConstantArgument)
            and type(spec.arg.value) in (int, float, bool)]
    if not todo:
        return []
    gm = program.graph_module
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    results = list(out.args[0])
    fake_mode = next((n.meta["val"].fake_mode for n in gm.graph.nodes if n.op == "placeholder"
                      and hasattr(n.meta.get("val"), "fake_mode")), None)
    user = [i for i, spec in enumerate(specs) if spec.kind == OutputKind.USER_OUTPUT]
    done = []
    for i, value in todo:
        dtype = torch.tensor(value).dtype
        with gm.graph.inserting_before(out):
            node = gm.graph.call_function(torch.ops.aten.scalar_tensor.default, (value,),
                                          {"dtype": dtype})
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            node.meta["val"] = torch.ops.aten.scalar_tensor.default(value, dtype=dtype)
        results[i] = node
        specs[i] = OutputSpec(kind=OutputKind.USER_OUTPUT, arg=TensorArgument(name=node.name),
                              target=None)
        done.append((user.index(i), value, dtype))
    out.args = (type(out.args[0])(results),)
    gm.recompile()
    return done
