"""``onnxmedic optimize IN.onnx MODEL --input SPEC ...`` and the ``export --optimize`` flags."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from onnxmedic.isa import target_arg
from onnxmedic.optimize.passes import calibration_error


def add_export_flags(e: argparse.ArgumentParser) -> None:
    """``--optimize`` and ``--precision`` on ``onnxmedic export``."""
    e.add_argument("--optimize", action="store_true",
                   help="write the fastest variant that still verifies (onnxmedic optimize; "
                   "a text-generation-with-past package: its decoder fused, docs/generation.md)")
    e.add_argument("--precision", choices=["fp32", "fp16", "int8", "int4"], default="fp32",
                   help="with --optimize: float32 passes only, or also int8 (CPU) or float16 "
                   "(GPU targets; float32 I/O, measured block list); int4 (hf: decoders, "
                   "text-generation-with-past): the package fused and quantized to 4-bit "
                   "weights, judged by the task budget (docs/int4.md), as the builder's -p int4")
    e.add_argument("--accuracy", metavar="cosine=X", help="with --optimize: the "
                   "reduced-precision budget (default cosine=0.999 per output); with "
                   "--precision int4: the task budget (perplexity=5%%,agreement=95%%)")
    e.add_argument("--cuda-graph", choices=["auto", "deploy", "off"], default="auto",
                   help="with --optimize --target cuda: as `onnxmedic optimize --cuda-graph`")
    e.add_argument("--calibration", metavar="SPEC", help="with --optimize --precision int8: "
                   "as `onnxmedic optimize --calibration`")


def calibration_flag_error(ns: argparse.Namespace) -> str:
    """Why ``--calibration`` cannot be used with these flags ("" when it can)."""
    if getattr(ns, "calibration", None) is None or (ns.precision == "int4"
                                                    and ns.command == "optimize"):
        return ""
    return calibration_error(ns.precision, ns.command != "export" or ns.optimize,
                             flags=True) or ""


def add_parser(sub: Any) -> None:
    """The ``optimize`` subcommand."""
    o = sub.add_parser("optimize", help="the fastest variant of an ONNX file that still "
                       "verifies against the PyTorch model, measured in the sandbox")
    o.add_argument("onnx", metavar="IN.onnx", help="an ONNX file, or a generation package "
                   "folder (fused, or int4 with --precision int4: docs/int4.md)")
    o.add_argument("model", metavar="MODEL")
    o.add_argument("--input", "-i", action="append", default=[], metavar="SPEC")
    o.add_argument("-o", "--output", metavar="OUT.onnx")
    o.add_argument("--precision", choices=["fp32", "fp16", "int8", "int4"], default="fp32",
                   help="int8: CPU; fp16: GPU targets (on cpu it is built, verified and "
                   "normally rejected as slower); int4: a decoder step (docs/int4.md)")
    o.add_argument("--accuracy", metavar="cosine=X", help="reduced-precision budget "
                   "(default cosine=0.999 per output; int4: perplexity=5%%,agreement=95%%,"
                   "steps=32,prompts=4, agreement teacher-forced; free=95%% also judges "
                   "free-running generation)")
    o.add_argument("--target", type=target_arg, default="cpu",
                   metavar="{cpu,cpu:ISA,cuda,tensorrt}",
                   help="time (and verify) the candidates with this target's execution "
                   "providers; GPU targets need onnxruntime-gpu and a GPU (else OM725). int8 "
                   "on cpu is portable across x86-64 CPUs; cpu:avx512-vnni, cpu:amx, "
                   "cpu:avx-vnni, cpu:arm64 or cpu:avx2 picks the int8 settings for that "
                   "instruction set (docs/optimize-isa.md)")
    o.add_argument("--threads", type=int, default=2, help="intra-op threads when timing")
    o.add_argument("--cuda-graph", choices=["auto", "deploy", "off"], default="auto",
                   help="--target cuda: auto - also try the chosen file as a CUDA graph (a "
                   "convolutional one in NHWC too) and recommend it (run settings) where "
                   "faster; deploy - compare every verified file as a CUDA graph and write the "
                   "fastest; off")
    o.add_argument("--calibration", metavar="SPEC", help="--precision int8: calibrate static "
                   "int8 on these input sets (real data) and make it a candidate whatever the "
                   "graph: a .pt holding a list of input sets, an .npz stacking them on a first "
                   "axis, or file.py:fn returning a list (default: on convolutional graphs, 8 "
                   "sets derived from --input); --precision int4: a text file (UTF-8) that "
                   "calibrates GPTQ candidates and whose held-out last quarter adds a "
                   "perplexity to the budget (docs/int4.md)")
    o.add_argument("--timeout", type=float, default=600.0, metavar="S")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--no-progress", action="store_true",
                   help="no live line on stderr (shown on a terminal by default)")
    o.add_argument("--json", action="store_true")


def _accuracy(v: Any) -> str:
    """A variant's accuracy in one cell: the worst cosine (reduced precision) or the largest
    absolute error (float32), over its outputs and input sets; "-" when it was not judged."""
    if not v.accuracy:
        return "-"
    if v.precision != "fp32":
        return f"cos {v.worst_cosine():.5f}"
    return f"max abs {max(m.get('max_abs', 0.0) for m in v.accuracy.values()):.2g}"


STAGES = {"references": "PyTorch's reference outputs", "candidates": "building and verifying",
          "timing": "timing"}


def took(res: Any) -> str:
    """Where optimize's time went, in one line (res.seconds, res.sandbox)."""
    parts = [f"{STAGES.get(k, k)} {v:.1f} s" for k, v in res.seconds.items()]
    sbx = res.sandbox
    runs, kids = sbx.get("runs", 0), sbx.get("children", 0)
    return (f"took {sum(res.seconds.values()):.1f} s: " + ", ".join(parts)
            + (f"; {runs} sandbox runs in {kids} child process{'es' if kids != 1 else ''} "
               f"({sbx.get('wall_seconds', 0):.1f} s: importing ONNX Runtime "
               f"{sbx.get('import_seconds', 0):.1f} s, creating sessions "
               f"{sbx.get('load_seconds', 0):.1f} s)" if runs else ""))


