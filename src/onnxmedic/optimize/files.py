"""The files optimize's passes read and write: ONNX models (whole, or the graph alone), their op
counts, and the input sets (feeds) a measuring step runs on.

Every pass module and search imports these from here, and this module imports no other
optimize module: passes.py and fp16.py once imported each other for them. It imports onnx and
numpy only (the pass child never imports torch, see _child.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np


def op_counts(path: str | os.PathLike[str]) -> Counter[str]:
    """How many nodes of each op type the top-level graph of the file at ``path`` has."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    return Counter(n.op_type for n in proto.graph.node)


def op_count_diff(before: Counter[str], after: Counter[str]) -> dict[str, Any]:
    """A step's report of what it did: node counts before and after, and the op types new."""
    return {"nodes_before": sum(before.values()), "nodes_after": sum(after.values()),
            "new_ops": {k: v for k, v in after.items() if v > before.get(k, 0) and k not in before}}


def load_ir(src: str) -> Any:
    """The file at ``src`` as an onnx_ir model, every tensor in memory (its destination may be
    elsewhere)."""
    import onnx
    import onnx_ir as ir

    return ir.from_proto(onnx.load(src))


def save_ir(model: Any, dst: str) -> None:
    """Save an onnx_ir model (:func:`save_proto`)."""
    import onnx_ir as ir

    save_proto(ir.to_proto(model), dst)


def save_proto(proto: Any, dst: str) -> None:
    """Save, with the weights in ``<dst>.data`` when the file would near protobuf's 2 GiB."""
    import onnx

    try:
        big = proto.ByteSize() > 1_800_000_000
    except Exception:  # noqa: BLE001 - protobuf refuses to size a message over 2 GiB
        big = True
    onnx.save(proto, dst, save_as_external_data=big, location=Path(dst).name + ".data")


def has_external_data(path: str | os.PathLike[str]) -> bool:
    """Whether the file at ``path`` keeps weights in external data (its graph read alone)."""
    import onnx
    from onnx.external_data_helper import uses_external_data

    proto = onnx.load(str(path), load_external_data=False)
    return any(uses_external_data(t) for t in proto.graph.initializer)


def node_subgraphs(node: Any) -> list[Any]:
    """The GraphProtos a NodeProto holds in its attributes (If's branches, Loop's body ...)."""
    return [g for at in node.attribute
            for g in ([at.g] if at.HasField("g") else []) + list(at.graphs)]


def save_feeds(feeds: list[dict[str, np.ndarray]], path: Path) -> Path:
    """The feeds as one .npz, for a measuring step in the pass child (:func:`load_feeds`)."""
    arrays = {f"{i}_{j}": np.asarray(a) for i, f in enumerate(feeds) for j, a in
              enumerate(f.values())}
    np.savez(path, __layout__=np.array(json.dumps([list(f) for f in feeds])), **arrays)
    return path


def load_feeds(path: str | Path) -> list[dict[str, np.ndarray]]:
    """The feeds :func:`save_feeds` wrote, in order."""
    data = np.load(path)
    layout = json.loads(str(data["__layout__"]))
    return [{k: data[f"{i}_{j}"] for j, k in enumerate(keys)} for i, keys in enumerate(layout)]


def same_graph(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Same nodes (with their attributes) and the same initializers (values included): a pass
    that only rewrote a weight or an attribute did change the model."""
    import onnx

    def key(path: str | os.PathLike[str]) -> list[Any]:
        g = onnx.load(str(path), load_external_data=False).graph
        nodes = [(n.op_type, n.domain, list(n.input), list(n.output),
                  [x.SerializeToString() for x in n.attribute]) for n in g.node]
        inits = sorted((t.name, hashlib.sha256(t.SerializeToString()).hexdigest())
                       for t in g.initializer)
        return [nodes, inits]

    return key(a) == key(b)
