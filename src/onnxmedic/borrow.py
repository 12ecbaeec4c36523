"""The user's model is borrowed, not taken: record what export may change and put it back.

``model.train(True)`` after export would set *every* submodule to training mode, clobbering a
model whose submodules were in mixed modes (e.g. a frozen batch-norm backbone in eval under a
root in train). These helpers save and restore each submodule's own ``training`` flag, and the
buffers a model writes when it runs (caches, counters): export runs the model several times, at
several sizes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

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


@dataclass
class State:
    """What :func:`record_state` saw: each buffer (its module, name, tensor, version counter and
    a copy of its value) and each parameter's version counter."""

    buffers: list[tuple[torch.nn.Module, str, str, torch.Tensor, int, torch.Tensor | None]] = (
        field(default_factory=list))
    params: list[tuple[str, torch.Tensor, int]] = field(default_factory=list)


def record_state(model: torch.nn.Module) -> State:
    """Record the model's buffers (values copied, up to ``BUFFER_COPY_LIMIT`` bytes in all) and
    its parameters' version counters (no copy: an in-place write bumps the counter)."""
    state = State()
    total = sum(b.numel() * b.element_size() for b in model.buffers())
    copy = total <= BUFFER_COPY_LIMIT
    seen: set[int] = set()
    for prefix, mod in model.named_modules():
        for name, buf in mod._buffers.items():
            if buf is None or buf.device.type == "meta":
                continue
            qual = f"{prefix}.{name}" if prefix else name
            state.buffers.append((mod, name, qual, buf, buf._version,
                                  buf.detach().clone() if copy and id(buf) not in seen else None))
            seen.add(id(buf))
    state.params = [(n, p, p._version) for n, p in model.named_parameters()]
    return state


def restore_state(state: State) -> tuple[list[str], list[str]]:
    """Put back every buffer as :func:`record_state` saw it (the same tensor, its value) and
    return (names of the buffers put back, names of the parameters written in place since)."""
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
    written = [n for n, p, version in state.params if p._version != version]
    return restored, written
