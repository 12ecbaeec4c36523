"""One ONNX file: loading (with the external-data check), opset, graph inputs/outputs, feeds,
and saving/publishing the model onnxmedic writes.

Files are untrusted: external-data locations that leave the model's folder are refused before
any runtime sees them, and a file over protobuf's limit is refused before it is read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from onnxmedic._tensors import to_numpy
from onnxmedic.findings import Finding, OnnxMedicError, Severity, error, info, listed

logger = logging.getLogger(__name__)

# Models whose initializers exceed this many bytes are saved with external data: protobuf cannot
# hold more than 2 GiB, and a single file near that limit needs that much memory twice to be
# read. A module attribute so tests can lower it.
EXTERNAL_DATA_THRESHOLD = 1024**3
PROTOBUF_LIMIT = 2**31  # bytes: protobuf cannot serialise or parse a larger message

ONNX_TO_NUMPY: dict[int, Any] = {
    onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.DOUBLE: np.float64,
    onnx.TensorProto.FLOAT16: np.float16, onnx.TensorProto.INT64: np.int64,
    onnx.TensorProto.INT32: np.int32, onnx.TensorProto.INT16: np.int16,
    onnx.TensorProto.INT8: np.int8, onnx.TensorProto.UINT8: np.uint8,
    onnx.TensorProto.UINT16: np.uint16, onnx.TensorProto.UINT32: np.uint32,
    onnx.TensorProto.UINT64: np.uint64, onnx.TensorProto.BOOL: np.bool_,
}


def bf16() -> Any:
    import ml_dtypes

    return ml_dtypes.bfloat16


def numpy_dtype(elem_type: int) -> Any:
    if elem_type == onnx.TensorProto.BFLOAT16:
        return np.dtype(bf16())
    if elem_type not in ONNX_TO_NUMPY:
        raise KeyError(onnx.TensorProto.DataType.Name(elem_type))
    return np.dtype(ONNX_TO_NUMPY[elem_type])


def all_graphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    out = [graph]
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                out += all_graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    out += all_graphs(g)
    return out


def external_data_findings(model: onnx.ModelProto, model_path: str | Path,
                           stage: str = "load") -> list[Finding]:
    """Refuse external-data locations outside the model's folder; report missing files."""
    base = Path(model_path).resolve().parent
    findings: list[Finding] = []
    seen: set[str] = set()
    for g in all_graphs(model.graph):
        tensors = list(g.initializer) + [a.t for n in g.node for a in n.attribute
                                         if a.type == onnx.AttributeProto.TENSOR]
        for t in tensors:
            if t.data_location != onnx.TensorProto.EXTERNAL:
                continue
            loc = next((e.value for e in t.external_data if e.key == "location"), "")
            if loc in seen:
                continue
            seen.add(loc)
            target = (base / loc).resolve()
            escapes = (not loc or os.path.isabs(loc) or ".." in Path(loc).parts
                       or not str(target).startswith(str(base) + os.sep))
            if escapes:
                findings.append(error(
                    "OM520", stage, f"tensor {t.name!r} points its external data at {loc!r}, "
                    "outside the model's folder; the file was refused before any runtime "
                    "read it.", suggestion="Only trust this model if you know where it came "
                    "from; a legitimate export keeps external data beside the model "
                    "(model.onnx.data).", details={"tensor": t.name, "location": loc}))
            elif not target.is_file():
                findings.append(error(
                    "OM521", stage, f"external data file {loc!r} (tensor {t.name!r}) is "
                    f"missing from {base}.", suggestion="Copy the .data file that was saved "
                    "with the model into the same folder.",
                    details={"tensor": t.name, "location": loc}))
    return findings


def load_onnx(path: str | Path, stage: str = "check") -> tuple[onnx.ModelProto | None,
                                                              Finding | None]:
    """Load an ONNX file given by the user (without external data) or explain why not."""
    p = Path(path)
    if p.is_dir():
        graphs = sorted(g.name for g in p.glob("*.onnx"))
        return None, error("OM007", stage, f"{str(path)!r} is a folder, not an ONNX file"
                           + (f" (it holds {listed(graphs, 4)})." if graphs else "."),
                           suggestion=f"Give the graph's file: {p / graphs[0]}" if graphs else
                           "Give the path of an .onnx file.")
    if not p.is_file():
        return None, error("OM007", stage, f"ONNX file {str(path)!r} does not exist.")
    size = p.stat().st_size
    if size == 0:
        return None, error("OM007", stage, f"{str(path)!r} is empty.")
    if size >= PROTOBUF_LIMIT:  # refuse before reading gigabytes that protobuf cannot parse
        return None, error("OM007", stage, f"{str(path)!r} is {size / 2**30:.1f} GiB, over "
                           "protobuf's 2 GiB limit for one message, so no ONNX reader can parse "
                           "it (it is truncated, corrupt, or was written wrongly).",
                           suggestion="Keep the weights in external data: onnx.save(model, path, "
                           "save_as_external_data=True, location='weights.bin'); onnxmedic "
                           "export does this itself for models over 1 GiB.")
    try:
        model = onnx.load(str(p), load_external_data=False)
    except Exception as e:
        return None, error("OM007", stage, f"{str(path)!r} is not a readable ONNX model (it may "
                           f"be truncated or corrupt): {type(e).__name__}: {first_lines(str(e))}",
                           suggestion="Re-export or re-download the file; compare its size "
                           "with the original.")
    if not model.graph.node and not model.graph.output:
        return None, error("OM007", stage, f"{str(path)!r} parsed but holds no graph; it is "
                           "probably not an ONNX file.")
    return model, None


def first_lines(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return " ".join(lines[:2])[:500]


def load_checked(path: str | os.PathLike[str], stage: str = "load"
                 ) -> tuple[onnx.ModelProto | None, list[Finding]]:
    """Load a user's file (without external data) and check where its external data points:
    the model, or None and the findings that refuse it."""
    proto, bad = load_onnx(path, stage=stage)
    if bad is not None:
        return None, [bad]
    ext = external_data_findings(proto, Path(path), stage=stage)
    return (None, ext) if ext else (proto, [])


def skeleton(proto: onnx.ModelProto, keep_bytes: int = 4096) -> onnx.ModelProto:
    """The model without its weights, for the checker and shape inference: initializers over
    ``keep_bytes`` (and external ones) become graph inputs of the same type and shape, so the
    whole graph is checked without serialising gigabytes; small ones (shape constants that
    data propagation reads) stay. Nested graphs keep their own initializers."""
    out = onnx.ModelProto()
    _copy_fields(proto, out, skip=("graph",))
    g, src = out.graph, proto.graph
    _copy_fields(src, g, skip=("initializer",))
    declared = {v.name for v in src.input}
    for t in src.initializer:
        small = t.data_location != onnx.TensorProto.EXTERNAL and _nbytes(t) <= keep_bytes
        if small:
            g.initializer.append(t)
        elif t.name not in declared:
            g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, t.dims))
    return out


def _nbytes(t: onnx.TensorProto) -> int:
    """A tensor's data size from its dims and dtype (reading the data would copy it)."""
    try:
        item = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    except Exception:  # strings and other types without a fixed size: keep them
        return 0
    return int(np.prod(t.dims, dtype=np.int64)) * item


def _copy_fields(src: Any, dst: Any, skip: tuple[str, ...]) -> None:
    """Copy the set fields of one protobuf message into another, except ``skip``."""
    for f, value in src.ListFields():
        if f.name in skip:
            continue
        target = getattr(dst, f.name)
        if hasattr(target, "extend"):  # repeated
            target.extend(value)
        elif hasattr(target, "CopyFrom"):
            target.CopyFrom(value)
        else:
            setattr(dst, f.name, value)


def opset_of(proto: Any) -> int | None:
    """The default-domain opset a model imports, or None."""
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)


def input_names(proto: Any) -> list[str]:
    """The graph's inputs that are not initializers, in order."""
    inits = {i.name for i in proto.graph.initializer}
    return [v.name for v in proto.graph.input if v.name not in inits]


def graph_io(proto: Any) -> tuple[list[str], list[list[int | str | None]], list[str]]:
    """ONNX input names, their dims (int, dim_param or None), and output names."""
    inits = {i.name for i in proto.graph.initializer}
    ins = [v for v in proto.graph.input if v.name not in inits]
    dims = []
    for v in ins:
        shape = v.type.tensor_type.shape.dim if v.type.HasField("tensor_type") else []
        dims.append([d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                     for d in shape])
    return [v.name for v in ins], dims, [o.name for o in proto.graph.output]


