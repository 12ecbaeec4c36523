"""The user's model is borrowed, not taken: record what export may change and put it back.

``model.train(True)`` after export would set *every* submodule to training mode, clobbering a
model whose submodules were in mixed modes (e.g. a frozen batch-norm backbone in eval under a
root in train). These helpers save and restore each submodule's own ``training`` flag, and the
state a model writes when it runs - buffers and plain Python attributes alike (a cache and the
length it is filled to, a counter, an initialised-once flag): export runs the model several
times, at several sizes, and a buffer put back beside an attribute left as written would leave
the model inconsistent (rotary-embedding-torch's ``cached_freqs`` beside
``cached_freqs_seq_len``).
"""

from __future__ import annotations

import logging
import types
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)


def module_modes(model: torch.nn.Module) -> list[tuple[torch.nn.Module, bool]]:
    """Return each submodule (the model included) with its own ``training`` flag."""
    return [(m, m.training) for m in model.modules()]


def restore_modes(modes: list[tuple[torch.nn.Module, bool]]) -> None:
    """Set back the ``training`` flag of every module recorded by :func:`module_modes`.

    Only the flag is written (``module.training = flag``), not ``module.train()``, which would
    recurse into children and could run a user's overridden ``train``.
    """
    for module, flag in modes:
        if module.training != flag:
            module.training = flag


# Buffers are copied before export so that their values can be put back; above this many bytes
# in all they are not (the copy would cost memory on a big model), and a change is only named.
BUFFER_COPY_LIMIT = 256 * 2**20


# what every nn.Module keeps in its __dict__ (parameters, buffers, submodules, hooks, the
# training flag): not the model's own attributes
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) | {"training"}
_MISSING = object()
_CONTAINERS = (dict, list, set)
# the dicts of hooks every nn.Module keeps (forward, backward, state_dict ...)
_HOOK_DICTS = tuple(k for k, v in vars(torch.nn.Module()).items()
                    if "hook" in k and isinstance(v, dict))
_SCALARS = (int, float, bool, str, bytes, type(None))


@dataclass
class State:
    """What :func:`record_state` saw: each buffer (its module, name, tensor, version counter and
    a copy of its value), each parameter's version counter and data pointer, and each module's own attributes
    (module, qualified prefix, {name: value}, {name: shallow copy of a dict/list/set value})."""

    buffers: list[tuple[torch.nn.Module, str, str, torch.Tensor, int, torch.Tensor | None]] = (
        field(default_factory=list))
    params: list[tuple[str, torch.Tensor, int, int, tuple[Any, ...] | None]] = field(
        default_factory=list)
    attributes: list[tuple[torch.nn.Module, str, dict[str, Any], dict[str, Any]]] = field(
        default_factory=list)
    copied: bool = True  # the buffers' values were copied (not above BUFFER_COPY_LIMIT)
    # objects reachable from the modules' attributes (``reach=True``): (object, shallow copy of
    # its __dict__, or of the dict/list/set itself)
    objects: list[tuple[Any, Any]] = field(default_factory=list)
    # each module's hook dicts: (module, qualified prefix, {dict name: shallow copy})
    hooks: list[tuple[torch.nn.Module, str, dict[str, dict[Any, Any]]]] = field(
        default_factory=list)


@dataclass
class Written:
    """What the model wrote since :func:`record_state`: qualified names of the buffers
    (replaced or written in place), attributes (assigned, added, removed, or a dict/list/set
    attribute changed in place) and parameters (written in place, or ``.data`` replaced)."""

    buffers: list[str] = field(default_factory=list)
    attributes: list[str] = field(default_factory=list)
    params: list[str] = field(default_factory=list)
    before: dict[str, Any] = field(default_factory=dict)  # attribute -> its value before (if any)
    # qualified name -> (module, attribute name), for the finding's lines
    owners: dict[str, tuple[torch.nn.Module, str]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.buffers or self.attributes or self.params)


