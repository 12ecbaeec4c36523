"""`export --optimize` over a zoo: does every candidate pipeline survive models nobody here wrote?

For every entry of a zoo (default: bench/zoo/ecosystem.py:ZOO, the PyTorch ecosystem beyond
transformers), in its own worker process with a timeout (zoo_bench.py's isolation), and for each
``--precision``: ``onnxmedic.export(..., optimize=True, precision=P)`` (fp16 with
``--target cuda``: on a machine without a GPU its candidates are built and verified on the CPU,
not timed). One row per entry and precision: whether it exported, the variant written and its
speed-up, how many candidates verified, and why the others were rejected - ONNX Runtime refused
the file, it failed verification, it was outside the accuracy budget, its pass crashed or hung.
A worker that dies or an exception out of ``export`` is a defect of onnxmedic ("crashed"): the
contract is that a failing pass is a rejected variant, never a failed export.

    python bench/optimize/optimize_zoo.py --jobs 2 --results build/optimize_zoo.json
    python bench/optimize/optimize_zoo.py --precision fp16 --only kornia/canny,monai/unet

Timings are onnxmedic's own (sandboxed, paired rounds); with ``--jobs 2`` on a 2-core machine
two workers share the cores, so speed-ups are indicative and the noise rule decides more often
for the plain file. Results are written after each entry; --resume skips those already there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench" / "peers"))

from zoo_bench import (  # noqa: E402 - the same worker isolation as the zoo benchmark
    _run_child,
    child_record,
    prior_results,
    zoo_flags,
)

# a rejected variant's reason -> its kind in the table (the rest: slower, changed nothing)
KINDS = (("ONNX Runtime refused", "refused"), ("failed verification", "wrong"),
         ("outside the accuracy budget", "budget"), ("the pass failed", "pass failed"))


def one(zoo: str, name: str, precision: str, threads: int) -> dict[str, Any]:
    """export(optimize=True) of one entry at one precision, in this (worker) process."""
    import logging

    import torch

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(threads)
    import onnxmedic
    from onnxmedic.sweep import as_case, import_source, load_zoo

    entry = next(e for e in load_zoo(zoo) if e.name == name)
    case = as_case(getattr(import_source(entry.source), entry.attr)[name](), name)
    rec: dict[str, Any] = {"name": name, "precision": precision}
    with tempfile.TemporaryDirectory() as td:
        t0 = time.perf_counter()
        res = onnxmedic.export(case.model, case.args, f"{td}/m.onnx", kwargs=case.kwargs,
                               dynamic_shapes=case.dynamic_shapes, optimize=True,
                               precision=precision, tolerance=case.tolerance,
                               target="cuda" if precision == "fp16" else "cpu")
        rec["seconds"] = time.perf_counter() - t0
    rec["ok"] = bool(res.ok)
    rec["errors"] = [f"{f.code}: {f.message[:200]}" for f in res.findings
                     if f.severity == "error"][:3]
    opt = res.optimization
    if opt is not None:
        rec.update(chosen=opt.chosen, message=opt.message, variants=[
            {"name": v.name, "verified": v.verified, "speedup": v.speedup,
             "rejected": v.rejected[:400], "cosine": v.worst_cosine(),
             "blocked": len(v.blocked), "saturated": len(v.saturated),
             "saturation_rejected": v.saturation_rejected[:300]} for v in opt.variants])
    return rec


def _kinds(variants: list[dict[str, Any]]) -> Counter[str]:
    out: Counter[str] = Counter()
    for v in variants[1:]:
        kind = next((k for prefix, k in KINDS if v["rejected"].startswith(prefix)), None)
        if kind:
            out[kind] += 1
        if kind == "refused" and "standing in for" in v["rejected"]:
            out["stand-in"] += 1  # the CPU provider standing in for a missing target's
    return out


def table(recs: list[dict[str, Any]]) -> str:
    lines = ["| model | precision | exported | written | speed-up | verified / built | "
             "rejected: refused, wrong, budget, pass failed | first such reason |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(recs, key=lambda r: (r["name"], r["precision"])):
        if "crashed" in r:
            lines.append(f"| {r['name']} | {r['precision']} | CRASHED | | | | | "
                         f"{r['crashed'][:160].replace('|', '/')} |")
            continue
        vs = r.get("variants") or []
        chosen = next((v for v in vs if v["name"] == r.get("chosen")), None)
        k = _kinds(vs)
        why = next((v["rejected"] for v in vs[1:] if any(
            v["rejected"].startswith(p) for p, _ in KINDS)), "")
        speed = chosen["speedup"] if chosen and chosen["speedup"] else None
        lines.append(
            f"| {r['name']} | {r['precision']} | {'✔' if r['ok'] else '✘'} | "
            f"{r.get('chosen', '') if vs else (r['errors'] or [''])[0][:60]} | "
            f"{f'{speed:.2f}x' if speed and r.get('chosen') != 'plain' else ''} | "
            f"{sum(v['verified'] for v in vs[1:])} / {max(len(vs) - 1, 0)} | "
            f"{k['refused']}, {k['wrong']}, {k['budget']}, {k['pass failed']} | "
            f"{why[:140].replace('|', '/')} |")
    lines += ["", *summary(recs)]
    return "\n".join(lines)


def summary(recs: list[dict[str, Any]]) -> list[str]:
    out = []
    for prec in sorted({r["precision"] for r in recs}):
        rs = [r for r in recs if r["precision"] == prec]
        crashed = [r["name"] for r in rs if "crashed" in r]
        opt = [r for r in rs if r.get("variants")]
        faster = [next(v["speedup"] for v in r["variants"] if v["name"] == r["chosen"])
                  for r in opt if r["chosen"] != "plain"]
        kinds = sum((_kinds(r["variants"]) for r in opt), Counter())
        built = sum(len(r["variants"]) - 1 for r in opt)
        out.append(
            f"- {prec}: {len(rs)} entries; onnxmedic crashed on {len(crashed)}"
            f"{' (' + ', '.join(crashed) + ')' if crashed else ''}; exported and optimized "
            f"{len(opt)}; a faster verified variant written for {len(faster)}"
            + (f" (median {statistics.median(faster):.2f}x, max {max(faster):.2f}x)"
               if faster else "")
            + f"; of {built} candidates: {kinds['refused']} refused by ONNX Runtime"
            + (f" ({kinds['stand-in']} of them by the CPU provider standing in for the "
               "target's)" if kinds["stand-in"] else "") + ", "
            f"{kinds['wrong']} failed verification, {kinds['budget']} outside the accuracy "
            f"budget, {kinds['pass failed']} passes crashed or hung - each a rejected variant")
        out += _fp16_summary(opt) if prec == "fp16" else []
    return out


def _fp16_summary(recs: list[dict[str, Any]]) -> list[str]:
    """The float16 block list over the zoo: variants that kept nodes in float32, and those
    whose mask fill values saturated in float16 instead (OM727) or were tried and rejected."""
    vs = [v for r in recs for v in r["variants"]
          if v.get("blocked") or v.get("saturated") or v.get("saturation_rejected")]
    if not vs:
        return []
    sat = [v for v in vs if v["saturated"]]
    rej = [v for v in vs if v["saturation_rejected"]]
    entries = sum(any(v.get("saturated") for v in r["variants"]) for r in recs)
    return [f"  - float16 block lists: {sum(1 for v in vs if v['blocked'])} variants kept "
            f"nodes in float32 ({sum(v['blocked'] for v in vs)} nodes); {len(sat)} variants "
            f"left {sum(v['saturated'] for v in sat)} values with mask fill values in float16 "
            f"instead (saturated, verified: OM727) in {entries} entries; "
            f"{len(rej)} tried that and kept the nodes float32 after all"
            + (f" (first: {rej[0]['saturation_rejected'][:160]})" if rej else "")]


def main() -> int:
    ap = zoo_flags(__doc__, "ecosystem.py:ZOO", "optimize_zoo.json", 1200)
    ap.add_argument("--precision", default="int8,fp16", help="comma-separated: fp32,fp16,int8")
    ap.add_argument("--one-precision", default="fp32", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.one:
        return child_record(ns.out, lambda: one(ns.zoo, ns.one, ns.one_precision, ns.threads),
                            {"name": ns.one, "precision": ns.one_precision})
    from onnxmedic.report.files import atomic_write_text
    from onnxmedic.sweep import load_zoo

    results, recs = prior_results(ns.results, ns.resume or ns.table)
    if ns.table:
        print(table(recs))
        return 0
    done = {(r["name"], r["precision"]) for r in recs}
    jobs = [(e.name, p) for p in ns.precision.split(",") for e in load_zoo(ns.zoo)
            if (e.name, p) not in done and (not ns.only or e.name in ns.only.split(","))]
    threads = max(1, (os.cpu_count() or 1) // ns.jobs)

    def run(name: str, prec: str) -> dict[str, Any]:
        r = _run_child(ns.zoo, name, ns.timeout, threads, __file__,
                       ("--one-precision", prec))
        r.setdefault("precision", prec)
        return r

    with ThreadPoolExecutor(ns.jobs) as pool:
        for fut in as_completed([pool.submit(run, n, p) for n, p in jobs]):
            r = fut.result()
            recs.append(r)
            atomic_write_text(results, json.dumps(recs, indent=1, default=str))
            print(f"{r['name']} {r['precision']}: "
                  f"{r.get('crashed') or r.get('message') or r.get('errors')}"[:200], flush=True)
    print(table(recs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
