"""The one module that touches private APIs of torch.onnx, torch.fx and torch._library.

Each wrapper names what onnxmedic needs; when a torch release moves one of them, this is the
only file to change. (``torch._ops.OpOverload`` and ``torch.utils._pytree`` are used as types
and tree helpers across the package: torch.export's own documentation uses them.)
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

logger = logging.getLogger(__name__)

# torch.onnx warns about each torchvision op it cannot register when torchvision is absent.
logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)


def default_opset() -> int:
    """torch.onnx's default export opset."""
    from torch.onnx import _constants

    return int(_constants.ONNX_DEFAULT_OPSET)


def exporter_max_opset() -> int:
    """The highest opset torch.onnx exports at (its translation converted up)."""
    from torch.onnx import _constants

    return int(_constants.ONNX_MAX_OPSET)


def torchlib_opset() -> int:
    """The opset torchlib's translations are written in."""
    from torch.onnx._internal.exporter import _constants

    return int(_constants.TORCHLIB_OPSET)


def torchlib_registry(opset_version: int) -> Any:
    """A fresh torch.onnx registry of torchlib's translations for ``opset_version``."""
    from torch.onnx._internal.exporter import _registration

    return _registration.ONNXRegistry.from_torchlib(opset_version=opset_version)


def core_export(program: Any, args: Any, kwargs: Any, *, registry: Any, opset: int) -> Any:
    """torch.onnx's core exporter on an ExportedProgram (what torch.onnx.export(dynamo=True)
    calls after its compatibility layer), optimized, without its report or verification.

    Runs without autograd, like :func:`prepare_for_export`."""
    import torch
    from torch.onnx._internal.exporter import _core

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        return _core.export(program, args, kwargs, registry=registry, verbose=False,
                            optimize=True, opset_version=opset, report=False, verify=False)


def prepare_for_export(program: Any, registry: Any) -> Any:
    """The program after torch.onnx's decompositions: the FX graph its translation sees.

    Runs without autograd: torch.onnx re-runs the graph on fake tensors (its type-promotion
    pass) with the parameters' ``requires_grad`` set, and autograd refuses some ops on complex
    values there ("slice_scatter does not support automatic differentiation for outputs with
    complex dtype", from ``out[:, :m] = low`` on an rfft). The ONNX graph has no gradients, so
    nothing is lost; the grad mode is restored on return."""
    import torch
    from torch.onnx._internal.exporter import _core

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        return _core._prepare_exported_program_for_export(program, registry=registry)


def initializer_bytes(ir_graph: Any) -> int:
    """Bytes of the initializers of an onnx_ir graph (as torch.onnx counts them)."""
    from torch.onnx._internal.exporter import _onnx_program

    return int(_onnx_program._count_initializer_size(ir_graph))


def str_dims_to_export_dims(dynamic_shapes: Any) -> tuple[Any, bool]:
    """torch.onnx's conversion of string dims ({0: "batch"}) to torch.export Dims; the bool
    says whether the ONNX axes must be renamed to the strings afterwards."""
    from torch.onnx._internal.exporter import _dynamic_shapes

    return _dynamic_shapes.convert_str_to_export_dim(dynamic_shapes)


def is_derived_dim(value: Any) -> bool:
    """Whether ``value`` is a torch.export Dim derived from another (``2 * seq``)."""
    from torch.export.dynamic_shapes import _DerivedDim

    return isinstance(value, _DerivedDim)


def rename_dynamic_axes(onnx_program: Any, str_dims: Any) -> None:
    """Name the ONNX model's symbolic dims after the user's strings, as torch.onnx does."""
    onnx_program._rename_dynamic_axes(str_dims)


def backed_size_oblivious() -> Any:
    """A context in which torch.export treats sizes 0/1 of the example like any other size."""
    import torch.fx.experimental._config as fx_config

    return fx_config.patch(backed_size_oblivious=True)


def add_fake_kernel(qualname: str, kernel: Any, source: str = "onnxmedic") -> bool:
    """Put ``kernel`` in torch's fake-impl registry for ``qualname`` once; False when the
    registry moved (the op then simply stays uncapturable)."""
    try:
        from torch._library.fake_impl import Kernel
        from torch._library.simple_registry import singleton

        holder = singleton.find(qualname).fake_impl
        if not any(getattr(k, "source", "") == source for k in holder.kernels):
            holder.kernels.append(Kernel(kernel, source))
        return True
    except Exception:  # pragma: no cover - depends on torch internals
        return False


def new_dynamic_size(max: int) -> Any:  # noqa: A002 - torch's own keyword
    """An unbacked size inside a fake kernel (a data-dependent output length)."""
    from torch._library.fake_impl import global_ctx_getter

    return global_ctx_getter().new_dynamic_size(max=max)


def custom_op_implementation(op: Any) -> Any:
    """The Python implementation of a torch.library custom op (its CPU kernel, else its
    defining function), or None."""
    from torch._library import custom_ops

    opdef = custom_ops.OPDEFS.get(op._schema.name)
    if opdef is None:
        return None
    return opdef._backend_fns.get("cpu") or opdef._init_fn
