"""What ONNX Runtime's CPU int8 / float16 kernels compute per instruction set (issue 38).

    python bench/optimize/isa_kernels.py                      # native, and AVX2 under QEMU
    python bench/optimize/isa_kernels.py --emulate none --json $OUT/isa.json   # a device host

One small exact model per kernel onnxmedic's CPU candidates use: MatMulInteger and ConvInteger
(u8s8 full range, u8s8 with 7-bit weights = reduce_range, u8u8), QLinearMatMul / QLinearConv
(u8s8, s8s8, u8u8), QDQ MatMul / Conv (what quantize_static writes; ONNX Runtime fuses them to
QLinear kernels), DynamicQuantizeMatMul (what quantize_dynamic's graph becomes), MatMulNBits
(8 and 4 bits, blocks of 32, accuracy_level 0/1/2/4) and float16 MatMul / Conv. The operands are
drawn so that pairs of u8 x s8 products reach 2 x 255 x 127 (what saturates int16 adders).
Each model runs natively (timed: median of 20 runs, 1 intra-op thread) and, with --emulate
haswell, once under ``qemu-x86_64 -cpu Haswell`` (AVX2, no AVX-512, no VNNI: ONNX Runtime's MLAS
then takes its AVX2 kernels; emulated times mean nothing and are not reported). Error: ||got -
ref|| / ||ref|| against the exact result of the quantized operands in float64 (integer outputs:
exact int64; QLinear outputs: the exact result requantized); "same" says whether the emulated
output is bit-identical to the native one. Needs numpy, onnx and onnxruntime only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

M, K, N = 64, 512, 512  # MatMul: (M, K) x (K, N)
C, H, CO = 64, 28, 64  # Conv: 1 x C x H x H, CO 3x3 filters
QEMU_CPU = "Haswell-noTSX,-pcid,-x2apic,-tsc-deadline,-invpcid"  # the flags TCG has


def _model(nodes: list[Any], inputs: list[Any], outputs: list[Any], inits: list[Any],
           ms: bool = False) -> onnx.ModelProto:
    ops = [helper.make_opsetid("", 21)] + ([helper.make_opsetid("com.microsoft", 1)] if ms
                                          else [])
    m = helper.make_model(helper.make_graph(nodes, "k", inputs, outputs, inits),
                          opset_imports=ops)
    m.ir_version = 10
    return m


def _vi(name: str, dtype: int, shape: list[int]) -> Any:
    return helper.make_tensor_value_info(name, dtype, shape)


def _t(name: str, a: Any) -> Any:
    return numpy_helper.from_array(np.asarray(a), name)


def _conv64(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Conv2d, stride 1, padding 1, in float64 (x: 1,C,H,W; w: CO,C,3,3)."""
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    cols = np.stack([xp[0, :, i:i + x.shape[2], j:j + x.shape[3]]
                     for i in range(3) for j in range(3)], 1)  # C, 9, H, W
    return np.einsum("ckhw,ock->ohw", cols, w.reshape(w.shape[0], w.shape[1], 9).astype(
        np.float64))[None]


def _requant(y: np.ndarray, scale: float, zp: int, dtype: Any) -> np.ndarray:
    info = np.iinfo(dtype)
    return np.clip(np.rint(y / scale) + zp, info.min, info.max)