def restorable(state: State, written: Written) -> bool:
    """Whether :func:`restore_state` can put back all of ``written``'s buffers and attributes
    (a buffer too large to have been copied keeps the values written)."""
    return state.copied or not written.buffers


def _own_attributes(mod: torch.nn.Module) -> dict[str, Any]:
    return {k: v for k, v in vars(mod).items() if k not in _MODULE_INTERNALS}


def record_state(model: torch.nn.Module, *, values: bool = True, reach: bool = False) -> State:
    """Record the model's buffers (values copied, up to ``BUFFER_COPY_LIMIT`` bytes in all;
    not with ``values=False``), its parameters' version counters (no copy: an in-place write
    bumps the counter), every module's own attributes (the values, and a shallow copy of
    each dict, list or set) and its hooks (a shallow copy of each hook dict). With ``reach``, also the plain objects those attributes hold, and
    the objects they hold in turn (see :func:`_reachable`): a memo cache on an object a module
    keeps (linear_operator's ``_memoize_cache`` on a cached distribution) is put back too."""
    state = State()
    total = sum(b.numel() * b.element_size() for b in model.buffers())
    copy = state.copied = values and total <= BUFFER_COPY_LIMIT
    seen: set[int] = set()
    for prefix, mod in model.named_modules():
        for name, buf in mod._buffers.items():
            if buf is None or buf.device.type == "meta":
                continue
            qual = f"{prefix}.{name}" if prefix else name
            state.buffers.append((mod, name, qual, buf, buf._version,
                                  buf.detach().clone() if copy and id(buf) not in seen else None))
            seen.add(id(buf))
        attrs = _own_attributes(mod)
        state.attributes.append((mod, prefix, attrs, {
            k: type(v)(v) for k, v in attrs.items() if type(v) in _CONTAINERS}))
        state.hooks.append((mod, prefix, {k: dict(d) for k in _HOOK_DICTS
                                          if isinstance(d := vars(mod).get(k), dict)}))
    # the data pointer too: ``param.data = new`` (normflows' ActNorm) bumps no counter; and a
    # fingerprint of the values: ``param.data.copy_(v)`` (gpytorch's variational
    # initialisation) bumps no counter of the parameter's either
    params = list(model.named_parameters())
    sized = sum(p.numel() * p.element_size() for _, p in params) <= PARAM_FINGERPRINT_LIMIT
    state.params = [(n, p, p._version, _ptr(p), tensor_fingerprint(p) if values and sized
                     else None) for n, p in params]
    if reach:
        state.objects = _reachable([v for _, _, attrs, _ in state.attributes
                                    for v in attrs.values()])
    return state


# how far and how many plain objects :func:`_reachable` records (a cache of caches is two deep)
REACH_DEPTH = 6
REACH_LIMIT = 20000
_ENTER_LIMIT = 1000  # a container with more items is recorded but not entered
_OPAQUE = (torch.Tensor, torch.nn.Module, type, types.ModuleType, types.BuiltinFunctionType,
           types.FunctionType, types.MethodType)


def _reachable(roots: list[Any]) -> list[tuple[Any, Any]]:
    """(object, shallow copy) of the dicts, lists, sets and plain objects (their ``__dict__``)
    reachable from ``roots`` through container items and object attributes, breadth first,
    up to ``REACH_DEPTH`` steps and ``REACH_LIMIT`` objects. Tensors, modules (recorded as
    modules), classes, functions and Python modules are not entered."""
    out: list[tuple[Any, Any]] = []
    seen: set[int] = set()
    level = list(roots)
    for _ in range(REACH_DEPTH):
        nxt: list[Any] = []
        for obj in level:
            if type(obj) in _SCALARS or isinstance(obj, _OPAQUE) or id(obj) in seen \
                    or callable(obj) and not hasattr(obj, "__dict__"):
                continue
            seen.add(id(obj))
            if type(obj) in _CONTAINERS:
                out.append((obj, type(obj)(obj)))
                if len(obj) <= _ENTER_LIMIT:
                    nxt += list(obj.values()) if isinstance(obj, dict) else list(obj)
            elif type(obj) is tuple:
                nxt += list(obj) if len(obj) <= _ENTER_LIMIT else []
            else:
                d = getattr(obj, "__dict__", None)
                if type(d) is not dict:
                    continue
                out.append((obj, dict(d)))
                nxt += list(d.values())
            if len(out) >= REACH_LIMIT:
                return out
        level = nxt
    return out