def make_feeds(onnx_inputs: list[str], args: tuple[Any, ...], kwargs: dict[str, Any]
           ) -> dict[str, np.ndarray]:
    """Flatten (args, kwargs) like torch.onnx does and map them onto the ONNX inputs."""
    leaves = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if x is not None]
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    values = leaves if len(leaves) == len(onnx_inputs) else tensors
    if len(values) != len(onnx_inputs):
        raise OnnxMedicError(error(
            "OM008", "runtime", f"the ONNX model has {len(onnx_inputs)} input(s) "
            f"({', '.join(onnx_inputs)}) but {len(tensors)} tensor(s) were given.",
            suggestion="Give one --input per ONNX input, in the order above (an export's "
            "inputs are forward()'s parameters, in order)."))
    return {n: to_numpy(v) for n, v in zip(onnx_inputs, values)}


def random_feeds(model: onnx.ModelProto, seed: int = 0, dynamic_size: int = 2
                 ) -> tuple[dict[str, np.ndarray], list[str]]:
    """Random inputs matching the model's inputs (dynamic dims set to ``dynamic_size``)."""
    rng = np.random.default_rng(seed)
    init_names = {i.name for i in model.graph.initializer}
    feeds: dict[str, np.ndarray] = {}
    problems: list[str] = []
    for v in model.graph.input:
        if v.name in init_names:
            continue
        if not v.type.HasField("tensor_type"):
            problems.append(f"{v.name}: not a tensor input")
            continue
        tt = v.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else dynamic_size for d in tt.shape.dim]
        try:
            dt = numpy_dtype(tt.elem_type)
        except KeyError as e:
            problems.append(f"{v.name}: element type {e} has no random generator")
            continue
        size = int(np.prod(shape)) if shape else 1
        if size > 2**28 or any(d > 2**31 for d in shape):
            problems.append(f"{v.name}: shape {shape} is too large for a smoke test")
            continue
        if dt == np.bool_:
            a = rng.integers(0, 2, size=shape).astype(np.bool_)
        elif np.issubdtype(dt, np.integer):
            a = rng.integers(0, 4, size=shape).astype(dt)
        else:
            a = rng.standard_normal(size=shape).astype(np.float32).astype(dt)
        feeds[v.name] = a
    return feeds, problems


def check_feeds(model: onnx.ModelProto, feeds: dict[str, np.ndarray], *, cast: str = "no"
                ) -> tuple[dict[str, np.ndarray], list[Finding]]:
    """Check feeds against the model's input contract. ``cast``: "no", "safe" (lossless casts
    only, e.g. int32 -> int64, float16 -> float32) or "all" (any cast, values may change)."""
    init_names = {i.name for i in model.graph.initializer}
    inputs = [v for v in model.graph.input if v.name not in init_names]
    findings: list[Finding] = []
    out: dict[str, np.ndarray] = {}
    names = [v.name for v in inputs]
    extra = sorted(set(feeds) - set(names))
    if extra:
        findings.append(error("OM008", "inputs", f"inputs {', '.join(extra)} are not inputs of "
                              f"the model (its inputs: {', '.join(names)}).",
                              suggestion="Name .npz arrays after the model's inputs, or give "
                              "them positionally in order."))
    for v in inputs:
        if v.name not in feeds:
            findings.append(error("OM008", "inputs", f"input {v.name!r} was not given."))
            continue
        a = np.asarray(feeds[v.name])
        tt = v.type.tensor_type
        want = numpy_dtype(tt.elem_type)
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
        if a.ndim != len(dims):
            findings.append(error("OM008", "inputs", f"input {v.name!r} has rank {a.ndim} "
                                  f"(shape {list(a.shape)}); the model wants rank {len(dims)} "
                                  f"({['?' if d is None else d for d in dims]}).",
                                  suggestion="Reshape the input, e.g. add the batch dimension "
                                  "with x[None]."))
            continue
        bad_dims = [(i, d, a.shape[i]) for i, d in enumerate(dims) if d is not None and
                    d != a.shape[i]]
        if bad_dims:
            i, d, got = bad_dims[0]
            findings.append(error("OM008", "inputs", f"input {v.name!r} dim {i} is {got}; the "
                                  f"model fixes it to {d}.",
                                  suggestion="That dimension was exported static: feed that "
                                  "size, or re-export with --dynamic."))
            continue
        if a.dtype != want:
            lossless = np.can_cast(a.dtype, want, casting="safe")
            if cast == "all" or (cast == "safe" and lossless):
                out[v.name] = a.astype(want)
                findings.append(info("OM008", "inputs", f"input {v.name!r} cast from {a.dtype} "
                                     f"to {want}."))
                continue
            findings.append(error(
                "OM008", "inputs", f"input {v.name!r} is {a.dtype}; the model wants {want}.",
                suggestion=(f"Convert it (x.astype(np.{want})) or pass --cast" +
                            ("" if lossless else "-lossy (values may change)") + ".")))
            continue
        out[v.name] = a
    return out, findings


