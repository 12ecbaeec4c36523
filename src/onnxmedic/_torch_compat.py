"""The one module that touches private APIs of torch.onnx, torch.fx and torch._library.

Each wrapper names what onnxmedic needs; when a torch release moves one of them, this is the
only file to change. (``torch._ops.OpOverload`` and ``torch.utils._pytree`` are used as types
and tree helpers across the package: torch.export's own documentation uses them.)
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

# torch.onnx warns about each torchvision op it cannot register when torchvision is absent.
logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
# onnx_ir's initializer deduplication warns about each initializer that is a graph output (a
# constant output: a Python number returned by forward(), OM214), which it rightly leaves alone.
logging.getLogger("onnx_ir.passes.common.initializer_deduplication").setLevel(logging.ERROR)


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
    """A fresh torch.onnx registry of torchlib's translations for ``opset_version``.

    torchlib registers only the ops that exist when the registry is built: the
    ``quantized_decomposed`` quantize/dequantize ops of a PT2E-quantized model (QuantizeLinear /
    DequantizeLinear) are defined first, whatever the order of imports (the registry is
    cached, and a first export of a float model would otherwise build it without them)."""
    import torch.ao.quantization.fx._decomposed  # noqa: F401 - defines quantized_decomposed
    from torch.onnx._internal.exporter import _registration

    return _registration.ONNXRegistry.from_torchlib(opset_version=opset_version)


def quantized_decomposed() -> Any:
    """``torch.ops.quantized_decomposed`` (PT2E's quantize/dequantize ops, which torch.onnx
    translates to QuantizeLinear/DequantizeLinear), defined first."""
    import torch
    import torch.ao.quantization.fx._decomposed  # noqa: F401 - defines quantized_decomposed

    return torch.ops.quantized_decomposed


def core_export(program: Any, args: Any, kwargs: Any, *, registry: Any, opset: int,
                optimize: bool = True) -> Any:
    """torch.onnx's core exporter on an ExportedProgram (what torch.onnx.export(dynamo=True)
    calls after its compatibility layer), optimized unless ``optimize=False``, without its
    report or verification.

    Runs without autograd, like :func:`prepare_for_export`."""
    import torch
    from torch.onnx._internal.exporter import _core

    with warnings.catch_warnings(), torch.no_grad(), decompositions_sped_up():
        warnings.simplefilter("ignore")
        return _core.export(program, args, kwargs, registry=registry, verbose=False,
                            optimize=optimize, opset_version=opset, report=False, verify=False)


# the modules that call torch.export's collection of the CompositeImplicitAutograd ops (each
# imported it by name): ExportedProgram.run_decompositions and its default decomposition table
_CIA_COLLECTORS = ("torch._export.utils", "torch.export.exported_program",
                   "torch.export.decomp_utils")


@contextlib.contextmanager
def cia_ops_materialized_once() -> Iterator[None]:
    """Within the block, each collection of the CompositeImplicitAutograd ops that
    ``run_decompositions`` does (twice per translation) asks the C++ dispatcher for them once.

    torch's ``_collect_all_valid_cia_ops`` walks every ``torch.ops`` namespace (16 to 30 of
    them) and, for each, re-materialises the whole dispatcher's CIA list into ``torch.ops``
    (``_materialize_cpp_cia_ops``: the same list, for every namespace, nothing registered in
    between), about a third of the time of a small model's translation. Here it is
    materialised once at the start of each collection and the per-namespace walk is
    torch's own: the same set of ops, and a registration made before a collection is seen by
    it, as before. A no-op where a later torch has moved these."""
    import importlib

    try:
        utils = importlib.import_module("torch._export.utils")
    except ImportError:  # pragma: no cover - moved in a later torch
        yield
        return
    materialize = getattr(utils, "_materialize_cpp_cia_ops", None)
    if materialize is None:  # pragma: no cover - moved in a later torch
        yield
        return

    def done(_original: Any) -> Any:
        return lambda: None

    def once(collect: Any) -> Any:
        def collect_once() -> Any:
            materialize()
            with _replaced_on(utils, "_materialize_cpp_cia_ops", done):
                return collect()

        return collect_once

    with contextlib.ExitStack() as stack:
        for module in _CIA_COLLECTORS:
            stack.enter_context(_replaced(module, "_collect_all_valid_cia_ops", once))
        yield


# OperatorBase.py_impl(key)'s decorator, by (id(op), id(key)): (op, key, decorator); the op
# and the key are kept so that their ids are never another's
_PY_IMPL_DECORATORS: dict[tuple[int, int], tuple[Any, Any, Any]] = {}


@contextlib.contextmanager
def py_impl_decorators_kept() -> Iterator[None]:
    """Within the block, ``op.py_impl(key)`` returns the decorator it returned before for the
    same op and key instead of defining it again.

    ``run_decompositions`` overrides the kernels of every CompositeImplicitAutograd op it
    preserves (about 500) for the length of its re-trace, twice per translation, with some
    eleven ``py_impl(key)(kernel)`` each; ``py_impl`` defines its decorator anew on every call
    and evaluates its ``Callable[_P, _T]`` annotations (typing's generic aliases): most of the
    cost of those overrides. The decorator is a closure over the op and the key only (it reads
    the op's kernel tables when it is applied), so the kept one registers exactly what a new
    one would."""
    from torch._C import DispatchKey
    from torch._ops import OperatorBase

    def kept(py_impl: Any) -> Any:
        def py_impl_kept(self: Any, k: Any) -> Any:
            # by identity: hashing a DispatchKey (a pybind11 enum) costs microseconds, and
            # run_decompositions asks for the same key objects (torch's lists of them)
            key = (id(self), id(k))
            hit = _PY_IMPL_DECORATORS.get(key)
            if hit is None or hit[0] is not self or hit[1] is not k:
                decorator = py_impl(self, k)  # torch's: it checks the key (and fails as torch)
                if type(k) is DispatchKey and k != DispatchKey.Python:
                    decorator = _dispatch_key_registration(self, k)
                hit = _PY_IMPL_DECORATORS[key] = (self, k, decorator)
            return hit[2]

        return py_impl_kept

    with _replaced_on(OperatorBase, "py_impl", kept):
        yield


def _dispatch_key_registration(op: Any, k: Any) -> Any:
    """What torch's ``OperatorBase.py_impl(k)`` decorator does for a DispatchKey ``k`` other
    than Python (torch 2.13, torch/_ops.py): refuse a key that has a kernel, record the kernel,
    clear the op's dispatch cache - without its checks of ``k``'s kind, made once for the op
    and key by :func:`py_impl_decorators_kept` (``run_decompositions`` applies some 11,000 of
    these per translation: two fifths of a small model's)."""

    def register(fn: Any) -> Any:
        if k in op.py_kernels:
            raise RuntimeError(f"Trying to override a python impl for {k} on operator "
                               f"{op.name()}")
        op.py_kernels[k] = fn
        op._dispatch_cache.clear()
        return fn

    return register


# torch.onnx's ONNX-friendly decomposition table split as ``run_decompositions`` splits it
# (CompositeImplicitAutograd ops to override, the rest), by what it is made from; see
# onnx_decompositions_kept. A short list (one entry per registry in use: an opset, a
# custom table), compared by equality, not hashed: its fingerprints hold the objects.
_DECOMPOSITION_SPLITS: list[tuple[tuple[Any, ...], tuple[dict[Any, Any], dict[Any, Any]]]] = []
_DECOMPOSITION_SPLITS_KEPT = 8


def _decomposition_inputs() -> tuple[Any, ...]:
    """Everything torch.onnx's decomposition table and its split read besides the registry:
    the CompositeImplicitAutograd ops (collected as torch collects them), the Python CIA
    kernels of those ops (``_get_decomp_for_cia`` returns one where it is set) and torch's
    global decomposition table (``register_decomposition`` adds to it)."""
    import torch
    import torch._decomp
    from torch._export import utils

    cia_key = torch._C.DispatchKey.CompositeImplicitAutograd
    cia = frozenset(utils._collect_all_valid_cia_ops())
    python_cia = tuple((op, op.py_kernels[cia_key]) for op in cia
                       if cia_key in op.py_kernels)
    return cia, frozenset(python_cia), tuple(torch._decomp.decomposition_table.items())


def decomposition_split(registry: Any) -> tuple[dict[Any, Any], dict[Any, Any]]:
    """``(cia_to_decomp, python_decomp_table)`` for ``registry``, as
    ``run_decompositions(create_onnx_friendly_decomposition_table(...))`` computes them,
    made once per registry contents and decomposition inputs; fresh dicts every call."""
    from torch.export import exported_program
    from torch.onnx._internal.exporter import _decomp

    registered = frozenset(_decomp.get_onnx_implemented_overloads(registry))
    key = (registered, *_decomposition_inputs())
    for i, (known, split) in enumerate(_DECOMPOSITION_SPLITS):
        if known == key:
            if i:  # most recent first
                _DECOMPOSITION_SPLITS.insert(0, _DECOMPOSITION_SPLITS.pop(i))
            break
    else:
        table = _decomp.create_onnx_friendly_decomposition_table(set(registered))
        split = exported_program._split_decomp_table_to_cia_and_python_decomp(table)
        _DECOMPOSITION_SPLITS.insert(0, (key, split))
        del _DECOMPOSITION_SPLITS[_DECOMPOSITION_SPLITS_KEPT:]
    return dict(split[0]), dict(split[1])


@contextlib.contextmanager
def onnx_decompositions_kept() -> Iterator[None]:
    """Within the block, torch.onnx's ``decompose_with_registry`` builds its ONNX-friendly
    decomposition table (torch's default decompositions less the registry's ops) and splits
    it (``run_decompositions``) once per registry and decomposition inputs, not on every
    translation (a tenth of a small model's); then it runs the decomposition exactly as
    ``ExportedProgram.run_decompositions(table)`` does. Nothing is kept that a change of the
    registry, of the CompositeImplicitAutograd ops or of torch's decomposition table would
    make stale: they are the cache's key."""
    from torch.export import exported_program

    decompose = getattr(exported_program, "_decompose_exported_program", None)
    no_fake = getattr(exported_program, "_disable_prexisiting_fake_mode", None)
    if decompose is None or no_fake is None:  # pragma: no cover - moved in a later torch
        yield
        return

    @no_fake
    def decompose_with_registry(program: Any, registry: Any) -> Any:
        cia_to_decomp, python_decomp_table = decomposition_split(registry)
        return decompose(program, cia_to_decomp=cia_to_decomp,
                         python_decomp_table=python_decomp_table, joint_loss_index=None,
                         decompose_custom_triton_ops=False)

    with _replaced("torch.onnx._internal.exporter._fx_passes", "decompose_with_registry",
                   lambda _original: decompose_with_registry):
        yield


# sha256 of torch 2.13's _override_composite_implicit_decomp (its source): the function
# cia_overrides_by_dict does the work of; another torch's runs as it is
CIA_OVERRIDE_SOURCE = "4422dc79d0792af728dd8eacf0a2fadcf00195c8802ceca15632b737d9d5c9bd"


@functools.cache
def cia_override_matches() -> bool:
    import hashlib
    import inspect

    from torch.export import exported_program

    try:
        fn = exported_program._override_composite_implicit_decomp
        source = inspect.getsource(getattr(fn, "__wrapped__", fn))
    except (AttributeError, OSError, TypeError):  # pragma: no cover - moved in a later torch
        return False
    return hashlib.sha256(source.encode()).hexdigest() == CIA_OVERRIDE_SOURCE


def _to_original_cia(fake_tensor_mode: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    # torch 2.13's _force_dispatch_to_orig_cia_callable, line for line (a fake-tensor rule
    # that runs the op's own CompositeImplicitAutograd kernel), defined once, not per op
    orig_cia_callable = kwargs["original_callable"]
    del kwargs["original_callable"]
    with fake_tensor_mode:
        return orig_cia_callable(*args, **kwargs)


@contextlib.contextmanager
def cia_overridden(cia_ops_to_callable: dict[Any, Any]) -> Iterator[None]:
    """torch 2.13's ``_override_composite_implicit_decomp`` (torch/export/exported_program.py)
    with the same kernels registered on the same ops, written as dict updates: torch
    registers each of some 21 kernels per op through ``py_impl`` and tests each key's
    presence first, and every one of those dict operations hashes a DispatchKey (a pybind11
    enum: microseconds), some 30,000 per translation; a dict built from a dict of the keys
    reuses their hashes. An op with kernels of its own, or not an OpOverload, takes torch's
    steps one by one."""
    import torch
    from torch._export.utils import _get_decomp_for_cia
    from torch._higher_order_ops.utils import autograd_not_implemented
    from torch._subclasses.fake_impls import (
        _deregister_op_impl,
        _is_op_registered_to_fake_rule,
        register_op_impl,
    )
    from torch.export import exported_program

    cia = torch._C.DispatchKey.CompositeImplicitAutograd
    autograd_keys = dict.fromkeys(exported_program._AUTOGRAD_ALIAS_BACKEND_KEYS_TO_OVERRIDE)
    backend_keys = dict.fromkeys(exported_program._BACKEND_KEYS_TO_OVERRIDE)
    cia_only = {cia: None}
    saved_tables = {}
    for op, decomp_callable in cia_ops_to_callable.items():
        kernels = op.py_kernels
        saved_tables[op] = kernels.copy()
        plain = not kernels and type(op) is torch._ops.OpOverload
        blocked = autograd_not_implemented(op, deferred_error=True)
        if plain:
            kernels.update(dict.fromkeys(autograd_keys, blocked))
        else:
            for key in autograd_keys:
                if key not in kernels:
                    op.py_impl(key)(autograd_not_implemented(op, deferred_error=True))
        orig_cia_callable = _get_decomp_for_cia(op)
        if plain:
            kernels.update(dict.fromkeys(cia_only, decomp_callable))
        else:
            kernels.pop(cia, None)
            op.py_impl(cia)(decomp_callable)
        if not _is_op_registered_to_fake_rule(op):
            register_op_impl(op)(functools.partial(_to_original_cia,
                                                   original_callable=orig_cia_callable))
        if plain:
            kernels.update(dict.fromkeys(backend_keys, orig_cia_callable))
            op._dispatch_cache.clear()
        else:
            for key in backend_keys:
                if key not in kernels:
                    op.py_impl(key)(orig_cia_callable)
    try:
        yield
    finally:
        for op, table in saved_tables.items():
            op.py_kernels.clear()
            op.py_kernels.update(table)
            op._dispatch_cache.clear()
            _deregister_op_impl(op)


@contextlib.contextmanager
def cia_overrides_by_dict() -> Iterator[None]:
    """Within the block, ``run_decompositions``' override of the CompositeImplicitAutograd
    kernels (torch's ``_override_composite_implicit_decomp``, entered twice per translation:
    two fifths of a small model's) is :func:`cia_overridden`: the same kernels on the same
    ops, restored as torch restores them. Only on the torch whose function it was checked
    against (its source's hash); another torch's runs as it is."""
    if not cia_override_matches():
        yield
        return
    with _replaced("torch.export.exported_program", "_override_composite_implicit_decomp",
                   lambda _original: cia_overridden):
        yield


@contextlib.contextmanager
def decompositions_sped_up() -> Iterator[None]:
    """torch.export's ``run_decompositions`` (in torch.onnx's translation) without the work
    it repeats for nothing: :func:`cia_ops_materialized_once`,
    :func:`py_impl_decorators_kept`, :func:`onnx_decompositions_kept` and
    :func:`cia_overrides_by_dict`. The same program comes out."""
    with cia_ops_materialized_once(), py_impl_decorators_kept(), onnx_decompositions_kept(), \
            cia_overrides_by_dict():
        yield


def is_fake(tensor: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def torch_decomposition(op: Any) -> Any:
    """torch's own decomposition of the ATen overload ``op`` (its decomposition table)."""
    from torch._decomp import decomposition_table

    return decomposition_table[op]


def contiguous_strides(shape: Any) -> Any:
    """The strides of a contiguous tensor of ``shape``, as c10 computes them (symbolic sizes
    kept symbolic)."""
    from torch._prims_common import make_contiguous_strides_for

    return make_contiguous_strides_for(shape)


def statically_known_true(expr: Any) -> bool:
    """Whether a (symbolic) boolean expression is true for every size the shape env allows."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true as known

    return bool(known(expr))


def fake_tensor_type() -> type:
    """torch's FakeTensor class, for isinstance checks on many values in a hot loop."""
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor


def real_mode() -> Any:
    """A context in which a fake mode's ops run on real tensors again (to read a value)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


@contextlib.contextmanager
def fake_dispatch_replaced(mode: Any, wrap: Any) -> Iterator[None]:
    """Within the block, every op the fake mode ``mode``'s class dispatches goes through
    ``wrap(original)`` (``(self, func, types, args, kwargs) -> out``)."""
    with _replaced_on(type(mode), "_dispatch_impl", wrap):
        yield


@contextlib.contextmanager
def fakify_params_replaced(wrap: Any) -> Iterator[None]:
    """Within the block, torch.export makes the fakes of a module's parameters and buffers
    with ``wrap(original)`` (``(fake_mode, module) -> {name: fake}``)."""
    with _replaced("torch.export._trace", "_fakify_params_buffers", wrap):
        yield


@contextlib.contextmanager
def real_tensor_decisions_logged(log: Any) -> Iterator[None]:
    """Within the block, each guard a real-tensor-propagating capture decides from real values
    calls ``log(shape_env, expression, value)`` (instead of torch's own log line)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with _replaced_on(ShapeEnv, "_log_real_tensor_propagation", lambda original: log):
        yield


@contextlib.contextmanager
def data_dependent_guards_decided(decide: Any) -> Iterator[None]:
    """Within the block, a guard on a data-dependent value (torch raises
    GuardOnDataDependentSymNode: "could not guard on data-dependent expression") asks
    ``decide()``: a bool is used as the guard's value, None lets torch raise."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv

    def wrap(original: Any) -> Any:
        def evaluate_sym_node(self: Any, sym_node: Any, size_oblivious: bool = False,
                              fallback_value: bool | None = None) -> Any:
            try:
                return original(self, sym_node, size_oblivious, fallback_value)
            except GuardOnDataDependentSymNode:
                value = decide()
                if value is None:
                    raise
                return original(self, sym_node, size_oblivious, value)

        return evaluate_sym_node

    with _replaced_on(ShapeEnv, "evaluate_sym_node", wrap):
        yield


@contextlib.contextmanager
def fake_weights(model: Any, args: Any, kwargs: Any) -> Iterator[tuple[Any, Any, dict[str, Any]]]:
    """Within the block, ``model``'s parameters and buffers are fake tensors (shape, dtype and
    device, no data) of one FakeTensorMode, tied ones the same fake; yields the example inputs
    as fakes of that mode (torch.export takes the mode from them) and the real tensors by
    name. The module's own tensors are put back after the block
    (``torch.nn.utils.stateless``)."""
    import itertools

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.nn.utils.stateless import _reparametrize_module

    mode = FakeTensorMode(shape_env=ShapeEnv())
    real = dict(itertools.chain(model.named_parameters(remove_duplicate=False),
                                model.named_buffers(remove_duplicate=False)))
    by_id: dict[int, Any] = {}
    fakes = {n: by_id.setdefault(id(t), mode.from_tensor(t, static_shapes=True))
             for n, t in real.items()}

    def fake(t: Any) -> Any:
        return mode.from_tensor(t, static_shapes=True) if isinstance(t, torch.Tensor) else t

    tree_map = torch.utils._pytree.tree_map
    with _reparametrize_module(model, fakes, tie_weights=True):
        yield tree_map(fake, args), tree_map(fake, kwargs), real


def bind_weights(onnx_program: Any, weights: dict[str, Any]) -> list[str]:
    """Give the initializers of an ONNX program made on fake weights the real tensors
    ``weights`` (by name; each wrapped as it is, not copied: ``ONNXProgram.apply_weights``),
    and the program's ExportedProgram too. Returns the initializers left fake."""
    onnx_program.apply_weights({n: t for n, t in weights.items()
                                if n in onnx_program.model.graph.initializers})
    ep = getattr(onnx_program, "exported_program", None)
    if ep is not None:
        bind_program(ep, weights)
    return [n for n, v in onnx_program.model.graph.initializers.items()
            if v.const_value is not None and is_fake(getattr(v.const_value, "raw", None))]


def bind_program(program: Any, weights: dict[str, Any]) -> None:
    """Replace the fake tensors of an ExportedProgram's state dict and constants by the real
    tensors ``weights`` of the same names (references: nothing is copied)."""
    for table in (program.state_dict, program.constants):
        for name, t in list(table.items()):
            if name in weights and is_fake(t):
                table[name] = weights[name]


def unbound_tensors(program: Any, weights: dict[str, Any]) -> list[str]:
    """The program's fake state-dict entries and constants with no real tensor in
    ``weights`` (a tensor the model makes while it runs: its value exists only in the
    trace), or of a kind binding cannot take (complex: torch.onnx stores them as real views)."""
    return [n for table in (program.state_dict, program.constants)
            for n, t in table.items() if is_fake(t)
            and (n not in weights or weights[n].is_complex())]


def prepare_for_export(program: Any, registry: Any) -> Any:
    """The program after torch.onnx's decompositions: the FX graph its translation sees.

    Runs without autograd: torch.onnx re-runs the graph on fake tensors (its type-promotion
    pass) with the parameters' ``requires_grad`` set, and autograd refuses some ops on complex
    values there ("slice_scatter does not support automatic differentiation for outputs with
    complex dtype", from ``out[:, :m] = low`` on an rfft). The ONNX graph has no gradients, so
    nothing is lost; the grad mode is restored on return."""
    import torch
    from torch.onnx._internal.exporter import _core

    forget_pending_unbacked(program)
    with warnings.catch_warnings(), torch.no_grad(), decompositions_sped_up():
        warnings.simplefilter("ignore")
        return _core._prepare_exported_program_for_export(program, registry=registry)


def forget_pending_unbacked(program: Any) -> None:
    """Drop the unbacked symbols an earlier pass over ``program`` left pending in its shape
    environment. torch.onnx's passes after the decompositions run ops with data-dependent
    sizes (nonzero) on fake tensors and leave their fresh symbols pending; the next
    ``run_decompositions`` of the same program (a translation again at a lower opset, OM325)
    then fails binding them to its first node ("PendingUnbackedSymbolNotFound: Pending unbacked
    symbols {u6, u7} not in returned outputs"). They belong to a trace that has ended."""
    from torch._guards import detect_fake_mode

    try:
        mode = detect_fake_mode([n.meta.get("val") for n in program.graph.nodes
                                 if n.op == "placeholder"])
    except AssertionError:  # several fake modes: leave them
        return
    env = getattr(mode, "shape_env", None)
    pending = getattr(env, "pending_fresh_unbacked_symbols", None)
    if pending:
        logger.debug("dropping pending unbacked symbols %s", pending)
        pending.clear()


@contextlib.contextmanager
def rnn_loop_decompositions(active: bool = True) -> Iterator[None]:
    """torch's while_loop decompositions of ``aten.lstm.input`` / ``aten.gru.input``
    (``torch.export._patches``; torch.onnx.export enters them when given dynamic shapes).

    Tracing runs an RNN op on fake tensors to get its output shapes; torch's default
    decomposition does that with a Python loop over the time steps (``for x in
    input.unbind(0)``), which specialises a dynamic sequence length to the example's. With
    these, the shapes come out symbolic, and the op itself stays in the graph for torchlib's
    translation (one ONNX LSTM/GRU). Restored on exit (with the ops' dispatch caches, which
    could otherwise keep the patched kernel); a no-op where torch lacks them."""
    if not active:
        yield
        return
    try:
        from torch.export._patches import (
            register_gru_while_loop_decomposition,
            register_lstm_while_loop_decomposition,
        )
    except ImportError:  # pragma: no cover - torch before 2.10
        yield
        return
    import torch

    ops = (torch.ops.aten.lstm.input, torch.ops.aten.gru.input)
    try:
        with register_lstm_while_loop_decomposition(), register_gru_while_loop_decomposition():
            for op in ops:
                op._dispatch_cache.clear()
            yield
    finally:
        for op in ops:
            op._dispatch_cache.clear()


@contextlib.contextmanager
def patched_decompositions(table: dict[Any, Any]) -> Iterator[None]:
    """``table`` (op -> function) in torch's decomposition table, the one FakeTensorMode runs
    for ops without a symbolic meta kernel and ExportedProgram.run_decompositions starts from;
    the previous entries are restored on exit."""
    from torch._decomp import decomposition_table

    missing = object()
    saved = {op: decomposition_table.get(op, missing) for op in table}
    try:
        decomposition_table.update(table)
        yield
    finally:
        for op, fn in saved.items():
            if fn is missing:
                decomposition_table.pop(op, None)
            else:
                decomposition_table[op] = fn


@contextlib.contextmanager
def unused_constants_dropped() -> Iterator[None]:
    """torch.export's constant lifting (``lift_constants_pass._unused_constant``) takes the
    first user of every ``get_attr`` node and raises StopIteration on one without users - a
    tensor constant the trace recorded and nothing read (draft_export's real-tensor
    propagation leaves one behind in gpytorch's exact GP prediction). Within the block such a
    node is dropped like the unused constants the pass already drops."""
    def wrap(original: Any) -> Any:
        def unused_constant(node: Any) -> Any:
            if node.op == "get_attr" and not node.users:
                return [node]
            return original(node)

        return unused_constant

    with _replaced("torch._export.passes.lift_constants_pass", "_unused_constant", wrap):
        yield


def fake_of_real(mode: Any, t: Any) -> Any:
    """The fake tensor fake mode ``mode`` makes of the real tensor ``t`` when an op meets it
    (the one its converter keeps for ``t``)."""
    return mode.fake_tensor_converter.from_real_tensor(mode, t)


def written_arguments(func: Any, args: Any, kwargs: Any) -> list[Any]:
    """The values of the arguments an ATen op writes (in place, ``out=``), read from its
    schema's alias information; [] for an op that writes none or has no schema."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            out.append(kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i])
    return out


@contextlib.contextmanager
def parameters_carry_values(model: Any) -> Iterator[None]:
    """Within the block, a real-tensor-propagating capture (torch.export.draft_export) gives
    the fake tensors of ``model``'s parameters their real values. torch's meta converter copies
    the data of a tensor whose type is exactly ``torch.Tensor`` only (``_safe_copy``), so a
    ``Parameter``'s fake carries uninitialised memory, and a branch on a value computed from
    parameters is decided on garbage - differently from run to run (gpytorch's SVGP: a
    Cholesky of a "covariance" that is not positive definite). A copy each, so that a model
    writing its parameters during the trace leaves the originals alone."""
    def wrap(original: Any) -> Any:
        def fakify(fake_mode: Any, mod: Any) -> Any:
            fakes = original(fake_mode, mod)
            if mod is model and getattr(fake_mode, "propagate_real_tensors", False):
                copies: dict[int, Any] = {}
                for name, p in mod.named_parameters(remove_duplicate=False):
                    fake = fakes.get(name)
                    if fake is None or p.device.type == "meta":
                        continue
                    if id(p) not in copies:
                        copies[id(p)] = p.detach().clone()
                    fake.real_tensor = copies[id(p)]
            return fakes

        return fakify

    with _replaced("torch.export._trace", "_fakify_params_buffers", wrap):
        yield


@contextlib.contextmanager
def _replaced(module: str, attr: str, wrap: Any) -> Iterator[None]:
    """Within the block, ``module.attr`` is ``wrap(original)``; nothing is replaced where a
    later torch has moved or renamed it (the workaround then simply does not apply)."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError:  # pragma: no cover - moved in a later torch
        yield
        return
    with _replaced_on(mod, attr, wrap):
        yield


@contextlib.contextmanager
def _replaced_on(owner: Any, attr: str, wrap: Any) -> Iterator[None]:
    """Within the block, ``owner.attr`` (a module's or a class's) is ``wrap(original)``;
    nothing is replaced where ``owner`` has no such attribute."""
    current = getattr(owner, attr, None)
    if current is None:  # pragma: no cover - moved in a later torch
        yield
        return
    own = vars(owner)
    had, saved = attr in own, own.get(attr)  # a class's own entry (descriptors kept as they are)
    setattr(owner, attr, wrap(current))
    try:
        yield
    finally:
        if had:
            setattr(owner, attr, saved)
        else:  # it was inherited: uncover it again
            delattr(owner, attr)


def stop_real_tensor_propagation(program: Any) -> None:
    """Turn off real-tensor propagation in the fake mode a draft_export program keeps in its
    placeholders' metadata. ``run_decompositions`` re-traces the program in that mode, and
    with propagation on it runs every op on the real values it has - for parameters the
    uninitialised memory torch's meta converter gives them (see
    :func:`parameters_carry_values`), on which a Cholesky fails (gpytorch's SVGP). The
    branches were decided by the capture; the re-trace needs no values."""
    from torch._guards import detect_fake_mode

    try:
        mode = detect_fake_mode([n.meta.get("val") for n in program.graph.nodes
                                 if n.op == "placeholder"])
    except AssertionError:  # several fake modes: leave them
        return
    if mode is not None and getattr(mode, "propagate_real_tensors", False):
        mode.propagate_real_tensors = False


def has_symbolic_inputs(program: Any) -> bool:
    """Whether an ExportedProgram has an input with a symbolic dim."""
    import torch

    for node in program.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" else None
        if isinstance(val, torch.Tensor) and any(not isinstance(d, int) for d in val.shape):
            return True
    return False


def initializer_bytes(ir_graph: Any) -> int:
    """Bytes of the initializers of an onnx_ir graph (as torch.onnx counts them)."""
    from torch.onnx._internal.exporter import _onnx_program

    return int(_onnx_program._count_initializer_size(ir_graph))


def dynamo_knows_builtins() -> None:
    """Make TorchDynamo list the builtins now, before a capture puts its own ``len`` in
    ``builtins``: the list is built lazily, once, from ``builtins.__dict__``, and if that first
    happens under the stand-in, the real ``len`` is missing from it for the rest of the
    process ("Dynamo does not know how to trace the builtin `builtins.len`" in every later
    strict capture)."""
    from torch._dynamo import trace_rules

    trace_rules._builtin_function_ids()


def str_dims_to_export_dims(dynamic_shapes: Any) -> tuple[Any, bool]:
    """torch.onnx's conversion of string dims ({0: "batch"}) to torch.export Dims; the bool
    says whether the ONNX axes must be renamed to the strings afterwards."""
    from torch.onnx._internal.exporter import _dynamic_shapes

    return _dynamic_shapes.convert_str_to_export_dim(dynamic_shapes)


def is_derived_dim(value: Any) -> bool:
    """Whether ``value`` is a torch.export Dim derived from another (``2 * seq``)."""
    from torch.export.dynamic_shapes import _DerivedDim

    return isinstance(value, _DerivedDim)


# torch.onnx's warning for an axis it names once although two inputs name it: noise when the
# two names are the same (input_ids' and attention_mask's "batch"), kept when they differ
SAME_AXIS_NAME = (r"# The axis name: (\S+) will not be used, since it shares the same shape "
                  r"constraints with another axis: \1\.$")


def rename_dynamic_axes(onnx_program: Any, str_dims: Any) -> None:
    """Name the ONNX model's symbolic dims after the user's strings, as torch.onnx does
    (without its warning that a name given twice is used once)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SAME_AXIS_NAME, category=UserWarning)
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




class _SpecialisationRecorder(logging.Handler):
    """Reads ShapeEnv's INFO records while torch.export traces: ``create_symbol s0 = 32 for
    L['x'].size()[3]`` names each symbol's input dim; a guard ``Eq(<expr of one symbol>, n)``
    fixes it to a number, and the Python stack at that moment (this handler runs inside the
    guard's call) says which line did it."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        import re

        self.sources: dict[str, str] = {}
        self.fixed: dict[str, tuple[str, list[Any]]] = {}  # source -> (guard, stack frames)
        # (source, guard, stack frames) of guards on one input dim that divide it (``//``,
        # ``Mod``) or bound it (``s0 >= 8``): a file valid at some sizes only (a multiple of 2)
        self.size_guards: list[tuple[str, str, list[Any]]] = []
        self._any_guard = re.compile(r"^\w+(?: \(forcing_spec\))? (.+?) \[guard added\]")
        self._create = re.compile(r"^create_symbol (\w+) = -?\d+ for (\S+)")
        self._guard = re.compile(r"^\w+(?: \(forcing_spec\))? (Eq\((.+), (-?\d+)\)) \[guard added\]")
        self._symbol = re.compile(r"\b[su]\d+\b")

    def emit(self, record: logging.LogRecord) -> None:
        import traceback

        try:
            msg = record.getMessage()
        except Exception:  # pragma: no cover - a malformed record
            return
        m = self._create.match(msg)
        if m:
            self.sources[m.group(1)] = m.group(2)
            return
        self._size_guard(msg)
        m = self._guard.match(msg)
        if not m:
            return
        symbols = set(self._symbol.findall(m.group(2)))
        if len(symbols) != 1:
            return
        source = self.sources.get(symbols.pop())
        if source is not None and source not in self.fixed:
            self.fixed[source] = (m.group(1), traceback.extract_stack()[:-1])

    def _size_guard(self, msg: str) -> None:
        import traceback

        m = self._any_guard.match(msg)
        if not m or len(self.size_guards) >= 64 or not any(
                w in m.group(1) for w in ("//", "Mod(", ">", "<")):
            return
        symbols = set(self._symbol.findall(m.group(1)))
        source = self.sources.get(symbols.pop()) if len(symbols) == 1 else None
        if source is not None:
            self.size_guards.append((source, m.group(1), traceback.extract_stack()[:-2]))


@contextlib.contextmanager
def record_specialisations(active: bool = True, size_guards: list[Any] | None = None
                           ) -> Iterator[dict[str, tuple[str, list[Any]]]]:
    """While torch.export traces: input dim (``L['x'].size()[3]``) -> (the guard that fixed it
    to a number, e.g. ``Eq(s0 - 1, 31)``, the Python stack where it was added). ShapeEnv's
    logger is set to INFO for the duration (its handlers filtered to what they showed before)
    and restored. ``size_guards`` (a list) receives (input dim, guard, stack) for each guard that
    divides or bounds one input dim (``Eq(2*((s0 - 1)//2) + 2, s0)``: the dim is even)."""
    out: dict[str, tuple[str, list[Any]]] = {}
    if not active:
        yield out
        return
    log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    handler = _SpecialisationRecorder()
    level, propagate = log.level, log.propagate
    # a program may have silenced logging as a whole (logging.disable(logging.WARNING), common
    # in notebooks): records at or below that level are then never made, for this logger too
    disabled = logging.root.manager.disable
    quiet = _BelowLevel(max(log.getEffectiveLevel(), disabled + 1))
    asked = log.isEnabledFor(logging.INFO)  # the user asked for them (TORCH_LOGS): unchanged
    others = [] if asked else list(log.handlers)
    for h in others:  # torch's own stderr handler sits on this logger: keep it as quiet
        h.addFilter(quiet)
    log.addHandler(handler)
    if not asked:  # the records it now emits reach this recorder only
        log.setLevel(logging.INFO)
        log.propagate = False
        if disabled >= logging.INFO:  # this logger alone made to emit them again
            log.isEnabledFor = lambda lvl: lvl >= logging.INFO  # type: ignore[method-assign]
    try:
        yield out
    finally:
        log.__dict__.pop("isEnabledFor", None)
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate
        for h in others:
            h.removeFilter(quiet)
        out.update(handler.fixed)
        if size_guards is not None:
            size_guards.extend(handler.size_guards)


def export_guards(program: Any) -> list[str]:
    """The guards on the input sizes torch.export recorded for ``program``, as Python
    expressions over ``L['x'].size()[i]`` (``L['x'].size()[2] == (2*(L['x'].size()[2] // 2))``);
    the ONNX file keeps none of them. Empty when this torch does not keep them."""
    return [g for g in getattr(program, "_guards_code", None) or [] if isinstance(g, str)]


class _BelowLevel(logging.Filter):
    """Drops records below ``level`` (what a handler saw before the logger was opened up)."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level


def dispatch_mode_base() -> type:
    """torch's TorchDispatchMode (torch.utils._python_dispatch): the base of a mode that sees
    every aten call, as verify/upstream's TopK recorder does."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode
