"""A real-size torchvision detector as a new user has it, its dict flattened in one of three
layouts (tests/vision/test_layouts.py's ``Layout``: sorted keys, insertion order, a
hand-written nested tuple), exported and verified by onnxmedic; with ``faults``, a moved box,
a dropped box and a wrong label injected into the ONNX model and each verified again.

    OMP_NUM_THREADS=1 PYTHONPATH=src:. .venv-vision/bin/python bench/peers/detection_layouts.py \
        retinanet_resnet50_fpn hand faults [--weights confident|fresh] [--default-size]

``--weights fresh``: torchvision's own initialisation (91 classes), which often scores every
box alike or under the threshold (0 detections); ``confident`` (the default): 11 classes,
bench/zoo/vision.py's ``confident`` weights, which fire with many detections of distinct
scores, so that the faults are tellable. One thread (OMP_NUM_THREADS=1): on a shared 2-core
machine, torch's thread pool makes the reference roi_align's small ops ten times slower.

Prints the verdict, the rule that judged each output, the detections, the wall time and the
peak memory (this process and, separately, its largest child: the ONNX Runtime sandbox). With
``faults`` and ``--results FILE.json``, the run's row (model, layout: verified, detections,
seconds, each fault's finding codes) replaces that model and layout's row in FILE.json, and
FILE.md is written from all its rows: the model x layout matrix.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.zoo.torchvision_cpu import install  # noqa: E402

install()  # torchvision's ops defined before torchvision is imported

import torch  # noqa: E402
import torchvision  # noqa: E402

import onnxmedic  # noqa: E402
from bench.zoo import vision  # noqa: E402
from tests.vision.test_layouts import Layout, check_layout  # noqa: E402


def detector(name: str, weights: str, default_size: bool = False
             ) -> tuple[torch.nn.Module, torch.Tensor]:
    """The detector ``name`` with ``weights`` and its image (300x300 for SSD300, else 320);
    ``default_size``: the confident detector resizing the image to its own default (800 for
    the R-CNNs, RetinaNet and FCOS) instead of 320."""
    if weights == "confident" and default_size:
        case = vision._detection(name, 300 if name == "ssd300_vgg16" else 320,
                                 vision.confident)()
        return case.model.detector, case.args[0]
    if weights == "confident":
        case = vision.confident_detection(name)
        return case.model.detector, case.args[0]
    kw = dict(min_size=320, max_size=320) if name.endswith(
        ("resnet50_fpn", "resnet50_fpn_v2", "mobilenet_v3_large_fpn")) else {}
    size = 300 if name == "ssd300_vgg16" else 320
    torch.manual_seed(0)
    det = torchvision.models.get_model(name, weights=None, weights_backbone=None, **kw).eval()
    return det, torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(0))


LAYOUTS = ("sorted", "insertion", "hand")
COMMAND = ("OMP_NUM_THREADS=1 PYTHONPATH=src:. .venv-vision/bin/python "
           "bench/peers/detection_layouts.py NAME LAYOUT faults --results "
           "bench/results/detection_layouts.json")


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def record(results: Path, row: dict) -> None:
    """Replace ``row``'s model x layout row in ``results`` (JSON) and write the matrix next to
    it (``results`` with the suffix .md)."""
    rows = json.loads(results.read_text()) if results.exists() else []
    rows = [r for r in rows if (r["model"], r["layout"]) != (row["model"], row["layout"])]
    rows.append(row)
    rows.sort(key=lambda r: (r["model"], LAYOUTS.index(r["layout"])))
    results.write_text(json.dumps(rows, indent=1) + "\n")
    head = ("| model | layout | verified | detections (distinct scores) | export + verify + "
            "3 faults s | peak MiB (ORT sandbox) | moved box | dropped box | wrong label | "
            "commit, date |\n|---|---|---|---|---|---|---|---|---|---|\n")

    def codes(r: dict, what: str) -> str:
        if what in r["faults"]:
            return " ".join(sorted(set(r["faults"][what])))
        if r["error"].startswith(f"{what} not caught"):
            return "NOT CAUGHT" + r["error"][len(f"{what} not caught"):]
        return "not run"

    def verified(r: dict) -> str:  # the export's own verification (a fault not caught: yes)
        tie = " (OM621: a near tie upstream)" if "OM621" in r["faults"].get("export", []) else ""
        return ("yes" + tie if r["verified"] or " not caught" in r["error"]
                else "NO: " + r["error"])

    lines = [f"| {r['model']} | {r['layout']} | {verified(r)}"
             f" | {r['detections']} ({r['distinct']}) | {r['seconds']} | {r['peak_mib']} "
             f"({r['child_mib']}) | {codes(r, 'moved box')} | {codes(r, 'dropped box')} | "
             f"{codes(r, 'wrong label')} | {r['commit']}, {r['date']} |" for r in rows]
    machines = sorted({r["machine"] for r in rows})
    results.with_suffix(".md").write_text(
        "# torchvision detectors in three output layouts, faults injected (real size)\n\n"
        f"`{COMMAND}` (one run at a time, on 2 cores shared with other agents; written by "
        "that command): 11 classes, bench/zoo/vision.py's `confident` weights, one image of "
        "320x320 (300x300 for SSD300); export and verify, then a moved box (+2 on the first "
        "box), a dropped box (the first row of every output) and a wrong label (+1 on the "
        "first) injected into the ONNX model, each verified; each fault's column: the finding "
        "codes of its verification. The stage timings of each run are in the JSON.\n\n"
        f"machine: {'; '.join(machines)}\n\n" + head + "\n".join(lines) + "\n")


def main() -> None:
    """Export and verify one detector in one layout (and with ``faults``, inject each fault)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name")
    ap.add_argument("layout", choices=["sorted", "insertion", "hand"])
    ap.add_argument("mode", choices=["export", "faults"], nargs="?", default="export")
    ap.add_argument("--weights", choices=["confident", "fresh"], default="confident")
    ap.add_argument("--results", type=Path, help="with faults: the JSON file of rows to update")
    ap.add_argument("--default-size", action="store_true",
                    help="the detector at its own default size (800 for the R-CNNs), its row "
                         "named 'NAME (at 800, its default size)'")
    a = ap.parse_args()
    det, image = detector(a.name, a.weights, a.default_size)
    with torch.no_grad():
        scores = det([image[0]])[0]["scores"]
    print(f"detections: {scores.numel()}, distinct scores: {len(set(scores.tolist()))}")
    start = time.time()
    found: dict[str, list[str]] = {}
    timings: dict[str, dict[str, float]] = {}
    error = ""
    with tempfile.TemporaryDirectory() as tmp:
        if a.mode == "faults":
            try:
                found = check_layout(Path(tmp), det, image, a.layout, timings)
            except AssertionError as e:  # not verified, or a fault not caught as it should be
                error = str(e)[:300].replace("|", "/").replace("\n", " ")
                print("not verified or not caught (in full):", e)  # the table keeps 300 chars
            print("faults caught:", found, error)
            for run, stages in timings.items():
                print(f"  {run}: " + ", ".join(f"{k} {v:.0f} s" for k, v in stages.items()))
        else:
            r = onnxmedic.export(Layout(det, a.layout).eval(), (image,), Path(tmp) / "m.onnx",
                                 localize=False, keep_unverified=True)
            print("verified:", r.ok)
            for f in r.findings:
                if f.severity.value != "info":
                    print(f.code, f.message[:400])
            for c in r.verification:
                print(" ", c.name, c.input_set, c.ok, c.rule, c.expected_shape)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024
    seconds = round(time.time() - start)
    print(f"{a.name} {a.layout} {a.mode} ({a.weights}): {seconds} s, "
          f"peak {peak} MiB (largest child {child} MiB)")
    if a.results and a.mode == "faults":
        commit = os.environ.get("BENCH_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        record(a.results, dict(
            model=a.name + (" (at 800, its default size)" if a.default_size else ""), layout=a.layout, verified=not error, error=error,
            detections=scores.numel(), distinct=len(set(scores.tolist())), seconds=seconds,
            peak_mib=peak, child_mib=child, faults=found, timings={run: {k: round(v, 1) for k, v in st.items()}
                                   for run, st in timings.items()}, commit=commit,
            date=time.strftime("%Y-%m-%d"),
            machine=f"{_cpu()}, {os.cpu_count()} cores, torch {torch.__version__}, "
                    f"torchvision {torchvision.__version__}, onnxruntime {version('onnxruntime')}, "
                    f"weights {a.weights}"))


if __name__ == "__main__":
    main()
