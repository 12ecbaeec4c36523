"""A stand-in library with a cache keyed on tensor sizes and a documented switch around it
(tensorly's opt_einsum plugin and einx's graph cache, in small): ``row_sums`` plans from the
sizes as Python ints and caches the plan under them; ``use_plain()`` bypasses the cache for the
same sums, ``use_planned()`` turns it back on."""

from __future__ import annotations

import torch

PLANS: dict[tuple[int, ...], tuple[int, int]] = {}
PLANNED = True


def use_plain() -> None:
    global PLANNED
    PLANNED = False


def use_planned() -> None:
    global PLANNED
    PLANNED = True


def row_sums(x: torch.Tensor) -> torch.Tensor:
    if not PLANNED:
        return x.sum(-1)
    key = tuple(int(s) for s in x.shape)  # symbolic sizes: fixed, or (kept) unhashable
    plan = PLANS.get(key)
    if plan is None:
        plan = PLANS[key] = (key[0], key[-1])
    return x.reshape(plan).sum(-1)
