"""The int4 generation package written straight from a bf16/fp16/fp32 checkpoint, one decoder
layer in memory at a time: onnxruntime-genai's model builder makes the graph (``-p int4 -e
cpu``: its names, its attention and cache layout, its genai_config.json), while

- the weights come from the checkpoint's safetensors by plain reads (hf/stream.py's
  :class:`~onnxmedic.hf.stream.Weights`, the streamed verification's reader: no memory map,
  so no file-backed pages of the checkpoint stay resident), one unit at a time
  (the embedding, each decoder layer, the final norm, the head): the model the builder walks
  is built on the meta device and each unit's parameters are read in when the builder reaches
  it and dropped when it moves on;
- every MatMul's weight is quantized as the builder makes it (ONNX Runtime's
  ``DefaultWeightOnlyQuantizer`` blocks: symmetric 4-bit, one float32 scale per block along K,
  the builder's own ``to_nbits`` layout and names: ``<weight>_Q4``, ``<weight>_scales``,
  node ``<MatMul>_Q4``), in slices of output columns, and appended to the package's data
  file; each slice is read back from the file and checked against the float weight it was
  made from (optimize/int4.py's rounding rule, :func:`~onnxmedic.optimize.int4.block_problem`):
  a corrupted block or a wrong scale stops the build (:class:`NotRounded`, OM870 upstream).
  What it costs beside the quantizer's own call (the same one the builder's ``-p int4``
  makes, per weight): the slice's float32 transpose, the quantizer's (K, N) layout, made from
  the checkpoint's rows in tiles (:func:`transposed`) into one buffer kept for every slice,
  and the check, which reads the checkpoint's rows a cached chunk at a time; no float32 copy
  of a whole weight is made;
- every other initializer of more than :data:`INLINE` bytes (the embedding, the rotary
  caches) is converted to its graph dtype in row slices and appended to the data file as it
  is made; the graph file is written last, its initializers pointing into the data file.

So the builder's float32 package (four times the bf16 bytes) is never written, and its
whole-model quantization pass (the float32 model in memory) never runs. The builder runs in a
forked child (hf/builder.py's :func:`~onnxmedic.hf.builder.start` with :func:`build` as its
work); what it writes is judged by hf/transforms/stream_int4.py.
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np

logger = logging.getLogger(__name__)

ALIGN = 4096  # offsets of the tensors in the data file (the builder's and onnx's alignment)
INLINE = 1 << 20  # initializers of at most this many bytes stay in the graph file
SLICE = 64 << 20  # bytes of float32 made at a time (a weight's output columns, a table's rows)
TILE = 128  # output columns made float32 and transposed at a time (transposed)
VERDICT = "int4_writer.json"  # what the child says of the rounding (in the job's root)

class NotRounded(RuntimeError):
    """A 4-bit weight written is not a rounding of the float weight it was made from."""


class _Data:
    """The package's data file, appended to aligned (and written at reserved places)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.end = 0

    def reserve(self, length: int) -> int:
        offset = self.end + (-self.end % ALIGN)
        self.end = offset + length
        return offset

    def write(self, offset: int, payload: Any) -> None:
        view = memoryview(payload).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)

    def read(self, offset: int, length: int) -> bytes:
        return os.pread(self.fd, length, offset)

    def close(self) -> None:
        os.ftruncate(self.fd, self.end)
        os.close(self.fd)


def transposed(rows: np.ndarray, out: np.ndarray) -> np.ndarray:
    """(cols, K) in any float dtype -> its float32 (K, cols) copy in ``out``, :data:`TILE` rows
    at a time: each tile made float32 where it lies (bfloat16 too: ml_dtypes casts contiguous
    runs fast, strided ones slowly), then copied transposed while its rows are in the cache (a
    whole large array's transposed copy, numpy's or torch's, strides across memory for each
    element)."""
    for c in range(0, rows.shape[0], TILE):
        out[:, c:c + TILE] = rows[c:c + TILE].astype(np.float32, copy=False).T
    return out


