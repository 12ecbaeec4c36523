"""Zero internal errors: export every model of the repo's cheap zoos and fixtures, and every
``torch.nn`` module that builds with default arguments, and list each OM009 (issue 41).

    PYTHONPATH=src:. python bench/zoo/internal_errors.py [--hf] [--ecosystem] [--json out.json]

For each ``torch.nn`` module class with a no-argument constructor (and ~70 that need
arguments, built small: convolutions, norms, recurrent layers, attention, pools, pads), the first of a few tiny
input forms on which it runs eagerly is used (one tensor of rank 1-5, a (1, 3, 4, 4) image,
two or three tensors of the same shape for losses and bilinear forms). Each model's inputs
and the model itself are also checked to come back bit-equal (the borrow contract). The
summary lists every model with OM009 and the code each model ended in.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import sys
import time
from collections import Counter
from typing import Any

import torch
from torch import nn

import onnxmedic
from onnxmedic import borrow

logger = logging.getLogger(__name__)

# input forms tried in order: the first the module runs on eagerly is exported
_FORMS: list[tuple[str, Any]] = [
    ("(2,3,8)", lambda: (torch.rand(2, 3, 8),)),
    ("(1,3,4,4)", lambda: (torch.rand(1, 3, 4, 4),)),
    ("(2,3)", lambda: (torch.rand(2, 3),)),
    ("(1,3,2,4,4)", lambda: (torch.rand(1, 3, 2, 4, 4),)),
    ("(6,)", lambda: (torch.rand(6),)),
    ("2x(2,3)", lambda: (torch.rand(2, 3), torch.rand(2, 3))),
    ("(2,3)+target", lambda: (torch.rand(2, 3).log_softmax(1), torch.tensor([0, 2]))),
    ("3x(2,3)", lambda: (torch.rand(2, 3), torch.rand(2, 3), torch.rand(2, 3))),
    ("2x(2,3)+(2,)", lambda: (torch.rand(2, 3), torch.rand(2, 3), torch.tensor([1.0, -1.0]))),
]
# not models: containers, base classes, modules that need a real argument to mean anything
_SKIP = {"Module", "ModuleList", "ModuleDict", "ParameterList", "ParameterDict", "Sequential",
         "Container", "LazyModuleMixin", "UninitializedParameter", "UninitializedBuffer"}


def nn_modules() -> dict[str, Any]:
    """name -> (module, args) for each torch.nn module class that builds with no arguments and
    runs on one of the tiny input forms."""
    out: dict[str, Any] = {}
    for name in sorted(dir(torch.nn)):
        cls = getattr(torch.nn, name)
        if not (inspect.isclass(cls) and issubclass(cls, torch.nn.Module)) or name in _SKIP:
            continue
        try:
            mod = cls().eval()
        except Exception:  # noqa: BLE001 - needs arguments: not a default-built module
            continue
        for form, make in _FORMS:
            args = make()
            try:
                with torch.no_grad():
                    mod(*borrow.copy_inputs(args))
            except Exception:  # noqa: BLE001 - the next form
                continue
            out[f"nn.{name}{form}"] = (mod, args)
            break
    return out


def _r(*shape: int) -> torch.Tensor:
    return torch.rand(*shape)


# the torch.nn modules that need arguments, built small: name -> (factory, inputs)
_WITH_ARGS: dict[str, tuple[Any, Any]] = {
    "Linear": (lambda: nn.Linear(8, 4), lambda: (_r(2, 8),)),
    "Bilinear": (lambda: nn.Bilinear(3, 5, 4), lambda: (_r(2, 3), _r(2, 5))),
    "Conv1d": (lambda: nn.Conv1d(3, 4, 3), lambda: (_r(2, 3, 8),)),
    "Conv2d": (lambda: nn.Conv2d(3, 4, 3, padding=1, groups=1), lambda: (_r(1, 3, 8, 8),)),
    "Conv3d": (lambda: nn.Conv3d(3, 4, 3), lambda: (_r(1, 3, 4, 5, 5),)),
    "ConvTranspose1d": (lambda: nn.ConvTranspose1d(3, 4, 3, stride=2), lambda: (_r(2, 3, 8),)),
    "ConvTranspose2d": (lambda: nn.ConvTranspose2d(3, 4, 3, stride=2),
                        lambda: (_r(1, 3, 5, 5),)),
    "ConvTranspose3d": (lambda: nn.ConvTranspose3d(3, 2, 2), lambda: (_r(1, 3, 3, 3, 3),)),
    "BatchNorm1d": (lambda: nn.BatchNorm1d(3), lambda: (_r(2, 3, 8),)),
    "BatchNorm2d": (lambda: nn.BatchNorm2d(3), lambda: (_r(2, 3, 4, 4),)),
    "BatchNorm3d": (lambda: nn.BatchNorm3d(3), lambda: (_r(2, 3, 2, 4, 4),)),
    "InstanceNorm1d": (lambda: nn.InstanceNorm1d(3, affine=True), lambda: (_r(2, 3, 8),)),
    "InstanceNorm2d": (lambda: nn.InstanceNorm2d(3), lambda: (_r(2, 3, 4, 4),)),
    "LayerNorm": (lambda: nn.LayerNorm(8), lambda: (_r(2, 3, 8),)),
    "GroupNorm": (lambda: nn.GroupNorm(1, 4), lambda: (_r(2, 4, 5),)),
    "RMSNorm": (lambda: nn.RMSNorm(8), lambda: (_r(2, 3, 8),)),
    "LocalResponseNorm": (lambda: nn.LocalResponseNorm(2), lambda: (_r(1, 4, 5, 5),)),
    "CrossMapLRN2d": (lambda: nn.CrossMapLRN2d(3), lambda: (_r(1, 4, 5, 5),)),
    "Embedding": (lambda: nn.Embedding(10, 4), lambda: (torch.tensor([[1, 2, 9]]),)),
    "EmbeddingBag": (lambda: nn.EmbeddingBag(10, 4),
                     lambda: (torch.tensor([[1, 2, 9], [0, 3, 3]]),)),
    "RNN": (lambda: nn.RNN(8, 4), lambda: (_r(5, 2, 8),)),
    "LSTM": (lambda: nn.LSTM(8, 4, batch_first=True), lambda: (_r(2, 5, 8),)),
    "GRU": (lambda: nn.GRU(8, 4, num_layers=2), lambda: (_r(5, 2, 8),)),
    "RNNCell": (lambda: nn.RNNCell(8, 4), lambda: (_r(2, 8),)),
    "LSTMCell": (lambda: nn.LSTMCell(8, 4), lambda: (_r(2, 8),)),
    "GRUCell": (lambda: nn.GRUCell(8, 4), lambda: (_r(2, 8),)),
    "MultiheadAttention": (lambda: nn.MultiheadAttention(8, 2, batch_first=True),
                           lambda: (_r(2, 5, 8), _r(2, 5, 8), _r(2, 5, 8))),
    "TransformerEncoderLayer": (lambda: nn.TransformerEncoderLayer(8, 2, 16, batch_first=True),
                                lambda: (_r(2, 5, 8),)),
    "TransformerDecoderLayer": (lambda: nn.TransformerDecoderLayer(8, 2, 16),
                                lambda: (_r(5, 2, 8), _r(4, 2, 8))),
    "Transformer": (lambda: nn.Transformer(8, 2, 1, 1, 16), lambda: (_r(5, 2, 8), _r(4, 2, 8))),
    "MaxPool1d": (lambda: nn.MaxPool1d(2), lambda: (_r(2, 3, 8),)),
    "MaxPool2d": (lambda: nn.MaxPool2d(3, 2, 1, ceil_mode=True), lambda: (_r(1, 3, 8, 8),)),
    "MaxPool3d": (lambda: nn.MaxPool3d(2), lambda: (_r(1, 3, 4, 4, 4),)),
    "AvgPool1d": (lambda: nn.AvgPool1d(3, 2, 1), lambda: (_r(2, 3, 8),)),
    "AvgPool2d": (lambda: nn.AvgPool2d(3, 2, 1, count_include_pad=False),
                  lambda: (_r(1, 3, 8, 8),)),
    "AvgPool3d": (lambda: nn.AvgPool3d(2), lambda: (_r(1, 3, 4, 4, 4),)),
    "LPPool1d": (lambda: nn.LPPool1d(2, 2), lambda: (_r(2, 3, 8),)),
    "LPPool2d": (lambda: nn.LPPool2d(2, 2), lambda: (_r(1, 3, 8, 8),)),
    "AdaptiveAvgPool1d": (lambda: nn.AdaptiveAvgPool1d(3), lambda: (_r(2, 3, 8),)),
    "AdaptiveAvgPool2d": (lambda: nn.AdaptiveAvgPool2d((3, 5)), lambda: (_r(1, 3, 8, 8),)),
    "AdaptiveAvgPool3d": (lambda: nn.AdaptiveAvgPool3d(2), lambda: (_r(1, 3, 4, 4, 4),)),
    "AdaptiveMaxPool1d": (lambda: nn.AdaptiveMaxPool1d(3), lambda: (_r(2, 3, 8),)),
    "AdaptiveMaxPool2d": (lambda: nn.AdaptiveMaxPool2d(3), lambda: (_r(1, 3, 8, 8),)),
    "AdaptiveMaxPool3d": (lambda: nn.AdaptiveMaxPool3d(2), lambda: (_r(1, 3, 4, 4, 4),)),
    "FractionalMaxPool2d": (lambda: nn.FractionalMaxPool2d(2, output_size=3),
                            lambda: (_r(1, 3, 8, 8),)),
    "MaxUnpool2d": (lambda: _Unpool(), lambda: (_r(1, 3, 4, 4),)),
    "Upsample": (lambda: nn.Upsample(scale_factor=2, mode="bilinear"),
                 lambda: (_r(1, 3, 4, 4),)),
    "UpsamplingNearest2d": (lambda: nn.UpsamplingNearest2d(scale_factor=2),
                            lambda: (_r(1, 3, 4, 4),)),
    "PixelShuffle": (lambda: nn.PixelShuffle(2), lambda: (_r(1, 8, 3, 3),)),
    "PixelUnshuffle": (lambda: nn.PixelUnshuffle(2), lambda: (_r(1, 2, 4, 4),)),
    "ChannelShuffle": (lambda: nn.ChannelShuffle(2), lambda: (_r(1, 4, 3, 3),)),
    "Fold": (lambda: nn.Fold((4, 5), 2), lambda: (_r(1, 12, 12),)),
    "Unfold": (lambda: nn.Unfold(2, padding=1), lambda: (_r(1, 3, 4, 4),)),
    "ConstantPad2d": (lambda: nn.ConstantPad2d((1, 2, 0, 1), 0.5), lambda: (_r(1, 3, 4, 4),)),
    "ReflectionPad1d": (lambda: nn.ReflectionPad1d(2), lambda: (_r(2, 3, 8),)),
    "ReflectionPad2d": (lambda: nn.ReflectionPad2d(1), lambda: (_r(1, 3, 4, 4),)),
    "ReflectionPad3d": (lambda: nn.ReflectionPad3d(1), lambda: (_r(1, 3, 3, 3, 3),)),
    "ReplicationPad2d": (lambda: nn.ReplicationPad2d(1), lambda: (_r(1, 3, 4, 4),)),
    "ReplicationPad3d": (lambda: nn.ReplicationPad3d(1), lambda: (_r(1, 3, 3, 3, 3),)),
    "CircularPad2d": (lambda: nn.CircularPad2d(1), lambda: (_r(1, 3, 4, 4),)),
    "ZeroPad2d": (lambda: nn.ZeroPad2d(1), lambda: (_r(1, 3, 4, 4),)),
    "Softmax": (lambda: nn.Softmax(dim=1), lambda: (_r(2, 5),)),
    "LogSoftmax": (lambda: nn.LogSoftmax(dim=-1), lambda: (_r(2, 5),)),
    "Softmax2d": (lambda: nn.Softmax2d(), lambda: (_r(1, 3, 4, 4),)),
    "Threshold": (lambda: nn.Threshold(0.3, -1.0), lambda: (_r(2, 5),)),
    "Unflatten": (lambda: nn.Unflatten(1, (2, 3)), lambda: (_r(2, 6),)),
    "PReLU": (lambda: nn.PReLU(3), lambda: (_r(2, 3, 4) - 0.5,)),
    "GLU": (lambda: nn.GLU(), lambda: (_r(2, 6),)),
    "AdaptiveLogSoftmaxWithLoss": (lambda: _AdaptiveLog(), lambda: (_r(4, 8),)),
}


class _Unpool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pool, self.unpool = nn.MaxPool2d(2, return_indices=True), nn.MaxUnpool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.unpool(*self.pool(x))


class _AdaptiveLog(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.m = nn.AdaptiveLogSoftmaxWithLoss(8, 10, [4])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.m.log_prob(x)


def nn_modules_with_args() -> dict[str, Any]:
    """The torch.nn modules that need arguments, built small (``_WITH_ARGS``)."""
    out = {}
    for name, (make, inputs) in _WITH_ARGS.items():
        torch.manual_seed(0)
        out[f"nn.{name}*"] = (make().eval(), inputs())
    return out


def fixtures() -> dict[str, Any]:
    """tests/models.py's fixtures and tests/sweep_zoo/tiny.py's good entries."""
    sys.path.insert(0, ".")
    from tests import models
    from tests.sweep_zoo import tiny

    x = models.make_inputs()
    image = (torch.randn(2, 3, 8, 8),)
    shaped = {"ConvLog1p": image, "PoolView": image, "BilinearAlignCorners": image,
              "CustomNorm": (torch.randn(2, 8),), "NamedScript": (torch.randn(2, 4),)}
    out = {f"fixture.{n}": (getattr(models, n)(), shaped.get(n, x)) for n in (
        "ConvLog1p", "PoolView", "BilinearAlignCorners", "TwoLinear", "DataDependentIf",
        "MultiOutput", "NamedScript", "CustomNorm", "Identity", "Erfinv", "KwargsModel",
        "Raises")}
    for name, factory in tiny.GOOD.items():
        case = factory()
        out[f"tiny.{name}"] = (case.model, case.args) if hasattr(case, "model") else case
    return out


def zoo_fast(which: str) -> dict[str, Any]:
    """bench/zoo/<which>.py's FAST entries (hf: tiny transformers configs; ecosystem: kornia,
    torch-geometric, zuko and torch.nn attention)."""
    import importlib

    zoo = importlib.import_module(f"bench.zoo.{which}")
    out = {}
    for name in zoo.FAST:
        case = zoo.ALL[name]()
        out[f"{which}.{name}"] = (case.model, tuple(case.args), dict(case.kwargs or {}),
                                  case.dynamic_shapes)
    return out


def run_one(entry: Any) -> dict[str, Any]:
    model, args, kwargs, dyn = (*entry, {}, None)[:4] if len(entry) == 2 else entry
    given = borrow.copy_inputs((args, kwargs))
    t0 = time.perf_counter()
    try:
        r = onnxmedic.export(model, args, kwargs=kwargs, dynamic_shapes=dyn, timeout=60)
        codes = [f.code for f in r.findings if f.severity.name.lower() == "error"]
        om009 = [f.message for f in r.findings if f.code == "OM009"]
        ok = r.ok
    except Exception as e:  # noqa: BLE001 - an exception out of export() is an internal error too
        codes, om009, ok = ["raised"], [f"{type(e).__name__}: {e}"], False
    return {"ok": ok, "errors": codes, "om009": om009,
            "inputs_unchanged": borrow.same_inputs(given, (args, kwargs)),
            "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf", action="store_true", help="also bench/zoo/hf.py's FAST entries")
    p.add_argument("--ecosystem", action="store_true",
                   help="also bench/zoo/ecosystem.py's FAST entries")
    p.add_argument("--only", default="", help="substring of the entries to run")
    p.add_argument("--json", help="write the per-model results here")
    ns = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    entries = {**fixtures(), **nn_modules(), **nn_modules_with_args(),
               **(zoo_fast("hf") if ns.hf else {}),
               **(zoo_fast("ecosystem") if ns.ecosystem else {})}
    results = {}
    for name, entry in entries.items():
        if ns.only not in name:
            continue
        results[name] = res = run_one(entry)
        print(f"{name:40s} {'ok' if res['ok'] else ','.join(res['errors']) or 'not ok':20s} "
              f"{res['seconds']:5.1f}s" + ("" if res["inputs_unchanged"] else "  INPUTS CHANGED")
              + (f"  OM009: {res['om009'][0][:150]}" if res["om009"] else ""), flush=True)
    bad = {n: r["om009"] for n, r in results.items() if r["om009"]}
    print(f"\n{len(results)} models; {sum(r['ok'] for r in results.values())} verified; "
          f"OM009 in {len(bad)}: {', '.join(bad) or 'none'}")
    print("errors:", dict(Counter(c for r in results.values() for c in set(r["errors"]))))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
