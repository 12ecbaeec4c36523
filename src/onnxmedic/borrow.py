"""The user's model is borrowed, not taken: record what export may change and put it back.

``model.train(True)`` after export would set *every* submodule to training mode, clobbering a
model whose submodules were in mixed modes (e.g. a frozen batch-norm backbone in eval under a
root in train). These helpers save and restore each submodule's own ``training`` flag.
"""

from __future__ import annotations

import logging

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
