"""CUDA checks for a machine with an NVIDIA GPU and onnxruntime-gpu (never run by the tests).

Two steps, because the GPU machine may have another torch than the one onnxmedic exports with:

    python bench/gpu/gpu_check.py prepare DIR     # here (CPU): export the models with onnxmedic
    python bench/gpu/gpu_check.py run DIR --json OUT.json    # on the GPU machine

``prepare`` exports a few small models with ``onnxmedic.export(..., target="cuda")`` (float32
and float16, plus a bfloat16 model and a float64 island) and saves their weights and inputs.
``run``:

1. compares the CUDA kernel table onnxmedic ships for CPU-only onnxruntime builds
   (``fixes/data/cuda_kernels.json``, from ONNX Runtime's OperatorKernels.md) with the kernels the
   installed onnxruntime-gpu really registers: ops and op/type pairs on one side only;
2. runs ``onnxmedic.doctor(..., target="cuda")`` on every model with the GPU present (findings,
   and whether CUDAExecutionProvider was used), and checks the ONNX model's outputs on CUDA
   against PyTorch's on the CPU;
3. times ONNX Runtime's CUDAExecutionProvider (inputs and outputs bound on the GPU with
   IOBinding) against PyTorch eager on the same GPU (median of ``--repeat`` runs after warm-up,
   CUDA synchronised), float32 and float16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench" / "latency"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from latency_models import MLP, Attention, ConvNet  # noqa: E402


class DoubleIsland(torch.nn.Module):
    """float32 with a float64 island (a precision-sensitive step kept in double)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.b(torch.special.log1p(self.a(x).double().abs()).float())


MODELS = {
    "mlp": (MLP, (64, 256)),
    "convnet": (ConvNet, (16, 3, 64, 64)),
    "attention": (Attention, (8, 64, 128)),
    "double_island": (DoubleIsland, (32, 64)),
}
DTYPES = {"mlp": ("float32", "float16", "bfloat16"), "convnet": ("float32", "float16"),
          "attention": ("float32", "float16"), "double_island": ("float32",)}


def prepare(out: Path) -> None:
    import onnxmedic

    out.mkdir(parents=True, exist_ok=True)
    index = []
    for name, (make, shape) in MODELS.items():
        torch.manual_seed(0)
        model = make().eval()
        torch.save(model.state_dict(), out / f"{name}.pt")
        x = torch.randn(*shape)
        np.save(out / f"{name}.x.npy", x.numpy())
        for dt in DTYPES[name]:
            m = make().eval()
            m.load_state_dict(model.state_dict())
            m = m.to(getattr(torch, dt))
            xi = x.to(getattr(torch, dt))
            path = out / f"{name}.{dt}.onnx"
            r = onnxmedic.export(m, (xi,), path, target="cuda", keep_unverified=True)
            index.append({"model": name, "dtype": dt, "onnx": path.name, "ok": r.ok,
                          "codes": [f.code for f in r.findings]})
            print(name, dt, r.ok, [f.code for f in r.findings])
    (out / "index.json").write_text(json.dumps(index, indent=1))


def _kernel_table_diff() -> dict:
    from onnxmedic.fixes import dtypes as fx

    rows = fx.registered_kernels()  # asked in a child process: it may crash there
    real: dict = {}
    for prov, dom, op, rng, cons in rows:
        if prov == "CUDAExecutionProvider":
            real.setdefault((fx._domain(dom), op), []).append((rng[0], rng[1], cons))
    shipped = fx.shipped_kernel_table("CUDAExecutionProvider")
    if not real:
        return {"error": "onnxruntime registered no CUDA kernels, or get_all_opkernel_def "
                "failed in the child process (see the log)", "kernels_listed": len(rows)}

    def pairs(table):
        return {(d, op, t) for (d, op), ks in table.items() for _, _, cons in ks
                for ts in cons.values() for t in ts}

    rp, sp = pairs(real), pairs(shipped)
    only_real_ops = sorted({f"{d}:{op}" if d else op for d, op in set(real) - set(shipped)})
    only_shipped_ops = sorted({f"{d}:{op}" if d else op for d, op in set(shipped) - set(real)})
    return {"ops_runtime": len(real), "ops_shipped": len(shipped),
            "ops_only_runtime": only_real_ops, "ops_only_shipped": only_shipped_ops,
            "op_type_pairs_runtime": len(rp), "op_type_pairs_shipped": len(sp),
            "op_type_pairs_only_runtime": len(rp - sp), "op_type_pairs_only_shipped": len(sp - rp),
            "examples_only_runtime": sorted(f"{op}:{t[7:-1]}" for _, op, t in rp - sp)[:20],
            "examples_only_shipped": sorted(f"{op}:{t[7:-1]}" for _, op, t in sp - rp)[:20]}


def _time_cuda(fn, repeat: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _ort_cuda(path: Path, x: torch.Tensor, repeat: int, tf32: bool = True
              ) -> tuple[float, torch.Tensor, list]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    cuda = ("CUDAExecutionProvider", {} if tf32 else {"use_tf32": "0"})
    s = ort.InferenceSession(str(path), so, providers=[cuda, "CPUExecutionProvider"])
    xin = x.contiguous().cuda()
    b = s.io_binding()
    elem = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64}
    inp = s.get_inputs()[0]
    b.bind_input(inp.name, "cuda", 0, elem[x.dtype], list(xin.shape), xin.data_ptr())
    for o in s.get_outputs():
        b.bind_output(o.name, "cuda")

    def run():
        s.run_with_iobinding(b)

    sec = _time_cuda(run, repeat)
    out = b.get_outputs()[0]
    y = torch.from_numpy(out.numpy())
    return sec, y, s.get_providers()


