"""Hostile files shared by the tests and bench/accuracy/hostile.py."""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from pathlib import Path

import torch

PT2_ATTACKS = ("pickled-weight", "sample-inputs", "opaque-constant")


class _RunsCommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plain_pt2(path: Path) -> Path:
    """A harmless torch.export archive of a Linear(2, 2)."""
    ep = torch.export.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),))
    torch.export.save(ep, path)
    return path


def hostile_pt2(path: Path, attack: str, marker: Path) -> Path:
    """A .pt2 whose loading with plain torch.export.load creates ``marker`` (runs a command):
    a weight marked use_pickle, the sample inputs, or an opaque constant replaced by a pickle
    carrying code."""
    from torch.export.pt2_archive.constants import OPAQUE_OBJ_FILENAME_PREFIX

    evil = pickle.dumps(_RunsCommand(marker))
    src = plain_pt2(path.with_name(path.stem + ".plain.pt2"))
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(path, "w") as zout:
        for info in zin.infolist():
            name, data = info.filename, zin.read(info.filename)
            if attack == "pickled-weight" and name.endswith("model_weights_config.json"):
                cfg = json.loads(data)
                cfg["config"]["weight"]["use_pickle"] = True
                data = json.dumps(cfg).encode()
            elif attack == "pickled-weight" and name.endswith("weights/weight_0"):
                data = evil
            elif attack == "sample-inputs" and name.endswith("sample_inputs/model.pt"):
                data = evil
            elif attack == "opaque-constant" and name.endswith("model_constants_config.json"):
                entry = f"{OPAQUE_OBJ_FILENAME_PREFIX}0"
                zout.writestr(f"{name.rsplit('/', 1)[0]}/{entry}", evil)
                data = json.dumps({"config": {"c": {"path_name": entry, "is_param": False,
                                                    "use_pickle": True,
                                                    "tensor_meta": None}}}).encode()
            zout.writestr(name, data)
    src.unlink()
    return path