def main(ns: argparse.Namespace) -> int:
    """Run ``onnxmedic optimize``; print the variant table (or JSON). Exit 0, or 1 for a model
    or input problem (a finding, no traceback)."""
    from onnxmedic.findings import refuse
    from onnxmedic.onnxfile import check_output_path, load_onnx, package_output_problem
    from onnxmedic.optimize.passes import precision_error
    from onnxmedic.report.live import live_line

    bad = precision_error(ns.precision, ns.target, flags=True) or calibration_flag_error(ns)
    if bad:
        sys.stderr.write(f"onnxmedic optimize: error: {bad}\n")
        return 2
    folder = Path(ns.onnx).is_dir()  # a generation package folder (docs/int4.md)
    if not folder and (unreadable := load_onnx(ns.onnx, stage="load")[1]) is not None:
        return refuse(unreadable)  # before the PyTorch model is loaded
    if (ns.output and not (folder and Path(ns.output).is_dir())  # a folder is replaced
            and (unwritable := check_output_path(ns.output)) is not None):
        return refuse(unwritable)
    if folder and ns.output and (bad := package_output_problem(ns.output, "load")) is not None:
        return refuse(bad)  # a package replaces the whole folder: never the user's files
    with live_line(f"optimize {ns.onnx} ({ns.precision}, {ns.target})",
                   enabled=not ns.no_progress and sys.stderr.isatty()):
        if folder:
            from onnxmedic.hf.transforms.package_cli import cli_package

            return cli_package(ns)
        if ns.precision == "int4":
            from onnxmedic.optimize.int4_search import cli_main

            return cli_main(ns)
        return _optimize_file(ns)


def _optimize_file(ns: argparse.Namespace) -> int:
    """``onnxmedic optimize IN.onnx MODEL`` at fp32, fp16 or int8: the variant table."""
    from onnxmedic import inputs
    from onnxmedic.findings import OnnxMedicError, print_findings, refuse
    from onnxmedic.optimize import (
        block_list_findings,
        optimization_finding,
        optimize,
        target_findings,
    )

    try:
        model, _ = inputs.load_model(ns.model)
        ex = inputs.load_inputs(ns.input, seed=ns.seed)
        cal = None if ns.calibration is None else inputs.load_calibration(ns.calibration)
        res = optimize(ns.onnx, model, ex.args, kwargs=ex.kwargs, out=ns.output,
                       target=ns.target, precision=ns.precision, accuracy=ns.accuracy,
                       timeout=ns.timeout, threads=ns.threads, cuda_graph=ns.cuda_graph,
                       calibration=cal)
    except OnnxMedicError as err:
        return refuse(err.finding)
    if ns.json:
        sys.stdout.write(json.dumps(res.to_dict(), indent=2, default=str) + "\n")
        return 0
    f = optimization_finding(res)
    print(f"{f.code} {res.message}")
    print(f"float32 variants judged by the export's rule, reduced precision by cosine >= "
          f"{res.cosine:g} per output (worst over the input sets; --accuracy)")
    if res.calibration:
        print(f"static int8 calibrated on {res.calibration} (--calibration); verified, like "
              "every variant, on the export's input sets")
    print(f"{'variant':24} {'prec':5} {'verified':8} {'median ms':>10} {'p90 ms':>8} "
          f"{'speed-up':>8} {'accuracy':>16}  fusions / why rejected")
    for v in res.variants:
        med = f"{v.median_ms:.2f}" if v.median_ms is not None else "-"
        p90 = f"{v.p90_ms:.2f}" if v.p90_ms is not None else "-"
        sp = f"{v.speedup:.2f}x" if v.speedup else "-"
        fus = ",".join(f"{k}={n}" for k, n in v.fusions.items())
        print(f"{v.name:24} {v.precision:5} {'yes' if v.verified else 'no':8} {med:>10} "
              f"{p90:>8} {sp:>8} {_accuracy(v):>16}  {fus} {v.rejected}".rstrip())
    print_findings(target_findings(res) + block_list_findings(res))
    if res.seconds:
        print(took(res))
    if res.written:
        print(f"written: {res.written} ({res.chosen})")
    for key, val in res.run_settings.items():
        print(f"run setting {key}: {json.dumps(val) if not isinstance(val, str) else val}")
    return 0


def add_bench_parser(sub: Any) -> None:
    """The ``bench`` subcommand."""
    b = sub.add_parser("bench", help="latency, load time, peak memory and node placement of "
                       "an ONNX file in a child ONNX Runtime")
    b.add_argument("onnx", metavar="MODEL.onnx")
    b.add_argument("--input", "-i", action="append", default=[], metavar="SPEC")
    b.add_argument("--target", choices=["cpu", "cuda", "tensorrt"], default="cpu")
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--repeats", type=int, default=20)
    b.add_argument("--cuda-graph", choices=["auto", "on", "off"], default="auto",
                   help="--target cuda: also time the file as a CUDA graph - on, off, or auto: "
                   "when the file's run settings (written by optimize) say so")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", action="store_true")


def bench_main(ns: argparse.Namespace) -> int:
    """Run ``onnxmedic bench``: inputs map onto the ONNX inputs in order, checked against
    the file's input contract (OM008) before anything is timed."""
    from onnxmedic import inputs
    from onnxmedic.findings import OnnxMedicError, Severity, refuse
    from onnxmedic.onnxfile import check_feeds, graph_io, load_onnx, make_feeds
    from onnxmedic.optimize import bench

    graph = {"auto": None, "on": True, "off": False}[ns.cuda_graph]
    if graph and ns.target != "cuda":
        sys.stderr.write("onnxmedic bench: error: --cuda-graph on is for --target cuda\n")
        return 2
    proto, unreadable = load_onnx(ns.onnx, stage="load")
    if unreadable is not None:
        return refuse(unreadable)
    try:
        ex = inputs.load_inputs(ns.input, seed=ns.seed)
        feeds, found = check_feeds(proto, make_feeds(graph_io(proto)[0], ex.args, ex.kwargs))
    except OnnxMedicError as err:
        return refuse(err.finding)
    if bad := [f for f in found if f.severity == Severity.ERROR]:
        return max(refuse(f) for f in bad)
    del proto
    res = bench(ns.onnx, feeds, target=ns.target, threads=ns.threads, repeats=ns.repeats,
                cuda_graph=graph)
    if ns.json:
        sys.stdout.write(json.dumps(res.to_dict(), indent=2, default=str) + "\n")
    elif not res.ok:
        print(f"bench failed: {res.error}")
    else:
        print(f"median {res.median_ms:.3f} ms, p90 {res.p90_ms:.3f} ms ({res.threads} threads, "
              f"inputs and outputs bound on {res.bound_on}), "
              f"load {res.load_seconds:.3f} s, peak memory {res.peak_rss_mb:.0f} MiB")
        if res.graph_median_ms is not None:
            print(f"as a CUDA graph: median {res.graph_median_ms:.3f} ms, p90 "
                  f"{res.graph_p90_ms:.3f} ms")
        for prov, nodes in res.placement.items():
            print(f"  {prov}: {len(nodes)} node(s)")
        for f in res.findings:
            print(f.one_paragraph())
    return 0 if res.ok else 1
