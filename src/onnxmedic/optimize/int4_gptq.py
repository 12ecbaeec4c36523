"""GPTQ-style int4 for a decoder step: ``optimize --precision int4 --calibration TEXT``.

RTN (ONNX Runtime's ``MatMulNBitsQuantizer``) rounds each weight to the nearest 4-bit level of
its block on its own. GPTQ (Frantar et al., 2022) quantizes the input rows of a weight one
after another and spreads each row's rounding error over the rows not yet quantized, weighted
by the inverse Hessian ``H = 2/n X^T X`` of the layer's inputs ``X`` on calibration text, so
that the layer's *output* on that text moves least. The result is stored exactly like ONNX
Runtime's symmetric RTN: ``com.microsoft.MatMulNBits``, 4 bits, one float32 scale per block of
``block_size`` weights along K, zero point 8 (not stored), the scale the signed absolute
maximum of the block over -8 (as ONNX Runtime's ``quantize_matmul_4bits``). With ``H`` the
identity, the codes are RTN's, bit for bit (tested).

Why not ONNX Runtime's own GPTQ (``GPTQWeightOnlyQuantConfig``, the copy of Intel Neural
Compressor's in ``onnxruntime.quantization.neural_compressor``)? Measured on the trained test
decoder (bench/accuracy/train_decoder.py, blocks of 32, docs/int4.md): it quantizes the GPTQ
result a second time with fresh block scales (``quant_tensor``), which moves the updated weights
off their grid, and its asymmetric packing of zero points fails when a weight has an odd
number of blocks per column; its symmetric candidate lost 9 points of greedy agreement against
RTN. Here the codes GPTQ picks are the codes written.

This module runs in optimize's pass child (onnx, numpy and onnxruntime; no torch).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from onnxmedic.genpackage import StepLayout, read_step

logger = logging.getLogger(__name__)

WINDOW = 128  # tokens per calibration window, each run from an empty past
MAX_WINDOWS = 64  # at most this many windows of the user's text calibrate (8192 tokens)
PERCDAMP = 0.01  # the Hessian's diagonal dampening (share of its mean), as in the paper


# ------------------------------------------------------------------------------------------
# calibration text -> windows of token ids


def split_text(ids: Sequence[int], window: int = WINDOW, max_windows: int = MAX_WINDOWS
               ) -> tuple[list[list[int]], list[int]]:
    """The user's tokens as (calibration windows, held-out text): the last quarter of the
    windows (at least one) is held out for the perplexity the report gives on the user's text,
    so that GPTQ is not judged on the text it was fitted to. Raises ValueError under two
    windows."""
    n = len(ids) // window
    if n < 2:
        raise ValueError(f"the calibration text has {len(ids)} tokens; at least {2 * window} "
                         f"(two windows of {window}) are needed: one to calibrate, one held "
                         "out to measure perplexity on")
    held = max(1, n // 4)
    cal = [list(ids[i * window:(i + 1) * window]) for i in range(n - held)][:max_windows]
    return cal, list(ids[(n - held) * window:n * window])


# ------------------------------------------------------------------------------------------
# Hessians of every quantizable MatMul's input


def quantizable_layers(graph: Any, exclude: Sequence[str] = ()) -> list[Any]:
    """MatMul nodes with a constant 2-D float weight, not in ``exclude``."""
    from onnx import TensorProto

    inits = {i.name: i for i in graph.initializer}
    return [n for n in graph.node
            if n.op_type == "MatMul" and len(n.input) > 1 and n.input[1] in inits
            and len(inits[n.input[1]].dims) == 2
            and inits[n.input[1]].data_type == TensorProto.FLOAT and n.name not in exclude]


def hessians(model: Any, windows: list[list[int]], layout: StepLayout, threads: int = 2
             ) -> dict[str, np.ndarray]:
    """``H = 2/n sum x x^T`` (float64, K x K) of each quantizable MatMul's input over every
    token of ``windows`` (each fed as a first step, from an empty past, as the package
    contract ``layout`` says), keyed by the input's name. ``model``: the float32 decoder step
    (a ModelProto; not modified)."""
    import onnx
    import onnxruntime as ort

    m = onnx.ModelProto()
    m.CopyFrom(model)
    names = sorted({n.input[0] for n in quantizable_layers(m.graph)})
    have = {o.name for o in m.graph.output}
    m.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None)
                          for n in names if n not in have)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    acc: dict[str, np.ndarray] = {}
    for w in windows:
        outs = sess.run(names, layout.feed(w))
        for name, x in zip(names, outs):
            x = x.reshape(-1, x.shape[-1]).astype(np.float64)
            acc[name] = acc.get(name, 0.0) + x.T @ x
    count = sum(len(w) for w in windows)  # the tokens
    return {k: v * (2.0 / count) for k, v in acc.items()}


def cached_hessians(model: Any, src: str, calibration: str) -> dict[str, np.ndarray]:
    """:func:`hessians` on the windows of the ``calibration`` JSON file (``{"windows": [[ids],
    ...]}``), cached beside it per source file and windows (one optimize run builds several
    GPTQ candidates of one file)."""
    st = os.stat(src)
    key = hashlib.sha256(f"{os.path.abspath(src)}:{st.st_size}:{st.st_mtime_ns}".encode()
                         + Path(calibration).read_bytes()).hexdigest()[:12]
    cache = Path(f"{calibration}.{key}.npz")
    if cache.exists():
        with np.load(cache) as z:
            return {k: z[k] for k in z.files}
    windows = json.loads(Path(calibration).read_text())["windows"]
    hs = hessians(model, windows, read_step(src))
    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}.npz")
    np.savez(tmp, **hs)
    os.replace(tmp, cache)
    return hs


# ------------------------------------------------------------------------------------------
# the GPTQ update


def _block_scale(w: np.ndarray) -> np.ndarray:
    """Per row of ``w`` (rows: output columns; values: one block along K), the symmetric
    4-bit scale of ONNX Runtime's RTN: the signed value of largest magnitude over -8."""
    hi, lo = w.max(axis=1), w.min(axis=1)
    return (np.where(np.abs(hi) > np.abs(lo), hi, lo) / -8.0).astype(np.float32)