def append_metadata(path: str | os.PathLike[str], key: str, value: str,
                    proto: Any = None) -> None:
    """Add the metadata entry ``key: value`` to the saved ONNX file at ``path`` (and to
    ``proto``): a ModelProto holding only that entry is appended to the file - protobuf
    appends a repeated field met twice, so the file parses as the model with one more
    metadata_props entry, and its weights are not written again."""
    entry = onnx.StringStringEntryProto(key=key, value=value)
    with open(path, "ab") as fh:
        fh.write(onnx.ModelProto(metadata_props=[entry]).SerializeToString())
    if proto is not None:
        proto.metadata_props.append(entry)


def tensor_bytes(t: onnx.TensorProto, base: str | os.PathLike[str]) -> bytes:
    """The raw bytes of the initializer ``t``: its ``raw_data``, or (external data) read from
    its file under ``base`` at its offset and length, nothing kept in ``t``. A location that
    leaves ``base`` is refused (ValueError), as :func:`external_data_findings` refuses it."""
    ext = {e.key: e.value for e in t.external_data}
    if t.data_location != onnx.TensorProto.EXTERNAL or "location" not in ext:
        return t.raw_data
    root = Path(base).resolve()
    path = (root / ext["location"]).resolve()
    if not path.is_relative_to(root):
        raise ValueError(f"initializer {t.name}: external data {ext['location']!r} is outside "
                         f"the model's folder {root}")
    with open(path, "rb") as f:
        f.seek(int(ext.get("offset", 0)))
        return f.read(int(ext["length"])) if "length" in ext else f.read()


def tensor_array(t: onnx.TensorProto, base: str | os.PathLike[str]) -> np.ndarray:
    """The array of the initializer ``t``, its external data read by :func:`tensor_bytes`
    (one reader of external data), without loading that data into ``t`` itself (onnx's
    to_array with a base folder would keep it there)."""
    from onnx import numpy_helper

    copy = onnx.TensorProto()
    copy.CopyFrom(t)
    if copy.data_location == onnx.TensorProto.EXTERNAL:
        copy.raw_data = tensor_bytes(t, base)
        del copy.external_data[:]
        copy.data_location = onnx.TensorProto.DEFAULT
    return numpy_helper.to_array(copy)


def has_external_data(proto: Any) -> bool:
    return any(t.HasField("data_location") and t.data_location == onnx.TensorProto.EXTERNAL
               for t in proto.graph.initializer)


def save_program(prog: Any, folder: Path, name: str) -> Path:
    import onnx_ir as ir

    from onnxmedic._torch_compat import initializer_bytes

    size = initializer_bytes(prog.model.graph)
    target = folder / name
    if size > EXTERNAL_DATA_THRESHOLD:
        ir.save(prog.model, target, external_data=f"{name}.data")
    else:
        try:
            save_single_file(prog.model, target)
        except Exception:  # a tensor the stream does not take: the library's way, slower
            logger.debug("streamed save failed; ir.save", exc_info=True)
            ir.save(prog.model, target)
    return target


# Weights at least this big are streamed into the file (save_single_file).
STREAM_BYTES = 1 << 20