def build(rng: np.random.Generator) -> dict[str, tuple[onnx.ModelProto, dict[str, np.ndarray],
                                                       np.ndarray]]:
    """kernel -> (model, feeds, exact reference)."""
    out: dict[str, Any] = {}
    a8 = rng.integers(0, 256, (M, K), dtype=np.uint8)
    w_full = rng.integers(-127, 128, (K, N)).astype(np.int8)
    w_rr = rng.integers(-64, 65, (K, N)).astype(np.int8)
    w_u8 = rng.integers(0, 256, (K, N), dtype=np.uint8)
    x8 = rng.integers(0, 256, (1, C, H, H), dtype=np.uint8)
    cw_full = rng.integers(-127, 128, (CO, C, 3, 3)).astype(np.int8)
    cw_rr = rng.integers(-64, 65, (CO, C, 3, 3)).astype(np.int8)
    cw_u8 = rng.integers(0, 256, (CO, C, 3, 3), dtype=np.uint8)
    for name, w, zp in (("u8s8", w_full, 0), ("u8s8-7bit", w_rr, 0), ("u8u8", w_u8, 128)):
        ins = ["A", "B"] + (["", "bzp"] if zp else [])
        inits = [_t("B", w)] + ([_t("bzp", np.uint8(zp))] if zp else [])
        out[f"MatMulInteger {name}"] = (
            _model([helper.make_node("MatMulInteger", ins, ["Y"])],
                   [_vi("A", TensorProto.UINT8, [M, K])], [_vi("Y", TensorProto.INT32, [M, N])],
                   inits), {"A": a8},
            a8.astype(np.int64) @ (w.astype(np.int64) - zp))
    for name, w, zp in (("u8s8", cw_full, 0), ("u8s8-7bit", cw_rr, 0), ("u8u8", cw_u8, 128)):
        ins = ["X", "W"] + (["", "wzp"] if zp else [])
        inits = [_t("W", w)] + ([_t("wzp", np.uint8(zp))] if zp else [])
        out[f"ConvInteger {name}"] = (
            _model([helper.make_node("ConvInteger", ins, ["Y"], pads=[1, 1, 1, 1])],
                   [_vi("X", TensorProto.UINT8, [1, C, H, H])],
                   [_vi("Y", TensorProto.INT32, [1, CO, H, H])], inits), {"X": x8},
            np.rint(_conv64(x8, w.astype(np.int64) - zp)))
    _qlinear(out, a8, w_full, w_u8, x8, cw_full)
    _float_models(out, rng)
    return out


def _qlinear(out: dict[str, Any], a8: np.ndarray, w_full: np.ndarray, w_u8: np.ndarray,
             x8: np.ndarray, cw: np.ndarray) -> None:
    """QLinearMatMul / QLinearConv with u8 or s8 activations and s8 or u8 weights."""
    sa, sw = 0.02, 0.01
    for name, a, azp, w, wzp in (("u8s8", a8, 0, w_full, 0),
                                 ("s8s8", (a8.astype(np.int16) - 128).astype(np.int8), 0,
                                  w_full, 0),
                                 ("u8u8", a8, 0, w_u8, 128)):
        exact = (a.astype(np.int64) - azp) @ (w.astype(np.int64) - wzp) * sa * sw
        sy = float(np.abs(exact).max()) / 100
        adt = TensorProto.UINT8 if a.dtype == np.uint8 else TensorProto.INT8
        inits = [_t("as", np.float32(sa)), _t("azp", a.dtype.type(azp)), _t("B", w),
                 _t("bs", np.float32(sw)), _t("bzp", w.dtype.type(wzp)),
                 _t("ys", np.float32(sy)), _t("yzp", np.uint8(128))]
        out[f"QLinearMatMul {name}"] = (
            _model([helper.make_node("QLinearMatMul", ["A", "as", "azp", "B", "bs", "bzp", "ys",
                                                       "yzp"], ["Y"])],
                   [_vi("A", adt, [M, K])], [_vi("Y", TensorProto.UINT8, [M, N])], inits),
            {"A": a}, _requant(exact, sy, 128, np.uint8))
    for name, x, act in (("u8s8", x8, np.uint8),
                         ("s8s8", (x8.astype(np.int16) - 128).astype(np.int8), np.int8)):
        exact = _conv64(x.astype(np.int64), cw.astype(np.int64)) * sa * sw
        sy = float(np.abs(exact).max()) / 100
        adt = TensorProto.UINT8 if act is np.uint8 else TensorProto.INT8
        inits = [_t("xs", np.float32(sa)), _t("xzp", act(0)), _t("W", cw),
                 _t("ws", np.float32(sw)), _t("wzp", np.int8(0)), _t("ys", np.float32(sy)),
                 _t("yzp", act(0))]
        out[f"QLinearConv {name}"] = (
            _model([helper.make_node("QLinearConv", ["X", "xs", "xzp", "W", "ws", "wzp", "ys",
                                                     "yzp"], ["Y"], pads=[1, 1, 1, 1])],
                   [_vi("X", adt, [1, C, H, H])], [_vi("Y", adt, [1, CO, H, H])], inits),
            {"X": x}, _requant(exact, sy, 0, act))


def _qdq(x: str, scale: float, zp: Any, name: str) -> tuple[list[Any], list[Any], str]:
    inits = [_t(f"{name}_s", np.float32(scale)), _t(f"{name}_z", zp)]
    nodes = [helper.make_node("QuantizeLinear", [x, f"{name}_s", f"{name}_z"], [f"{name}_q"]),
             helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s", f"{name}_z"],
                              [f"{name}_dq"])]
    return nodes, inits, f"{name}_dq"


