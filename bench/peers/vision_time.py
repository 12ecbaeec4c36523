"""Export + verify time of onnxmedic against torch.onnx.export(dynamo=True, verify=True) on
vision zoo entries, with PyTorch's verification runs computed ahead (during translation,
onnxmedic.verify.ahead) and without (ONNXMEDIC_AHEAD=0), in the same run.

Each entry runs twice, back to back, each time in a fresh worker of bench/peers/zoo_bench.py
(torch.onnx first, then onnxmedic, as in the zoo table): once with ONNXMEDIC_AHEAD=0, once
with it on. The table gives both tools' seconds, both ratios and onnxmedic's stage timings.

    python bench/peers/vision_time.py --only tv/resnet50,timm/vit_small_patch16_224 \
        --results build/vision_time.json

``--ab REPS``: onnxmedic alone, in this one process, the two modes alternated REPS times per
entry after a warm-up export (medians; less noise from process start and machine load).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from bench.peers.zoo_bench import _run_child, prior_results, zoo_flags  # noqa: E402

MODES = (("serial", "0"), ("ahead", "1"))
STAGES = ("preflight", "capture", "translate", "check", "runtime", "compare", "reference")


def _pair(zoo: str, name: str, timeout: float, threads: int) -> dict[str, Any]:
    """The entry in both modes: {"name", "serial": record, "ahead": record}."""
    rec: dict[str, Any] = {"name": name}
    for mode, env in MODES:
        old = os.environ.get("ONNXMEDIC_AHEAD")
        os.environ["ONNXMEDIC_AHEAD"] = env
        try:
            rec[mode] = _run_child(zoo, name, timeout, threads,
                                   str(ROOT / "bench" / "peers" / "zoo_bench.py"),
                                   ("--latency-runs", "0"))
        finally:
            if old is None:
                os.environ.pop("ONNXMEDIC_AHEAD", None)
            else:
                os.environ["ONNXMEDIC_AHEAD"] = old
    return rec


def _ratio(r: dict[str, Any]) -> float | None:
    if r.get("onnxmedic_ok") and r.get("torch_onnx_ok") and r.get("torch_onnx_seconds"):
        return r["onnxmedic_seconds"] / r["torch_onnx_seconds"]
    return None


def table(recs: list[dict[str, Any]]) -> str:
    """One row per entry and mode; the median ratio of each mode below."""
    lines = ["| model | mode | torch.onnx s | onnxmedic s | ratio | "
             + " | ".join(STAGES) + " |", "|---|---|---|---|---|" + "---|" * len(STAGES)]
    for r in sorted(recs, key=lambda r: r["name"]):
        for mode, _ in MODES:
            m = r.get(mode, {})
            if "crashed" in m or not m:
                lines.append(f"| {r['name']} | {mode} | | | | worker: "
                             f"{str(m.get('crashed'))[:80]} |" + " |" * (len(STAGES) - 1))
                continue
            t = m.get("onnxmedic_timings") or {}
            ratio = _ratio(m)
            lines.append(
                f"| {r['name']} | {mode} | {m.get('torch_onnx_seconds', 0):.1f} | "
                f"{m.get('onnxmedic_seconds', 0):.1f} | "
                f"{'' if ratio is None else f'{ratio:.2f}'} | "
                + " | ".join(f"{t[s]:.1f}" if s in t else "" for s in STAGES) + " |")
    lines.append("")
    for mode, _ in MODES:
        ratios = [x for x in (_ratio(r.get(mode, {})) for r in recs) if x is not None]
        lines.append(f"{mode}: median export+verify time onnxmedic / torch.onnx(verify=True) "
                     f"over {len(ratios)} entries: "
                     + (f"{statistics.median(ratios):.2f}x" if ratios else "n/a"))
    return "\n".join(lines)


def ab(zoo: str, names: list[str], reps: int) -> None:
    """Both modes alternated ``reps`` times per entry in this process; prints the medians."""
    import time
    import warnings

    import onnxmedic
    from onnxmedic.sweep import as_case, import_source, load_zoo

    warnings.simplefilter("ignore")
    for name in names:
        entry = next(e for e in load_zoo(zoo) if e.name == name)
        case = as_case(getattr(import_source(entry.source), entry.attr)[name](), name)
        onnxmedic.export(case.model, case.args, dynamic_shapes=case.dynamic_shapes)
        times: dict[str, list[float]] = {m: [] for m, _ in MODES}
        for i in range(reps):
            for mode, env in MODES if i % 2 else MODES[::-1]:
                os.environ["ONNXMEDIC_AHEAD"] = env
                t0 = time.perf_counter()
                r = onnxmedic.export(case.model, case.args, dynamic_shapes=case.dynamic_shapes)
                times[mode].append(time.perf_counter() - t0)
                assert r.ok, name
        print(f"{name}: " + ", ".join(f"{m} median {statistics.median(v):.2f} s "
                                      f"({', '.join(f'{x:.1f}' for x in v)})"
                                      for m, v in times.items()), flush=True)


def main() -> int:
    ap = zoo_flags(__doc__, "vision.py:ALL", "vision_time.json", 1200)
    ap.add_argument("--ab", type=int, default=0, help="onnxmedic alone, modes alternated N "
                    "times in this process")
    ns = ap.parse_args()
    from onnxmedic.report.files import atomic_write_text
    from onnxmedic.sweep import load_zoo

    results, recs = prior_results(ns.results, ns.resume or ns.table)
    if ns.table:
        print(table(recs))
        return 0
    done = {r["name"] for r in recs}
    names = [e.name for e in load_zoo(ns.zoo) if e.name not in done and
             (not ns.only or e.name in ns.only.split(","))]
    if ns.ab:
        ab(ns.zoo, names, ns.ab)
        return 0
    threads = max(1, (os.cpu_count() or 1) // max(1, ns.jobs))
    for name in names:  # one at a time: the two modes must not share the machine
        r = _pair(ns.zoo, name, ns.timeout, threads)
        recs = [x for x in recs if x["name"] != name] + [r]
        atomic_write_text(results, json.dumps(recs, indent=1, default=str))
        print(f"{name}: " + ", ".join(
            f"{mode} {r[mode].get('onnxmedic_seconds', 0):.1f} s vs "
            f"{r[mode].get('torch_onnx_seconds', 0):.1f} s" for mode, _ in MODES), flush=True)
    print(table(recs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