# parameters are not copied; up to this many bytes in all, a fingerprint of their values is
# taken to see writes through ``.data``
PARAM_FINGERPRINT_LIMIT = 4 * BUFFER_COPY_LIMIT


def _ptr(p: torch.Tensor) -> int:
    """The parameter's data pointer; 0 for a fake one (a capture on fake weights: no data)."""
    from onnxmedic._torch_compat import is_fake

    return 0 if is_fake(p) else p.data_ptr()


def tensor_fingerprint(p: torch.Tensor) -> tuple[Any, ...] | None:
    """A fingerprint of a floating-point parameter's values, or None.

    A plain CPU tensor: the CRC-32 of its bytes (any changed byte changes it; about 40x
    faster than a float64 sum and norm, which took ~0.4 s for a 33 MB model, and the
    fingerprint is taken two or three times per export). Other tensors (a GPU one, a tensor
    subclass, a sparse layout): the sum and the 2-norm of the values in float64."""
    from onnxmedic._torch_compat import is_fake

    if not p.is_floating_point() or p.device.type == "meta" or is_fake(p):
        return None
    with torch.no_grad():
        d = p.detach()
        if (d.device.type == "cpu" and d.layout == torch.strided
                and type(d) in (torch.Tensor, torch.nn.Parameter)):
            try:
                raw = d.reshape(-1).contiguous().view(torch.uint8).numpy()
            except (RuntimeError, TypeError):  # a tensor numpy cannot see (a neg/conj view)
                raw = None
            if raw is not None:
                return ("crc32", d.numel(), zlib.crc32(raw))
        return ("sum-norm", float(d.sum(dtype=torch.float64)),
                float(torch.linalg.vector_norm(d, dtype=torch.float64)))


def params_written(state: State) -> list[str]:
    """The parameters written since ``state``: in place (version counter), ``.data`` replaced
    (data pointer) or written through ``.data`` (fingerprint)."""
    return [n for n, p, version, ptr, values in state.params
            if p._version != version or _ptr(p) != ptr
            or values is not None and repr(tensor_fingerprint(p)) != repr(values)]


def _same_contents(saved: Any, now: Any) -> bool:
    """A dict/list/tuple/set against its shallow copy, by identity of the items (no tensor
    ==)."""
    if len(saved) != len(now):
        return False
    if isinstance(saved, dict):
        return saved.keys() == now.keys() and all(now[k] is v for k, v in saved.items())
    if isinstance(saved, (list, tuple)):
        return all(a is b for a, b in zip(saved, now))
    return {id(x) for x in saved} == {id(x) for x in now}


def _equivalent(old: Any, new: Any) -> bool:
    """An equal number or string assigned again, or a container replaced by one of the same
    type with the same items (torch.export puts back module attributes as copies of them)."""
    if type(old) is not type(new):
        return False
    if type(old) in _SCALARS:
        return old == new
    if isinstance(old, (dict, list, tuple, set, frozenset)):
        return _same_contents(old, new)
    return False