def _length_delimited(field: int, length: int) -> bytes:
    """A protobuf field header: tag (field number, wire type 2) and length, as varints."""
    out = bytearray()
    for n in ((field << 3) | 2, length):
        while n > 0x7F:
            out.append((n & 0x7F) | 0x80)
            n >>= 7
        out.append(n)
    return bytes(out)


def save_single_file(model: Any, path: Path) -> None:
    """Save an onnx_ir model as one .onnx file, its big weights written straight into the file.

    ``ir.save`` builds the whole ModelProto (a copy of every weight), serialises it (a second)
    and writes it: 3.5 s for BERT-base's 440 MB here. Protobuf merges a message field that
    occurs twice, so the file is the model serialised without its big initializers, followed by
    a second ``graph`` field holding only those (each: a TensorProto header, then ``raw_data``
    from the tensor's bytes) and their value_info: the same model once parsed (0.6 s)."""
    import onnx_ir as ir

    inits = model.graph.initializers
    big = [v for v in list(inits.values()) if v.const_value is not None
           and v.const_value.nbytes >= STREAM_BYTES and v.const_value.dtype != ir.DataType.STRING
           and not v.const_value.metadata_props and not v.const_value.doc_string]
    for v in big:
        inits.pop(v.name)
    try:
        head = ir.serde.serialize_model(model).SerializeToString()
    finally:
        for v in big:
            inits[v.name] = v
    pieces: list[bytes | memoryview] = []
    for v in big:
        t = v.const_value
        header = onnx.TensorProto(name=v.name, dims=[int(d) for d in t.shape],
                                  data_type=int(t.dtype)).SerializeToString()
        data = t.tobytes()
        raw = _length_delimited(9, len(data))  # TensorProto.raw_data
        pieces += [_length_delimited(5, len(header) + len(raw) + len(data)), header, raw, data]
        info_bytes = ir.serde.serialize_value(v).SerializeToString()
        pieces += [_length_delimited(13, len(info_bytes)), info_bytes]  # GraphProto.value_info
    graph = _length_delimited(7, sum(len(p) for p in pieces))  # ModelProto.graph, merged
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        for p in (head, graph, *pieces):
            f.write(p)
    os.replace(tmp, path)


def graph_proto(model: Any) -> onnx.ModelProto:
    """The ModelProto of an onnx_ir model; over EXTERNAL_DATA_THRESHOLD (saved with external
    data) its initializers of STREAM_BYTES or more are references without data (external, no
    location yet): the graph without a second copy of the weights, until the check stage reads
    the saved file's graph and references (saved_proto)."""
    import onnx_ir as ir

    from onnxmedic._torch_compat import initializer_bytes

    if initializer_bytes(model.graph) <= EXTERNAL_DATA_THRESHOLD:
        return ir.serde.serialize_model(model)
    inits = model.graph.initializers
    big = [v for v in list(inits.values()) if v.const_value is not None
           and v.const_value.nbytes >= STREAM_BYTES]
    for v in big:
        inits.pop(v.name)
    try:
        proto = ir.serde.serialize_model(model)
    finally:
        for v in big:
            inits[v.name] = v
    for v in big:
        t = v.const_value
        ref = proto.graph.initializer.add()
        ref.name, ref.data_type = v.name, int(t.dtype)
        ref.dims.extend(int(d) for d in t.shape)
        ref.data_location = onnx.TensorProto.EXTERNAL
    return proto


def has_external_data_file(path: Path) -> bool:
    """Whether the model saved at ``path`` keeps its weights beside it (``path``.data)."""
    return Path(f"{path}.data").exists()


def saved_proto(prog: Any, path: Path) -> onnx.ModelProto:
    """The ModelProto of a program just saved at ``path``: with its weights in external data,
    the graph and references only (read back from the file, no second copy of the weights);
    else the whole model."""
    if has_external_data_file(path):
        return onnx.load(str(path), load_external_data=False)
    return prog.model_proto


def publish(tmp_dir: Path, name: str, dest: Path) -> None:
    """Move the model (and its external data) into place; the model file goes last."""
    files = sorted(tmp_dir.iterdir(), key=lambda p: p.name == name)
    for p in files:
        os.replace(p, dest.parent / p.name if p.name != name else dest)