def run(folder: Path, out: Path | None, repeat: int) -> dict:
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):  # CUDA/cuDNN from the nvidia-* wheels torch brought
        ort.preload_dlls()

    import onnxmedic

    report: dict = {"onnxruntime": ort.__version__, "providers": ort.get_available_providers(),
                    "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    print(json.dumps(report))
    report["kernel_table"] = _kernel_table_diff()
    print(json.dumps(report["kernel_table"], indent=1))
    rows = []
    for e in json.loads((folder / "index.json").read_text()):
        name, dt = e["model"], e["dtype"]
        make, _ = MODELS[name]
        row = {"model": name, "dtype": dt, "export_ok": e["ok"], "export_codes": e["codes"]}
        path = folder / e["onnx"]
        if not path.exists():
            row["error"] = "not exported"
            rows.append(row)
            continue
        d = onnxmedic.doctor(path, target="cuda")
        row["doctor_ok"] = d.ok
        row["doctor_codes"] = [f.code for f in d.findings]
        row["doctor_messages"] = [f"{f.code}: {f.message[:200]}" for f in d.findings
                                  if f.code not in ("OM534",)]
        t = onnxmedic.doctor(path, target="tensorrt")
        row["doctor_tensorrt_codes"] = [f.code for f in t.findings]
        row["doctor_tensorrt_messages"] = [f"{f.code}: {f.message[:200]}" for f in t.findings
                                           if f.code in ("OM305", "OM535", "OM510", "OM511")]
        torch.manual_seed(0)
        m = make().eval()
        m.load_state_dict(torch.load(folder / f"{name}.pt"))
        x = torch.from_numpy(np.load(folder / f"{name}.x.npy"))
        with torch.no_grad():
            ref = m(x).double()  # float32 on the CPU: the reference for every dtype
            tdt = getattr(torch, dt)
            mg = m.to(tdt).cuda()
            xg = x.to(tdt).cuda()
            row["eager_cuda_us"] = _time_cuda(lambda: mg(xg), repeat) * 1e6
            eager = mg(xg).double().cpu()
        if dt == "bfloat16":  # numpy (and so IOBinding's output copy) has no bfloat16
            row["ort_note"] = "not timed: bfloat16 outputs cannot be read through numpy"
            rows.append(row)
            print(json.dumps(row))
            continue
        try:
            sec, y, used = _ort_cuda(path, x.to(tdt), repeat)
        except Exception as exc:  # a model the CUDA provider refuses: that is the finding
            row["ort_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
            print(json.dumps(row))
            continue
        row["ort_cuda_us"] = sec * 1e6
        row["ratio_ort_over_eager"] = row["ort_cuda_us"] / row["eager_cuda_us"]
        row["providers_used"] = used
        y = y.double()
        scale = ref.abs().max().item() or 1.0
        row["max_abs_err_vs_cpu_f32"] = (y - ref).abs().max().item()
        if dt == "float32":  # onnxmedic's own sandbox run on CUDA, compared as verify does
            import onnx

            from onnxmedic import sandbox
            from onnxmedic.verify.compare import compare_outputs

            onnx_in = onnx.load(str(path), load_external_data=False).graph.input[0].name
            sb = sandbox.run_model(path, [{onnx_in: x.numpy()}],
                                   providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
            row["sandbox_providers"] = sb.providers
            comps = compare_outputs(sb.output_names, [ref.float().numpy()], sb.outputs[0])
            row["sandbox_verify_ok"] = all(c.ok for c in comps)
            row["sandbox_max_abs"] = max(c.max_abs for c in comps)
            comps = compare_outputs(sb.output_names, [ref.float().numpy()], [y.float().numpy()])
            row["default_tf32_verify_ok"] = all(c.ok for c in comps)
        if dt == "float32":  # ONNX Runtime's CUDA provider with TF32 math turned off
            sec0, y0, _ = _ort_cuda(path, x.to(tdt), repeat, tf32=False)
            row["ort_cuda_no_tf32_us"] = sec0 * 1e6
            row["no_tf32_max_abs_err_vs_cpu_f32"] = (y0.double() - ref).abs().max().item()
        row["eager_max_abs_err_vs_cpu_f32"] = (eager - ref).abs().max().item()
        row["rel_to_max"] = row["max_abs_err_vs_cpu_f32"] / scale
        rows.append(row)
        print(json.dumps(row))
    report["models"] = rows
    if out is not None:
        out.write_text(json.dumps(report, indent=1))
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("dir", type=Path)
    b = sub.add_parser("run")
    b.add_argument("dir", type=Path)
    b.add_argument("--json", type=Path)
    b.add_argument("--repeat", type=int, default=200)
    ns = p.parse_args()
    if ns.cmd == "prepare":
        prepare(ns.dir)
    else:
        run(ns.dir, ns.json, ns.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