def _attributes_written(state: State) -> list[tuple[torch.nn.Module, str, str, dict[str, Any],
                                                    dict[str, Any], bool]]:
    """(module, attribute, qualified name, the module's recorded attributes, their container
    copies, whether the change is only an equivalent object) of each attribute written since
    ``state``."""
    out = []
    for mod, prefix, attrs, copies in state.attributes:
        now = vars(mod)
        names = set(attrs) | {k for k in now if k not in _MODULE_INTERNALS}
        for name in sorted(names):
            old, new = attrs.get(name, _MISSING), now.get(name, _MISSING)
            if old is new:
                if name in copies and not _same_contents(copies[name], new):
                    out.append((mod, name, f"{prefix}.{name}" if prefix else name, attrs, copies,
                                False))
            elif not (type(old) in _SCALARS and _equivalent(old, new)):
                out.append((mod, name, f"{prefix}.{name}" if prefix else name, attrs, copies,
                            _equivalent(old, new)))
    return out


def written_since(state: State, *, params: bool = True) -> Written:
    """What the model wrote since :func:`record_state` recorded ``state`` (nothing is put
    back). ``params=False``: the parameters are not looked at (``params`` stays empty; their
    fingerprints are the costly part); :func:`params_written` gives them."""
    written = Written()
    for mod, name, qual, buf, version, _ in state.buffers:
        if mod._buffers.get(name) is not buf or buf._version != version:
            written.buffers.append(qual)
            written.owners[qual] = (mod, name)
    for mod, name, qual, attrs, _, same in _attributes_written(state):
        if same:
            continue
        written.attributes.append(qual)
        if name in attrs:
            written.before[qual] = attrs[name]
        written.owners[qual] = (mod, name)
    if params:
        written.params = params_written(state)
    return written


def restore_state(state: State) -> tuple[list[str], list[str]]:
    """Put back every buffer as :func:`record_state` saw it (the same tensor, its value) and
    every module's own attributes (the same objects; a dict, list or set changed in place gets
    its items back), and return (names of the buffers and attributes put back, names of the
    parameters written in place since). A buffer too large to have been copied gets its tensor
    back but keeps the values written."""
    restored: list[str] = []
    for mod, name, qual, buf, version, saved in state.buffers:
        changed = False
        if mod._buffers.get(name) is not buf:  # replaced by another tensor: the original back
            mod._buffers[name] = buf
            changed = True
        if buf._version != version and saved is not None:
            with torch.no_grad():
                buf.copy_(saved)
            changed = True
        if changed:
            restored.append(qual)
    for mod, name, qual, attrs, copies, same in _attributes_written(state):
        # written into __dict__ as torch.export's own attribute restore does: a class's
        # __setattr__ may have side effects
        if name not in attrs:
            vars(mod).pop(name, None)
        else:
            value = attrs[name]
            if name in copies:  # the same container as before, with its items back
                _refill(value, copies[name])
            vars(mod)[name] = value
        if not same:  # an equivalent copy gets the original object back without a word
            restored.append(qual)
    for obj, saved in state.objects:
        now = obj if type(obj) in _CONTAINERS else vars(obj)
        if _same_contents(saved, now):
            continue
        _refill(now, saved)  # in place: the same objects, as for module attributes
        restored.append(f"<{type(obj).__name__} held by an attribute>")
    restored += _restore_hooks(state)
    return restored, params_written(state)


def _restore_hooks(state: State) -> list[str]:
    """Put back each module's hook dicts as recorded (in place: a hook's RemovableHandle keeps
    a reference to its dict); returns one entry naming the modules whose hooks changed."""
    changed: list[str] = []
    for mod, prefix, saved in state.hooks:
        now = vars(mod)
        for name in _HOOK_DICTS:
            hooks = now.get(name)
            if not isinstance(hooks, dict) or name not in saved:
                continue
            if not _same_contents(saved[name], hooks):
                _refill(hooks, saved[name])
                if not changed or changed[-1] != (prefix or "<model>"):
                    changed.append(prefix or "<model>")
    if not changed:
        return []
    return [f"hooks of {len(changed)} module(s) (registered by a call: "
            f"{', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''})"]


def _refill(container: Any, items: Any) -> None:
    """``container`` (a dict, list or set) holding ``items`` again, the same object."""
    container.clear()
    if isinstance(container, list):
        container.extend(items)
    else:
        container.update(items)


