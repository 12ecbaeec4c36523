"""Snapshot of a model's and torch's state, to check that export leaves both as it found them."""

from __future__ import annotations

import builtins
from typing import Any

import torch
import torch.nn.functional as F


def snapshot_state(model: torch.nn.Module) -> dict[str, Any]:
    """Everything export must not change: modes, parameters, buffers (value and identity), hooks,
    global torch flags, and the functions capture strategies might patch."""
    return {
        "modes": {name: m.training for name, m in model.named_modules()},
        "params": {n: (id(p), p.detach().clone(), p.requires_grad)
                   for n, p in model.named_parameters()},
        "buffers": {n: (id(b), b.detach().clone()) for n, b in model.named_buffers()},
        "hooks": {name: (dict(m._forward_hooks), dict(m._forward_pre_hooks),
                         dict(m._backward_hooks), dict(m._state_dict_hooks))
                  for name, m in model.named_modules()},
        "attrs": {name: sorted(vars(m)) for name, m in model.named_modules()},
        # plain number/string attributes: a cache's filled length beside its buffer
        "attr_values": {name: {k: v for k, v in vars(m).items()
                               if type(v) in (int, float, bool, str, type(None))}
                        for name, m in model.named_modules()},
        "grad": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
        "dtype": torch.get_default_dtype(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "cudnn": (torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark,
                  torch.backends.cudnn.deterministic),
        "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "threads": torch.get_num_threads(),
        "mha_fastpath": torch.backends.mha.get_fastpath_enabled(),
        "functional": {k: v for k, v in vars(F).items() if callable(v)},
        "tensor": {k: getattr(torch.Tensor, k) for k in dir(torch.Tensor)
                   if not k.startswith("__")},
        "torch": {k: getattr(torch, k) for k in ("cat", "stack", "where", "cond", "_assert")},
        "pytree": set(torch.utils._pytree.SUPPORTED_NODES),
        "builtins": (builtins.len, builtins.max, builtins.min),
    }


def state_differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Human-readable differences between two snapshots (empty when identical)."""
    diffs: list[str] = []
    for key, old in before.items():
        new = after[key]
        if key in ("params", "buffers"):
            if old.keys() != new.keys():
                diffs.append(f"{key}: names {sorted(old.keys() ^ new.keys())}")
                continue
            for name, (oid, oval, *rest) in old.items():
                nid, nval, *nrest = new[name]
                if oid != nid:
                    diffs.append(f"{key}.{name}: replaced by another tensor")
                if not torch.equal(oval, nval):
                    diffs.append(f"{key}.{name}: value changed")
                if rest != nrest:
                    diffs.append(f"{key}.{name}: requires_grad changed")
        elif key in ("functional", "tensor", "torch"):
            changed = [k for k in old.keys() | new.keys() if old.get(k) is not new.get(k)]
            if changed:
                diffs.append(f"{key}: {sorted(changed)} changed")
        elif key == "pytree":
            # torch registers its own types when a torch submodule is first imported (e.g.
            # torch.distributed.tensor during export): a one-time import effect, not a leak
            leaked = [t for t in new - old
                      if not getattr(t, "__module__", "").startswith("torch.")]
            if leaked or old - new:
                diffs.append(f"pytree: added {leaked}, removed {list(old - new)}")
        elif old != new:
            diffs.append(f"{key}: {old!r} -> {new!r}")
    return diffs