def check_output_path(f: str | os.PathLike[str] | None, stage: str = "write") -> Finding | None:
    """Fail fast (before the slow stages) when the output cannot be written."""
    if f is None:
        return None
    p = Path(f)
    if p.is_dir():
        return error("OM006", stage, f"output path {str(f)!r} is a folder.",
                     suggestion="Give a file name such as model.onnx.")
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        return error("OM006", stage, f"the folder {str(folder)!r} for the output does not exist.",
                     suggestion=f"Create it first (mkdir -p {folder}) or choose another path.")
    if not os.access(folder, os.W_OK | os.X_OK):
        return error("OM006", stage, f"the folder {str(folder)!r} is not writable.",
                     suggestion="Choose an output path you can write to.")
    if p.exists() and not os.access(p, os.W_OK):
        return error("OM006", stage, f"the existing file {str(f)!r} is not writable.")
    return None


def not_written_finding(f: Any) -> Finding:
    """OM010: the model was not written (or an existing file was left as it was)."""
    existed = Path(f).exists()
    return Finding(
        "OM010", "write", Severity.INFO,
        f"{f} was not written because the model is not verified"
        + ("; the existing file was left unchanged." if existed else "."),
        suggestion="Fix the findings above, or pass keep_unverified=True to keep the "
        "unverified model.")




@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A scratch folder beside ``out`` (same file system: renamed into place with
    :func:`replace_folder` once verified, which gives it a new folder's mode), removed on the
    way out."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# what an existing folder holds when a package may replace it: a graph or onnxruntime-genai's
# config (ours, the builder's, optimum's layout: all flat folders)
PACKAGE_MARKS = ("*.onnx", "genai_config.json")


def package_output_problem(out: str | os.PathLike[str], stage: str = "write") -> Finding | None:
    """OM738 when the package folder ``out`` exists and is not one a package may replace: a
    file, or a non-empty folder that holds no ONNX graph nor ``genai_config.json`` or holds a
    subfolder (a package is written whole, so whatever ``out`` held is removed); OM006 when a
    new ``out`` cannot be made in its parent; None when ``out`` is new, empty or a package. Checked before anything is built, and again by
    :func:`replace_folder`."""
    p = Path(out)
    if not p.exists() and not p.is_symlink():
        return _parent_problem(p, stage)
    if p.is_dir() and not p.is_symlink():
        held = sorted(p.iterdir())
        if not held or (not any(e.is_dir() for e in held)
                        and any(e.match(m) for e in held for m in PACKAGE_MARKS)):
            return None
        what = f"a folder that is not a package (it holds {listed([e.name for e in held], 6)})"
    else:
        what = "a file" if p.is_file() else "not a folder"
    return error("OM738", stage, f"{str(out)!r} exists and is {what}: a package replaces the "
                 "whole folder it is written to, so nothing was written.",
                 suggestion="Give a new folder (or an empty one, or a package to replace) as "
                 "-o.")


def _parent_problem(out: Path, stage: str) -> Finding | None:
    """OM006 when the folder ``out`` cannot be made in its parent (missing, a file, not
    writable: tried, since permissions alone do not say it, e.g. under /proc)."""
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        what = "is a file" if parent.exists() else "does not exist"
        return error("OM006", stage, f"cannot write {str(out)!r}: {str(parent)!r} {what}.",
                     suggestion=f"Create the folder first (mkdir -p {parent}) or choose "
                     "another path." if what == "does not exist" else "Choose another path.")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}.probe-", dir=parent))
    except OSError as e:
        return error("OM006", stage, f"cannot write {str(out)!r}: a folder cannot be made in "
                     f"{str(parent)!r} ({e.strerror or e}).",
                     suggestion="Choose an output folder you can write to.")
    return None


def replace_folder(tmp: Path, out: Path) -> None:
    """Put the folder ``tmp`` in place as ``out``: an existing ``out`` is moved aside first and
    removed after, so ``out`` is never half-written (generation packages, fused and int4
    packages). ``out`` gets a new folder's mode: ``tmp`` is mkdtemp's (0700), which would stay
    with the package. An ``out`` that is not a package (:func:`package_output_problem`) is
    never replaced: OnnxMedicError (OM738)."""
    if (bad := package_output_problem(out)) is not None:
        raise OnnxMedicError(bad)
    mask = os.umask(0)
    os.umask(mask)
    tmp.chmod(0o777 & ~mask)
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