# -- inputs -----------------------------------------------------------------------------------
# The example inputs are borrowed like the model: every run of the model gets its own copy, so
# that a model that writes an input (``x.add_(1)``, ``x[0] = v``, ``x.index_add_``) changes
# neither the caller's tensors nor the inputs of the runs after it (the references are computed
# on pristine copies).


def _copy_leaf(leaf: Any, memo: dict[int, Any]) -> Any:
    """A tensor: a detached clone (same strides where possible, same ``requires_grad``); a
    plain Python value: itself; any other object (a cache object, a user class): a deep copy
    (the object itself when it cannot be copied)."""
    if id(leaf) in memo:
        return memo[id(leaf)]
    if isinstance(leaf, torch.Tensor):
        from onnxmedic._torch_compat import is_fake

        if leaf.device.type == "meta" or is_fake(leaf):
            out: Any = leaf
        else:
            with torch.no_grad():
                out = leaf.detach().clone()
            if leaf.requires_grad and leaf.is_leaf:
                out.requires_grad_(True)
    elif type(leaf) in _SCALARS or isinstance(leaf, (torch.dtype, torch.device, torch.Size,
                                                      type, types.FunctionType)):
        out = leaf
    else:
        import copy

        try:
            out = copy.deepcopy(leaf, {k: v for k, v in memo.items()})
        except Exception:  # noqa: BLE001 - an object that cannot be copied is lent as it is
            logger.debug("input of type %s not copied", type(leaf).__name__)
            out = leaf
    memo[id(leaf)] = out
    return out


def copy_inputs(value: Any) -> Any:
    """A copy of example inputs (a tensor, or tuples, lists, dicts, named tuples and other
    pytree containers of them, nested): every tensor cloned, the structure rebuilt; a tensor
    that appears twice is cloned once (the copy keeps that aliasing)."""
    memo: dict[int, Any] = {}
    return torch.utils._pytree.tree_map(lambda leaf: _copy_leaf(leaf, memo), value)


def _path_name(path: Any) -> str:
    return ("args" if path[0].idx == 0 else "kwargs") + torch.utils._pytree.keystr(path[1:])


def _leaves(args: Any, kwargs: Any) -> list[tuple[str, Any]]:
    """(path, leaf) of every leaf of the inputs: ``args[0]``, ``args[1][2]``,
    ``kwargs['cache']``."""
    flat, _ = torch.utils._pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
    return [(_path_name(path), leaf) for path, leaf in flat]


def _structures(args: Any, kwargs: Any) -> dict[str, Any]:
    """Each top-level input's container structure (pytree spec) by name."""
    out = {f"args[{i}]": torch.utils._pytree.tree_structure(a) for i, a in enumerate(args)}
    out.update({f"kwargs[{k!r}]": torch.utils._pytree.tree_structure(v)
                for k, v in kwargs.items()})
    return out


@dataclass
class InputRecord:
    """A copy of the inputs before a run: the tensors (path, tensor, version counter, a copy
    of its value, shape), every leaf's identity by path, and each input's structure (a list
    element replaced or appended, a dict key added, is a write too)."""

    tensors: list[tuple[str, torch.Tensor, int, torch.Tensor | None, tuple[int, ...]]] = (
        field(default_factory=list))
    leaves: dict[str, int] = field(default_factory=dict)
    structures: dict[str, Any] = field(default_factory=dict)
    inputs: tuple[Any, Any] = ((), {})


def record_inputs(args: Any, kwargs: Any) -> InputRecord:
    """Record the inputs' tensors (version counters, values and shapes) and containers before
    a run."""
    leaves = _leaves(args, kwargs)
    rec = InputRecord(leaves={n: id(v) for n, v in leaves},
                      structures=_structures(args, kwargs), inputs=(args, kwargs))
    for name, t in leaves:
        if not isinstance(t, torch.Tensor):
            continue
        from onnxmedic._torch_compat import is_fake

        plain = t.device.type != "meta" and not is_fake(t)
        with torch.no_grad():
            saved = t.detach().clone() if plain else None
        rec.tensors.append((name, t, t._version, saved, tuple(t.shape)))
    return rec