def _codes(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """4-bit codes (0..15, zero point 8) of ``w`` at ``scale`` (0 where the scale is 0)."""
    safe = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q = np.rint(w.astype(np.float32) / safe) + 8
    return np.where(scale == 0, 8, np.clip(q, 0, 15)).astype(np.uint8)


def gptq(weight: np.ndarray, h: np.ndarray | None, block_size: int = 32,
         percdamp: float = PERCDAMP, lazy: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ of the MatMul weight ``weight`` (K x N, ONNX's layout: y = x @ W) against the
    input Hessian ``h`` (K x K; None: the identity, which is RTN). Returns (codes (N, Kp)
    uint8 with Kp = K padded to whole blocks, scales (N, Kp / block_size) float32): the
    dequantized weight is ``(codes - 8) * scale`` per block. Each block's scale is taken from
    the block's weights as GPTQ has updated them when it reaches the block; ``lazy``: rows
    updated together (a multiple of ``block_size``), as the paper's lazy batch updates."""
    k, n = weight.shape
    blocks = -(-k // block_size)
    kp = blocks * block_size
    w = np.zeros((n, kp), np.float64)
    w[:, :k] = weight.T
    hh = np.eye(kp)
    if h is not None:
        hh[:k, :k] = h
    dead = np.diag(hh) == 0
    hh[dead, dead] = 1.0
    w[:, dead] = 0.0
    hh[np.diag_indices(kp)] += percdamp * float(np.mean(np.diag(hh)))
    # the upper Cholesky factor of H^-1: row i holds what quantizing input row i passes on
    u = np.linalg.cholesky(np.linalg.inv(hh)).T
    codes = np.zeros((n, kp), np.uint8)
    scales = np.zeros((n, blocks), np.float32)
    lazy = max(block_size, lazy // block_size * block_size)
    for i1 in range(0, kp, lazy):
        i2 = min(i1 + lazy, kp)
        w1, err = w[:, i1:i2].copy(), np.zeros((n, i2 - i1))
        for i in range(i2 - i1):
            col = i1 + i
            if col % block_size == 0:
                scales[:, col // block_size] = _block_scale(w1[:, i:i + block_size])
            s = scales[:, col // block_size]
            q = _codes(w1[:, i], s)
            codes[:, col] = q
            e = (w1[:, i] - (q.astype(np.float64) - 8) * s) / u[col, col]
            w1[:, i:] -= np.outer(e, u[col, col:i2])
            err[:, i] = e
        w[:, i2:] -= err @ u[i1:i2, i2:]
    codes[:, k:] = 0  # the padding rows multiply nothing; zero as ONNX Runtime writes them
    return codes, scales


def pack(codes: np.ndarray, block_size: int) -> np.ndarray:
    """MatMulNBits' B: (N, blocks, block_size / 2) uint8, two codes a byte, low nibble first."""
    n, kp = codes.shape
    pairs = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return pairs.reshape(n, kp // block_size, block_size // 2).astype(np.uint8)


# ------------------------------------------------------------------------------------------
# the model


def gptq_model(model: Any, hs: dict[str, np.ndarray], block_size: int = 32,
               accuracy_level: int = 0, exclude: Sequence[str] = ()) -> Any:
    """``model`` (a ModelProto, changed in place and returned) with every quantizable MatMul
    but ``exclude`` replaced by a 4-bit MatMulNBits from :func:`gptq` against ``hs`` (the
    inputs' Hessians; a MatMul whose input has none is quantized by RTN)."""
    import onnx
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    targets = {n.name: n for n in quantizable_layers(graph, exclude)}
    nodes, used = [], set()
    for node in graph.node:
        if node.name not in targets or not node.name:
            nodes.append(node)
            continue
        wname = node.input[1]
        weight = numpy_helper.to_array(inits[wname]).astype(np.float32)
        codes, scales = gptq(weight, hs.get(node.input[0]), block_size)
        k, n = weight.shape
        b = numpy_helper.from_array(pack(codes, block_size), f"{wname}_Q4")
        s = numpy_helper.from_array(scales, f"{wname}_scales")
        graph.initializer.extend([b, s])
        attrs = {"K": k, "N": n, "bits": 4, "block_size": block_size}
        if accuracy_level:
            attrs["accuracy_level"] = accuracy_level
        nodes.append(helper.make_node("MatMulNBits", [node.input[0], b.name, s.name],
                                      list(node.output), name=f"{node.name}_Q4",
                                      domain="com.microsoft", **attrs))
        used.add(wname)
    graph.ClearField("node")
    graph.node.extend(nodes)
    still = {i for n in graph.node for i in n.input}
    keep = [i for i in graph.initializer if i.name not in used or i.name in still]
    graph.ClearField("initializer")
    graph.initializer.extend(keep)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return model