def _float_models(out: dict[str, Any], rng: np.random.Generator) -> None:
    """QDQ MatMul/Conv, DynamicQuantizeMatMul, MatMulNBits, float16 MatMul/Conv."""
    x = rng.uniform(0, 1, (M, K)).astype(np.float32)
    x[:, ::2] = 1.0  # pairs of large activations
    w = rng.uniform(-1, 1, (K, N)).astype(np.float32)
    w[::2] = np.abs(w[::2]) * np.sign(w[1::2])  # adjacent weights of one sign
    xa = np.clip(np.rint(x * 255), 0, 255) / 255  # x as uint8 sees it (scale 1/255, zp 0)
    for name, qmax in (("u8s8", 127), ("u8s8-7bit", 64)):
        ws = float(np.abs(w).max()) / qmax
        wq = np.clip(np.rint(w / ws), -qmax, qmax).astype(np.int8)
        nodes, inits, xdq = _qdq("x", 1 / 255, np.uint8(0), "x")
        nodes += [helper.make_node("DequantizeLinear", ["wq", "ws"], ["wdq"]),
                  helper.make_node("MatMul", [xdq, "wdq"], ["Y"])]
        inits += [_t("wq", wq), _t("ws", np.float32(ws))]
        out[f"QDQ MatMul {name}"] = (
            _model(nodes, [_vi("x", TensorProto.FLOAT, [M, K])],
                   [_vi("Y", TensorProto.FLOAT, [M, N])], inits), {"x": x},
            xa @ (wq.astype(np.float64) * ws))
        inits2 = [_t("B", wq), _t("bs", np.float32(ws))]
        out[f"DynamicQuantizeMatMul {name}"] = (
            _model([helper.make_node("DynamicQuantizeMatMul", ["x", "B", "bs"], ["Y"],
                                     domain="com.microsoft")],
                   [_vi("x", TensorProto.FLOAT, [M, K])], [_vi("Y", TensorProto.FLOAT, [M, N])],
                   inits2, ms=True), {"x": x}, xa @ (wq.astype(np.float64) * ws))
    xc = rng.uniform(0.5, 1, (1, C, H, H)).astype(np.float32)  # large activations
    cw = rng.uniform(-1, 1, (CO, C, 3, 3)).astype(np.float32)
    cw[::2] = np.abs(cw[::2])  # filters of one sign: every pair of products adds up
    xca = np.clip(np.rint(xc * 255), 0, 255) / 255
    for name, qmax in (("u8s8", 127), ("u8s8-7bit", 64)):
        ws = np.abs(cw).reshape(CO, -1).max(1) / qmax  # per output channel
        wq = np.clip(np.rint(cw / ws[:, None, None, None]), -qmax, qmax).astype(np.int8)
        nodes, inits, xdq = _qdq("x", 1 / 255, np.uint8(0), "x")
        exact = _conv64(xca, wq.astype(np.float64) * ws[:, None, None, None])
        ys = float(np.abs(exact).max()) / 127  # the output quantized too: a QLinearConv
        ynodes, yinits, _ = _qdq("c", ys, np.uint8(128), "y")
        nodes += [helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wdq"], axis=0),
                  helper.make_node("Conv", [xdq, "wdq"], ["c"], pads=[1, 1, 1, 1]),
                  *ynodes, helper.make_node("Identity", ["y_dq"], ["Y"])]
        inits += [_t("wq", wq), _t("ws", ws.astype(np.float32)),
                  _t("wz", np.zeros(CO, np.int8)), *yinits]
        out[f"QDQ Conv {name}"] = (
            _model(nodes, [_vi("x", TensorProto.FLOAT, [1, C, H, H])],
                   [_vi("Y", TensorProto.FLOAT, [1, CO, H, H])], inits), {"x": xc},
            (_requant(exact, ys, 128, np.uint8) - 128) * ys)
    _nbits(out, x, w)
    for name, dt in (("MatMul float16", np.float16),):
        out[name] = (_model([helper.make_node("MatMul", ["x", "W"], ["Y"])],
                            [_vi("x", TensorProto.FLOAT16, [M, K])],
                            [_vi("Y", TensorProto.FLOAT16, [M, N])], [_t("W", w.astype(dt))]),
                     {"x": x.astype(dt)}, x.astype(dt).astype(np.float64) @ w.astype(dt))
    out["Conv float16"] = (
        _model([helper.make_node("Conv", ["x", "W"], ["Y"], pads=[1, 1, 1, 1])],
               [_vi("x", TensorProto.FLOAT16, [1, C, H, H])],
               [_vi("Y", TensorProto.FLOAT16, [1, CO, H, H])], [_t("W", cw.astype(np.float16))]),
        {"x": xc.astype(np.float16)},
        _conv64(xc.astype(np.float16), cw.astype(np.float16)))