def inputs_written(rec: InputRecord) -> list[str]:
    """The paths of the inputs a run wrote: a tensor in place (version counter), resized, or
    with other values (a write through ``.data``); a container element replaced, added or
    removed."""
    out = []
    for name, t, version, saved, shape in rec.tensors:
        if t._version != version or tuple(t.shape) != shape:
            out.append(name)
        elif saved is not None and not same_tensor(saved, t):
            out.append(name)
    args, kwargs = rec.inputs
    now = _structures(args, kwargs)
    changed = [n for n, spec in rec.structures.items() if now.get(n) != spec]
    for name, leaf in _leaves(args, kwargs):
        if any(name.startswith(c) for c in changed):
            continue
        if rec.leaves.get(name, id(leaf)) != id(leaf) and name not in out:
            out.append(name)  # an element replaced by another object
    return changed + out


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal: dtype, shape and bytes (a NaN equal to the same NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.is_quantized or b.is_quantized:  # no byte view of a quantized tensor (it crashes)
        return (a.is_quantized and b.is_quantized and a.qscheme() == b.qscheme()
                and bool(torch.equal(a.int_repr(), b.int_repr()))
                and bool(torch.equal(a.dequantize(), b.dequantize())))
    if a.layout != torch.strided or b.layout != torch.strided:
        return bool(torch.equal(a.to_dense(), b.to_dense()))
    x, y = a.detach().reshape(-1).contiguous(), b.detach().reshape(-1).contiguous()
    if x.dtype.is_complex:
        x, y = torch.view_as_real(x), torch.view_as_real(y)
    if x.dtype == torch.bool:
        return bool(torch.equal(x, y))
    try:
        return bool(torch.equal(x.view(torch.uint8), y.view(torch.uint8)))
    except RuntimeError:
        return bool(torch.equal(x, y))


def same_inputs(a: Any, b: Any) -> bool:
    """Whether two input structures are bit-equal: the same containers (types, keys,
    lengths) and bit-equal tensors; other leaves compared with ``==`` where they can be."""
    fa, sa = torch.utils._pytree.tree_flatten(a)
    fb, sb = torch.utils._pytree.tree_flatten(b)
    if sa != sb or len(fa) != len(fb):
        return False
    for x, y in zip(fa, fb):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                    and same_tensor(x, y)):
                return False
        elif type(x) in _SCALARS and x != y:
            return False
    return True


def to_eval(model: torch.nn.Module) -> None:
    """``model.eval()``; on a module that refuses it (a ``torch.export``-ed module, e.g. a PT2E
    quantized one: "Calling train() or eval() is not supported for exported models"), each
    submodule's ``training`` flag is set to False directly - the exported graph fixed its
    train/eval behaviour at capture, so only the flag is left to set."""
    try:
        model.eval()
    except NotImplementedError:
        for m in model.modules():
            m.training = False


def returned_as(rec: InputRecord, written: list[str], outputs: list[Any]) -> dict[str, int]:
    """Written input path -> the index of the output (flattened) that is that tensor after
    the run, the same object or a view of the same memory with its shape: ``return x.add_(1)``
    hands the new value back, so the ONNX file has it as that output."""
    out: dict[str, int] = {}
    now = dict(_leaves(*rec.inputs))
    for name in written:
        t = now.get(name)
        if not isinstance(t, torch.Tensor) or t.is_quantized or t.device.type == "meta":
            continue
        for i, o in enumerate(outputs):
            if not isinstance(o, torch.Tensor) or o.is_quantized or o.device.type == "meta":
                continue
            try:
                same = o is t or (o.shape == t.shape and o.data_ptr() == t.data_ptr()
                                  and o.stride() == t.stride())
            except RuntimeError:  # a tensor without storage
                same = o is t
            if same:
                out[name] = i
                break
    return out