def rtn_quantizer(block_size: int, accuracy_level: int) -> Any:
    """ONNX Runtime's ``DefaultWeightOnlyQuantizer`` as the builder's ``-p int4`` and
    optimize/int4.py's RTN candidates make it: symmetric 4-bit, one float32 scale per
    ``block_size`` weights along K, ``accuracy_level`` (0: the kernel's default)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )

    return DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(
        block_size=block_size, is_symmetric=True, accuracy_level=accuracy_level or None,
        bits=4))


def halves(work: Callable[[int, int], Any], cols: int, pool: ThreadPoolExecutor
           ) -> list[tuple[Any, int]]:
    """``work(a, b)`` over the columns ``[0, cols)`` in two halves, the second on ``pool``'s
    thread (numpy lets the GIL go in its casts and copies: the writer's own steps beside the
    quantizer's call then take both cores where PyTorch's pass beside it is done), or whole
    where there are fewer than two tiles: each result with its half's first column."""
    if cols < 2 * TILE:
        return [(work(0, cols), 0)]
    mid = (cols // 2 + TILE - 1) // TILE * TILE
    other = pool.submit(work, mid, cols)
    first = work(0, mid)
    return [(first, 0), (other.result(), mid)]


def rounding_of(name: str, rows: np.ndarray, q: np.ndarray, scales: np.ndarray,
                at: dict[str, int], pool: ThreadPoolExecutor, first: int = 0) -> str | None:
    """optimize/int4.py's :func:`~onnxmedic.optimize.int4.block_problem` on a slice of a
    weight's output columns (``rows``: (cols, K), the checkpoint's; ``q``: (cols, blocks,
    bytes); ``scales``: cols x blocks), in :func:`halves`; ``first``: the slice's first
    column in the weight, named where it is not the weight's first. Why it is not a rounding,
    or None."""
    from onnxmedic.optimize.int4 import block_problem

    kb = q.shape[1]
    said = halves(lambda a, b: block_problem(name, rows[a:b].T, q[a:b],
                                             scales[a * kb:b * kb], {**at, "N": b - a}),
                  rows.shape[0], pool)
    for why, a in said:
        if why is not None:
            return why if first + a == 0 else f"{why} (output columns from {first + a})"
    return None


class _Streamer:
    """The hooks installed on one builder Model instance (see the module docstring)."""

    def __init__(self, m: Any, folder: Path, out: Path,
                 tamper: Callable[[str, np.ndarray, np.ndarray], None] | None) -> None:
        from onnxmedic.hf.stream import Weights

        self.m, self.folder, self.tamper = m, folder, tamper

        self.shards = Weights(folder)
        self.location = f"{m.filename}.data"
        self.out = out
        self.data = _Data(out / self.location)
        qa = m.quant_attrs
        self.at = {"bits": int(qa["bits"]), "block_size": int(qa["matmul_block_size"])}
        self.accuracy_level = int(qa["accuracy_level"] or 0)
        self.quantizer = rtn_quantizer(self.at["block_size"], self.accuracy_level)
        self.quantized = 0
        # the quantizer's float32 input, one buffer for every slice: a fresh 64 MiB array
        # each time is a fresh mapping, every page of it faulted in and zeroed by the kernel
        self.wf = np.empty(0, np.float32)
        # the second half's thread of each slice's own steps (halves); made in the child
        self.pool = ThreadPoolExecutor(1)
        self.orig_initializer = m.make_initializer
        self.orig_matmul_float = m.make_matmul_float

    def install(self) -> None:
        m = self.m
        int4 = str(m.onnx_dtype).rsplit(".", 1)[-1] in ("INT4", "UINT4")
        qa = m.quant_attrs
        if not int4 or qa.get("use_qdq") or not qa.get("is_symmetric") or \
                int(qa["bits"]) != 4 or getattr(m, "quantization_algo", "default") != "default":
            raise ValueError("the streamed int4 writer makes the default symmetric 4-bit "
                             "MatMulNBits only")
        m.load_weights = self.load_weights
        m.make_initializer = self.make_initializer
        m.make_matmul_float = self.make_matmul_float
        m.to_nbits = lambda: m.model  # every MatMul is 4-bit already
        m.save_model = self.save_model

    # -- the weights, one unit at a time

    def load_weights(self, input_path: str) -> Any:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(self.folder))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        names: dict[int, list[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(n)
        walk = type(model).named_modules  # the class's: ``modules`` is replaced below

        def modules() -> Any:
            unit: list[tuple[Any, str, Any]] = []
            inside: str | None = None
            try:
                for prefix, mod in walk(model):
                    within = inside is not None and (inside == "" or
                                                     prefix.startswith(inside + "."))
                    # a decoder layer (the builder's is_layer) or a module of its own weights
                    if not within and (type(mod).__name__.endswith("DecoderLayer") or any(
                            p is not None for p in mod._parameters.values())):
                        self._release(unit)
                        unit, inside = self._materialise(mod, names), prefix
                    yield mod
            finally:
                self._release(unit)

        model.modules = modules
        return model

    def _materialise(self, unit: Any, names: dict[int, list[str]]) -> list[tuple[Any, str, Any]]:
        import torch

        held = []
        for sub in unit.modules():
            for pname, p in list(sub._parameters.items()):
                if p is None or p.device.type != "meta":
                    continue
                key = next((n for n in names.get(id(p), []) if n in self.shards), None)
                if key is None:
                    raise KeyError(f"the checkpoint has no tensor for {names.get(id(p))}")
                t = self.shards.get(key)
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"{key}: the checkpoint's shape {tuple(t.shape)} is not "
                                     f"the model's {tuple(p.shape)}")
                sub._parameters[pname] = torch.nn.Parameter(t, requires_grad=False)
                held.append((sub, pname, p))
        return held

    @staticmethod
    def _release(held: list[tuple[Any, str, Any]]) -> None:
        for sub, pname, meta in held:
            sub._parameters[pname] = meta
        held.clear()

    # -- the initializers, written as they are made

    def _register(self, name: str, dtype: Any, shape: list[int], offset: int,
                  length: int) -> None:
        import onnx_ir as ir

        ext = ir.ExternalTensor(self.location, offset, length, dtype=dtype,
                                shape=ir.Shape(shape), name=name, base_dir=str(self.out))
        value = self.m.make_value(name, dtype, shape)
        value.const_value = ext
        self.m.model.graph.register_initializer(value)

    def make_initializer(self, tensor: Any, /, name: str, *, to: Any = None,
                         raw: bool = False) -> None:
        import torch
        from onnx_ir.tensor_adapters import from_torch_dtype, to_torch_dtype

        if raw or not isinstance(tensor, torch.Tensor) or \
                tensor.numel() * tensor.element_size() <= INLINE and (
                    to is None or tensor.numel() * 4 <= INLINE):
            return self.orig_initializer(tensor, name, to=to, raw=raw)
        t = tensor.detach()
        dtype = to_torch_dtype(to) if to is not None else t.dtype
        rows = t.reshape(t.shape[0], -1) if t.dim() > 1 else t.reshape(-1, 1)
        row_bytes = max(1, rows.shape[1] * torch.empty((), dtype=dtype).element_size())
        length = rows.shape[0] * row_bytes
        offset = self.data.reserve(length)
        step = max(1, SLICE // row_bytes)
        for r in range(0, rows.shape[0], step):
            part = rows[r:r + step].to(dtype).contiguous()
            self.data.write(offset + r * row_bytes, part.view(torch.uint8).numpy())
            del part
        self._register(name, from_torch_dtype(dtype), list(t.shape), offset, length)

    # -- the MatMuls, 4-bit as they are made

    def make_matmul_float(self, matmul: Any, name: str, root_input: str, **kwargs: Any) -> str:
        import onnx_ir as ir

        from onnxmedic._tensors import to_numpy

        m = self.m
        if name in m.quant_attrs["nodes_to_exclude"] or \
                "MatMul" not in m.quant_attrs["op_types_to_quantize"]:
            return self.orig_matmul_float(matmul, name, root_input, **kwargs)
        weight = name[1:].replace("/", ".") + ".weight"
        w = matmul.weight.detach()  # (N, K): the builder's MatMul weight is its transpose
        n_out, k_in = int(w.shape[0]), int(w.shape[1])
        block = self.at["block_size"]
        kb = (k_in + block - 1) // block
        blob = block // 2
        at = {**self.at, "N": n_out, "K": k_in}
        q_off = self.data.reserve(n_out * kb * blob)
        s_off = self.data.reserve(n_out * kb * 4)
        step = max(1, SLICE // (4 * k_in))
        for c in range(0, n_out, step):
            rows = to_numpy(w[c:c + step])  # (cols, K), the checkpoint's dtype: no copy
            cols = rows.shape[0]
            if self.wf.size < k_in * cols:
                self.wf = np.empty(max(k_in * cols, SLICE // 4), np.float32)
            # (K, cols) float32: the quantizer's layout
            wf = self.wf[:k_in * cols].reshape(k_in, cols)
            halves(lambda a, b, r=rows, o=wf: transposed(r[a:b], o[:, a:b]), cols, self.pool)
            packed, scales, _zp = self.quantizer.qbits_block_quant(wf)
            scales = scales.astype(np.float32, copy=False)
            if self.tamper is not None:
                self.tamper(weight, packed, scales)
            self.data.write(q_off + c * kb * blob, np.ascontiguousarray(packed))
            self.data.write(s_off + c * kb * 4, np.ascontiguousarray(scales))
            # read back as written, judged against the float weight it was made from
            q = np.frombuffer(self.data.read(q_off + c * kb * blob, cols * kb * blob),
                              np.uint8).reshape(cols, kb, blob)
            s = np.frombuffer(self.data.read(s_off + c * kb * 4, cols * kb * 4), np.float32)
            # (the rows' transposed view: block_problem reads it a cached chunk at a time,
            # made float32 there)
            why = rounding_of(f"{name}_Q4", rows, q, s, at, self.pool, c)
            if why is not None:
                raise NotRounded(why)
            del rows, wf, packed, scales, q, s
        self._register(f"{weight}_Q4", ir.DataType.UINT8, [n_out, kb, blob], q_off,
                       n_out * kb * blob)
        self._register(f"{weight}_scales", ir.DataType.FLOAT, [n_out, kb], s_off,
                       n_out * kb * 4)
        attrs = dict(K=k_in, N=n_out, bits=4, block_size=block)
        if self.accuracy_level:
            attrs["accuracy_level"] = self.accuracy_level
        output = "logits" if kwargs.get("logits", False) else f"{name}/output_0"
        m.make_node("MatMulNBits", inputs=[root_input, f"{weight}_Q4", f"{weight}_scales"],
                    outputs=[output], name=f"{name}_Q4", domain="com.microsoft", **attrs)
        m.make_value(output, m.io_dtype, shape=m.make_hidden_state_shape(
            seq_dim=kwargs.get("seq_dim", "sequence_length"), last_dim=n_out))
        self.quantized += 1
        return name

    # -- the graph file, last

    def save_model(self, out_dir: str) -> None:
        import onnx
        import onnx_ir as ir

        if Path(out_dir).resolve() != self.out.resolve():
            raise ValueError(f"the writer's data file is in {self.out}, not {out_dir}")
        model = self.m.model
        model.graph.sort()
        type(self.m).stamp_build_metadata(model)
        self.data.close()
        proto = ir.to_proto(model)
        path = self.out / self.m.filename
        onnx.save(proto, str(path))
        logger.info("int4 writer: %d MatMuls 4-bit, %s", self.quantized, path)


def build(folder: Path, out: Path, cache: Path, *,
          tamper: Callable[[str, np.ndarray, np.ndarray], None] | None = None) -> None:
    """The child's work (hf/builder.py's ``start(..., work=build)``): onnxruntime-genai's
    builder on the checkpoint ``folder`` at int4 for the CPU, writing the package into
    ``out`` with the hooks of the module docstring. A weight that is not a rounding of its
    float one raises :class:`NotRounded` after writing the reason to ``out/../VERDICT``.
    ``tamper(weight_name, blocks, scales)``: called on each slice before it is written (the
    tests' faulty quantizer)."""
    from onnxruntime_genai.models import builder as genai_builder

    # (torch stays at the one thread builder._child set: an OpenMP team the parent started
    # must not be used after the fork)
    # the class create_model's families derive from (the builder imports its ``builders``
    # package top-level, so not necessarily onnxruntime_genai.models.builders.base's)
    base = next(c for c in genai_builder.LlamaModel.__mro__ if c.__name__ == "Model")
    original = base.make_model
    made: list[_Streamer] = []

    def make_model(self: Any, input_path: str) -> Any:
        made.append(_Streamer(self, Path(folder), Path(out), tamper))
        made[-1].install()
        return original(self, input_path)

    base.make_model = make_model  # this (forked) process only
    try:
        opts = genai_builder.parse_extra_options(str(folder), str(folder), str(out), "int4",
                                                 "cpu", str(cache), [])
        genai_builder.create_model(str(folder), str(folder), str(out), "int4", "cpu",
                                   str(cache), **opts)
        if len(made) != 1:  # a family whose builder class makes its model another way
            raise RuntimeError(f"the builder made {len(made)} models through the hooks")
        (Path(out).parent / VERDICT).write_text(json.dumps({"quantized": made[0].quantized}))
    except NotRounded as e:
        (Path(out).parent / VERDICT).write_text(json.dumps({"not_rounded": str(e)}))
        raise
    finally:
        base.make_model = original
        for streamer in made:
            streamer.pool.shutdown()


def verdict(root: Path) -> dict[str, Any]:
    """What the child said: ``{"quantized": N}`` when it wrote the package, ``{"not_rounded":
    why}`` when a weight is not a rounding of its float one, ``{}`` when it said nothing."""
    try:
        said = json.loads((root / VERDICT).read_text())
    except (OSError, ValueError):
        return {}
    return said if isinstance(said, dict) else {}