def _nbits(out: dict[str, Any], x: np.ndarray, w: np.ndarray) -> None:
    """MatMulNBits as onnxruntime's MatMulNBitsQuantizer writes it (symmetric, blocks of 32);
    the reference: the float input against the dequantized weights, float64."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    float_model = _model([helper.make_node("MatMul", ["x", "W"], ["Y"], name="mm")],
                         [_vi("x", TensorProto.FLOAT, [M, K])],
                         [_vi("Y", TensorProto.FLOAT, [M, N])], [_t("W", w)])
    for bits in (8, 4):
        for level in (0, 1, 2, 4):
            q = MatMulNBitsQuantizer(onnx.ModelProto.FromString(float_model.SerializeToString()),
                                     bits=bits, block_size=32, is_symmetric=True,
                                     accuracy_level=level)
            q.process()
            model = q.model.model
            out[f"MatMulNBits {bits}-bit acc{level}"] = (model, {"x": x},
                                                         x.astype(np.float64) @ _nbits_w(model))


def _nbits_w(model: onnx.ModelProto) -> np.ndarray:
    """The (K, N) float64 weights a MatMulNBits node holds (symmetric: zero point 2^(bits-1);
    4-bit: low nibble first), as the kernel dequantizes them."""
    node = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    bits, block = attrs["bits"], attrs["block_size"]
    blob = inits[node.input[1]].astype(np.int64)  # N, blocks, bytes
    if bits == 4:
        blob = np.stack([blob & 15, blob >> 4], -1).reshape(blob.shape[0], blob.shape[1], -1)
    zp = 2 ** (bits - 1)
    if len(node.input) > 3 and node.input[3]:
        raise ValueError("zero points: the bench writes symmetric MatMulNBits only")
    scales = inits[node.input[2]].astype(np.float64).reshape(blob.shape[0], -1, 1)
    w = ((blob - zp) * scales).reshape(blob.shape[0], -1)[:, :attrs["K"]]
    assert block == blob.shape[2]
    return w.T


# -- the child: runs the models (natively or under QEMU) -----------------------------------------

def child(folder: str, timed: bool) -> None:
    """Run every model.onnx in ``folder`` on its feeds; write outputs (and times) beside."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    result: dict[str, Any] = {"isa": present_isa(), "ort": ort.__version__}
    for d in sorted(Path(folder).glob("k*")):
        feeds = dict(np.load(d / "feeds.npz"))
        try:
            s = ort.InferenceSession(str(d / "model.onnx"), so,
                                     providers=["CPUExecutionProvider"])
            y = s.run(None, feeds)[0]
            times = []
            for _ in range(23 if timed else 0):
                t0 = time.perf_counter()
                s.run(None, feeds)
                times.append(time.perf_counter() - t0)
            np.save(d / f"out-{result['isa']}.npy", y)
            result[d.name] = {"ms": 1e3 * float(np.median(times[3:])) if times else None}
        except Exception as e:  # noqa: BLE001 - a kernel missing on this build is a result
            result[d.name] = {"error": str(e).splitlines()[0].split(" : ")[-1][:120]}
    (Path(folder) / f"run-{result['isa']}.json").write_text(json.dumps(result))
    print(result["isa"])


def present_isa() -> str:
    """avx2 where u8s8 MatMulInteger saturates, else amx / avx512-vnni / avx-vnni by the CPU
    flags (as onnxmedic/isa.py tells it); arm64 on ARM."""
    import onnxruntime as ort

    if platform.machine().lower() in ("aarch64", "arm64"):
        return "arm64"
    m = _model([helper.make_node("MatMulInteger", ["A", "B"], ["Y"])],
               [_vi("A", TensorProto.UINT8, [1, 64])], [_vi("Y", TensorProto.INT32, [1, 1])],
               [_t("B", np.full((64, 1), 127, np.int8))])
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    if int(s.run(None, {"A": np.full((1, 64), 255, np.uint8)})[0][0, 0]) != 255 * 127 * 64:
        return "avx2"
    flags = ""
    try:
        flags = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "")
    except OSError:
        pass
    for flag, name in (("amx_int8", "amx"), ("avx512_vnni", "avx512-vnni"),
                       ("avx_vnni", "avx-vnni")):
        if flag in flags.split():
            return name
    return "x86-64 (no saturation)"


