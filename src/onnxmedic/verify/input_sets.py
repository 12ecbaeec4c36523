"""The input sets verification runs on besides the example: derived sets of the same shapes,
branch probes (meant to send data-dependent branches the other way), and shape variants (each
dynamic dim of the ONNX model at other sizes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from onnxmedic._tensors import tensor_like
from onnxmedic.inputs import DEFAULT_SEED, Inputs


def branch_probe_sets(inputs: Inputs, masks: bool = False) -> list[Inputs]:
    """Input sets meant to send data-dependent branches (``if x.sum() > 0``, ``if x.max() >
    t``) the other way: the float inputs negated, zeroed, and scaled by 100. Integer and bool
    inputs are kept (they are often indices) -- except 0-d integer tensors, which are counts as
    often (``for i in range(k.item())``, ``torch.split(x, k.item())``): a further set adds 1 to
    each of them, so a loop count or size specialised to the example's value shows up. With
    ``masks`` (a branch taken through a boolean mask, capture.masked), one more set scales
    every third element by 100, so that a mask on the values (``|x| <= bound``) selects some
    elements and not others, across rows and columns alike."""
    def is_count(t: Any) -> bool:
        return (isinstance(t, torch.Tensor) and t.dim() == 0 and not t.dtype.is_floating_point
                and not t.dtype.is_complex and t.dtype != torch.bool)

    def is_float(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.dtype.is_floating_point

    def mapped(pick: Any, fn: Any, label: str) -> Inputs:
        def vary(t: Any) -> Any:
            return fn(t) if pick(t) else t
        return Inputs(tuple(torch.utils._pytree.tree_map(vary, a) for a in inputs.args),
                      {n: torch.utils._pytree.tree_map(vary, v) for n, v in inputs.kwargs.items()},
                      [label])

    out = []
    if any(is_count(t) for t in torch.utils._pytree.tree_leaves((inputs.args, inputs.kwargs))):
        out.append(mapped(is_count, lambda t: t + 1, "integer scalars +1"))
    for label, fn in (("negated", lambda t: -t), ("zeros", torch.zeros_like),
                      ("scaled x100", lambda t: t * 100)):
        out.append(mapped(is_float, fn, label))
    if masks:
        out.append(mapped(is_float, _every_third_scaled, "every third element x100"))
    return out


def _every_third_scaled(t: torch.Tensor) -> torch.Tensor:
    scale = torch.ones(t.numel(), dtype=t.dtype, device=t.device)
    scale[::3] = 100
    return t * scale.reshape(t.shape)


EXTRA_INPUT_SETS = 2


def same_shape_sets(example: Inputs, onnx_dims: list[list[int | str | None]]) -> list[Inputs]:
    """The further sets of the example's shapes verification runs: EXTRA_INPUT_SETS of them
    where the model has no dynamic dim, one (the example's values permuted) where it has: its
    shape variants draw fresh values in each tensor's range already, as the second set would."""
    count = 1 if dim_symbols(example, onnx_dims) else EXTRA_INPUT_SETS
    return derived_input_sets(example, count)


def derived_input_sets(inputs: Inputs, count: int, seed: int = DEFAULT_SEED) -> list[Inputs]:
    """Further input sets of the same shapes and dtypes, for verification.

    Floats: the first set permutes the example's own values (the domain and distribution stay
    those of the example: an erfinv input stays inside (-1, 1)); later sets draw uniformly
    between the example's min and max. Integers and booleans are permuted (indices stay valid).
    """
    gen = torch.Generator().manual_seed(seed + 1)
    out = []

    def vary(t: Any, k: int) -> Any:
        if not isinstance(t, torch.Tensor) or t.numel() <= 1:
            return t
        flat = t.reshape(-1)
        if k % 2 == 0 or not t.dtype.is_floating_point:
            perm = torch.randperm(flat.numel(), generator=gen)
            return flat[perm].reshape(t.shape).clone()
        finite = flat[torch.isfinite(flat)].double()
        if finite.numel() == 0:
            return t.clone()
        lo, hi = float(finite.min()), float(finite.max())
        r = torch.rand(t.shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo
        return r.to(t.dtype)

    for k in range(count):
        args = tuple(torch.utils._pytree.tree_map(lambda t: vary(t, k), a) for a in inputs.args)
        kwargs = {n: torch.utils._pytree.tree_map(lambda t: vary(t, k), v)
                  for n, v in inputs.kwargs.items()}
        out.append(Inputs(args, kwargs, [f"derived#{k + 1}"]))
    return out


def dim_symbols(example: Inputs, onnx_dims: list[list[int | str | None]]
                ) -> dict[str, tuple[int, list[tuple[int, int]]]]:
    """Each dynamic dim name of the ONNX model -> (its size in the example, [(leaf index, dim)
    it sizes]), the leaves those of ``(example.args, example.kwargs)``; ``onnx_dims`` as for
    :func:`shape_variants`. {} when the inputs do not line up with the graph's."""
    leaves = torch.utils._pytree.tree_leaves((example.args, example.kwargs))
    tensor_idx = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    if len(tensor_idx) != len(onnx_dims):
        return {}
    symbols: dict[str, tuple[int, list[tuple[int, int]]]] = {}
    for k, (li, dims) in enumerate(zip(tensor_idx, onnx_dims)):
        t = leaves[li]
        for d, v in enumerate(dims):
            if isinstance(v, int) or d >= t.dim():
                continue
            name = v if v else f"input{k}.dim{d}"
            _, uses = symbols.setdefault(name, (int(t.shape[d]), []))
            uses.append((li, d))
    return symbols


def shape_variants(example: Inputs, onnx_dims: list[list[int | str | None]],
                   seed: int = DEFAULT_SEED, rules: dict[str, Any] | None = None,
                   only_allowed: bool = False) -> list[tuple[str, Inputs]]:
    """Input sets where one dynamic dimension of the ONNX model takes another size.

    ``onnx_dims`` holds, per ONNX graph input (in the flattened order of the example's tensors),
    its dims: an int for a static dim, a name (dim_param) or None for a dynamic one. Inputs that
    share a name share the size. For each name: size 1 and the first prime above the example's
    size (2 and 3 when the example has 1). The larger size catches what only goes wrong above
    the example (tables or caches sized by it: any larger size shows them); being prime, it
    also catches a file that only works at the example's parity or divisibility: torch.export
    can follow a branch on ``h % 2`` (a UNet padding odd sizes) without a guard, and the file
    then fails at odd sizes. One size does both, so a dim costs two more runs, not three, and
    the nearest such size keeps them cheap (BERT-base's sequence: 131, not 257). A derived dim (its name an
    expression such as ``2*s0``) takes exactly twice the example: only multiples are valid
    there. A name with a size rule (``rules``: name -> verify.size_rules.SizeRule) that
    excludes one of those sizes is checked at sizes the rule allows too (all of them where it
    excludes the larger size, else those below the example) - only then can the rule explain a
    failure; ``only_allowed``: at those only. Values are drawn within each tensor's own range.
    """
    symbols = dim_symbols(example, onnx_dims)
    rules = rules or {}

    def sizes(name: str) -> Callable[[int], list[int]]:
        def at(n: int) -> list[int]:
            rule = rules.get(name)
            allowed = set(rule.check_sizes(n)) - {n} if rule is not None else set()
            if rule is not None and only_allowed:
                return sorted(allowed)
            derived = any(c in name for c in "*+-/%() ")
            big = 3 if n == 1 else 2 * n if derived else next_prime(n)
            usual = {2 if n == 1 else 1, big}
            if rule is None or all(rule.allows(s) for s in usual):
                return sorted(usual)  # the rule predicts no failure: nothing more to learn
            # sizes the rule allows stand in for those it excludes: all of them where the
            # larger size is excluded (a multiple of k), else only the smaller (a minimum)
            return sorted(usual | (allowed if not rule.allows(big) else
                                   {s for s in allowed if s < n}))

        return at

    gen = torch.Generator().manual_seed(seed + 101)
    out: list[tuple[str, Inputs]] = []
    for name, entry in symbols.items():  # one symbol at a time: its own sizes
        out += resized_sets(example, {name: entry}, sizes(name), gen)
    return out


def next_prime(n: int) -> int:
    """The first prime above ``n``."""
    p = n + 1
    while p < 2 or any(p % q == 0 for q in range(2, int(p ** 0.5) + 1)):
        p += 1
    return p


def resized_sets(example: Inputs, symbols: dict[str, Any], sizes: Callable[[int], list[int]],
                 gen: torch.Generator) -> list[tuple[str, Inputs]]:
    """One input set per symbol and size in ``sizes(example size)``: the tensors the symbol
    sizes (``symbols[name]`` = (example size, [(leaf index, dim), ...]), the leaves being those
    of ``(example.args, example.kwargs)``) resized, values drawn in each tensor's own range."""
    leaves, spec = torch.utils._pytree.tree_flatten((example.args, example.kwargs))
    out = []
    for name, (n, uses) in symbols.items():
        for size in sizes(n):
            new = list(leaves)
            for li in {li for li, _ in uses}:
                t = leaves[li]
                shape = list(t.shape)
                for li2, d in uses:
                    if li2 == li:
                        shape[d] = size
                new[li] = tensor_like(t, tuple(shape), gen)
            args, kwargs = torch.utils._pytree.tree_unflatten(new, spec)
            out.append((f"{name}={size}", Inputs(tuple(args), dict(kwargs), [f"{name}={size}"])))
    return out