def _error(got: np.ndarray, ref: np.ndarray) -> float:
    g, r = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    norm = float(np.linalg.norm(r))
    return float(np.linalg.norm(g - r)) / norm if norm else float(np.linalg.norm(g))


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--emulate", choices=["haswell", "none"], default="haswell")
    ap.add_argument("--json", default="bench/results/isa_kernels.json")
    ap.add_argument("--md", default="bench/results/isa_kernels.md")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--timed", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.child:
        return child(ns.child, ns.timed)
    kernels = build(np.random.default_rng(0))
    folder = Path(tempfile.mkdtemp(prefix="isa-kernels-"))
    try:
        names = {}
        for i, (name, (model, feeds, ref)) in enumerate(kernels.items()):
            d = folder / f"k{i:02d}"
            d.mkdir()
            onnx.save(model, str(d / "model.onnx"))
            np.savez(d / "feeds.npz", **feeds)
            np.save(d / "ref.npy", ref)
            names[d.name] = name
        runs = [_spawn([sys.executable], folder, True)]
        if ns.emulate == "haswell":
            qemu = shutil.which("qemu-x86_64")
            if qemu and platform.machine() == "x86_64":
                runs.append(_spawn([qemu, "-cpu", QEMU_CPU, sys.executable], folder, False))
            else:
                print("no qemu-x86_64 here: the AVX2 column is left out", file=sys.stderr)
        rows = _rows(folder, names, runs)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    _write(ns, rows, runs)


def _spawn(prefix: list[str], folder: Path, timed: bool) -> dict[str, Any]:
    cmd = prefix + [str(Path(__file__).resolve()), "--child", str(folder)] + (
        ["--timed"] if timed else [])
    isa = subprocess.run(cmd, check=True, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout.split()[-1]
    run = json.loads((folder / f"run-{isa}.json").read_text())
    run["emulated"] = prefix[0] != sys.executable
    return run


def _rows(folder: Path, names: dict[str, str], runs: list[dict[str, Any]]) -> list[dict]:
    rows = []
    for key, name in names.items():
        ref = np.load(folder / key / "ref.npy")
        row: dict[str, Any] = {"kernel": name}
        native = None
        for run in runs:
            isa, got = run["isa"], run.get(key, {})
            path = folder / key / f"out-{isa}.npy"
            if "error" in got or not path.exists():
                row[isa] = {"error": got.get("error", "no output")}
                continue
            y = np.load(path)
            native = y if native is None else native
            row[isa] = {"rel_error": _error(y, ref),
                        "max_abs": float(np.abs(y.astype(np.float64) - ref).max()),
                        "same_as_native": bool(np.array_equal(y, native))}
            if not run["emulated"]:
                row[isa]["ms"] = got.get("ms")
        rows.append(row)
    return rows


def _write(ns: argparse.Namespace, rows: list[dict], runs: list[dict[str, Any]]) -> None:
    import onnxruntime as ort

    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{_cpu_name()}, ONNX Runtime {ort.__version__}"
    cmd = "python bench/optimize/isa_kernels.py " + " ".join(sys.argv[1:])
    isas = [r["isa"] + (" (QEMU)" if r["emulated"] else "") for r in runs]
    Path(ns.json).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.json).write_text(json.dumps({"command": cmd, "date": when, "machine": machine,
                                         "isas": isas, "shapes": {"matmul": [M, K, N],
                                                                  "conv": [C, H, CO]},
                                         "rows": rows}, indent=1))
    head = ["kernel"] + [f"{i} rel. error" for i in isas] + [f"{isas[0]} ms", "same"]
    lines = [f"`{cmd}` - {when} - {machine}", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for row in rows:
        cells, same = [row["kernel"]], ""
        for r in runs:
            c = row.get(r["isa"], {})
            cells.append(c["error"][:40] if "error" in c else f"{c['rel_error']:.2e}")
            if r["emulated"] and "same_as_native" in c:
                same = "yes" if c["same_as_native"] else "no"
        first = row.get(runs[0]["isa"], {})
        cells += [f"{first['ms']:.3f}" if first.get("ms") else "", same]
        lines.append("| " + " | ".join(cells) + " |")
    Path(ns.md).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
