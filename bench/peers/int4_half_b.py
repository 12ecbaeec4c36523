"""Decoder speed at ~0.5 B: onnxmedic's generation packages (plain, fused, int4) against
onnxruntime-genai's model builder (``-p fp32`` / ``-p int4``, ``-e cpu``), same checkpoint.

    flock /work/coord/big.lock python bench/peers/int4_half_b.py --build    # packages, cached
    flock /work/coord/big.lock python bench/peers/int4_half_b.py --measure  # the table

The checkpoint is bench/zoo/generation.py's ``save_half_b`` (Qwen2.5-0.5B's shape, float32,
random weights; ``--checkpoint``). Packages, cached under ``build/half_b``:

- ``om_fp32``: ``onnxmedic export hf:CKPT --task text-generation-with-past`` (``--plain``
  points at an existing one);
- ``om_fused``: hf/transforms/fuse_decoder.py's ``fuse_graph`` of it (onnxscript's ORT fusions);
- ``om_int4`` / ``om_fused_int4``: optimize/int4.py's ``quantize_int4`` of the plain / fused
  graph at the builder's cell (block 32, accuracy_level 4, LM head 4-bit; the tied embedding
  reads the 4-bit head, optimize/int4_embed.py); ``om_fused_int4_b128``: block 128, the cell
  the int4 search chooses on the trained decoders (bench/peers/int4.py). Random weights make the task
  budget meaningless (near-uniform logits), so the accuracy side of int4 is
  bench/peers/int4.py's trained decoder;
- ``genai_fp32`` / ``genai_int4``: the builder.

Each package is measured in its own child process, 2 intra-op threads: in plain ONNX Runtime
(decode: one token after a past of 128, median of 20; prefill: 128 tokens from an empty past,
median of 3) and in onnxruntime-genai (prefill: ``append_tokens`` of 128 tokens; decode: the
next 32 tokens, tokens/s), the child's peak RSS (VmHWM from the session's creation on) and the
files' size. Results: bench/results/int4_half_b.md (+ .json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "half_b"
RESULTS = ROOT / "bench" / "results"
CKPT = Path("/work/coord/models/qwen2-0.5b")
PACKAGES = ("om_fused", "genai_fp32", "om_fused_int4", "genai_int4", "om_fused_int4_b128",
            "om_fp32", "om_int4")
PAST, PREFILL, DECODE = 128, 128, 32


def build(ckpt: Path, plain: Path | None) -> None:
    """The onnxmedic packages (the builder's are made by bench/peers/int4.py's build_genai or
    by hand: python -m onnxruntime_genai.models.builder -i CKPT -o build/half_b/genai_P -p P
    -e cpu)."""
    sys.path.insert(0, str(ROOT / "src"))
    from onnxmedic.genpackage import context_length
    from onnxmedic.hf.transforms.fuse_decoder import fuse_graph, share_buffer
    from onnxmedic.hf.transforms.int4_package import save_external
    from onnxmedic.optimize.int4 import quantize_int4

    BUILD.mkdir(parents=True, exist_ok=True)
    om = BUILD / "om_fp32"
    if plain is not None and not (om / "model.onnx").exists():
        shutil.copytree(plain, om)
    if not (om / "model.onnx").exists():
        subprocess.run([sys.executable, "-m", "onnxmedic", "export", f"hf:{ckpt}", "--task",
                        "text-generation-with-past", "-o", str(om), "--no-progress"],
                       check=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    for p in ("genai_fp32", "genai_int4"):
        if not (BUILD / p / "model.onnx").exists():
            subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i",
                            str(ckpt), "-o", str(BUILD / p), "-p", p.split("_")[1], "-e", "cpu",
                            "-c", str(BUILD / "genai_cache")], check=True)
    def fuse(s: str, d: str) -> None:
        print(fuse_graph(s, d, max_positions=context_length(om) or 4096))
        share_buffer(Path(d).parent)

    steps = [("om_fused", om, fuse),
             ("om_int4", om, lambda s, d: print(quantize_int4(s, d, 32, 4, "int4"))),
             ("om_fused_int4", BUILD / "om_fused",
              lambda s, d: print(quantize_int4(s, d, 32, 4, "int4"))),
             ("om_fused_int4_b128", BUILD / "om_fused",
              lambda s, d: print(quantize_int4(s, d, 128, 4, "int4")))]
    for name, src, fn in steps:
        dst = BUILD / name
        if (dst / "model.onnx").exists():
            continue
        tmp = BUILD / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for p in src.iterdir():
            if p.is_file() and not p.name.startswith("model.onnx"):
                shutil.copy2(p, tmp / p.name)
        t = time.perf_counter()
        fn(str(src / "model.onnx"), str(tmp / "model.onnx"))
        if "int4" in name:  # as int4_package writes it (the weights in model.onnx.data)
            save_external(tmp / "model.onnx")
        print(f"{name}: {time.perf_counter() - t:.0f} s", flush=True)
        os.replace(tmp, dst)


def accuracy(trained: Path) -> dict[str, Any]:
    """The accuracy side on a trained decoder (bench/accuracy/train_decoder.py's folder):
    its package exported, fused and taken to int4 through ``onnxmedic optimize PACKAGE
    --precision int4``'s functions with the default task budget; the int4 search's figures."""
    sys.path.insert(0, str(ROOT / "src"))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from onnxmedic.hf import export_generation
    from onnxmedic.hf.transforms.fuse_decoder import fuse_package
    from onnxmedic.hf.transforms.int4_package import int4_package

    model = AutoModelForCausalLM.from_pretrained(trained).eval()
    tok = AutoTokenizer.from_pretrained(trained)
    work = BUILD / "trained"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t = time.perf_counter()
    plain = export_generation(model, work / "pkg", tokenizer=tok)
    fused = fuse_package(work / "pkg", work / "fused", model, tok)
    t1 = time.perf_counter()
    q = int4_package(work / "fused" if fused.ok else work / "pkg", work / "int4", model, tok)
    out = {"export_ok": plain.ok, "fused_ok": fused.ok, "fused_ops": fused.ops,
           "int4_ok": q.ok, "int4_seconds": time.perf_counter() - t1,
           "seconds": time.perf_counter() - t, "tokens_genai_match": q.tokens_genai == q.tokens_onnx,
           "search": q.search.to_dict() if q.search is not None else None,
           "parameters": sum(p.numel() for p in model.parameters()),
           "folder": str(trained)}
    (BUILD / "accuracy.json").write_text(json.dumps(out, indent=1, default=str))
    return out


def _hwm_mib() -> float:
    return next(int(ln.split()[1]) for ln in Path("/proc/self/status").read_text().splitlines()
                if ln.startswith("VmHWM")) / 1024


def _median_ms(fn: Any, n: int) -> float:
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def child_ort(folder: str) -> dict[str, Any]:
    """Plain ONNX Runtime: decode and prefill tokens/s, peak RSS."""
    import onnxruntime as ort

    sys.path.insert(0, str(ROOT / "src"))
    from onnxmedic.genpackage import read_package  # numpy and onnx only at import

    Path("/proc/self/clear_refs").write_text("5")
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.log_severity_level = 3
    t = time.perf_counter()
    sess = ort.InferenceSession(str(Path(folder) / "model.onnx"), so,
                                providers=["CPUExecutionProvider"])
    load_s = time.perf_counter() - t
    layout = read_package(folder)  # the builder's head sizes are named: its configs say them
    rng = np.random.default_rng(0)
    empty = layout.empty_past()
    past = [rng.standard_normal((1, e.shape[1], PAST, e.shape[3])).astype(e.dtype)
            for e in empty]
    dec = layout.feed(np.asarray([[5]], np.int64), past)
    pre = layout.feed(rng.integers(4, 300, (1, PREFILL)).astype(np.int64), empty)
    decode = _median_ms(lambda: sess.run(None, dec), 20)
    prefill = _median_ms(lambda: sess.run(None, pre), 3)
    return {"decode_tok_s": 1000 / decode, "prefill_tok_s": PREFILL * 1000 / prefill,
            "peak_rss_mib": _hwm_mib(), "load_s": load_s}


def child_profile(folder: str) -> dict[str, Any]:
    """ONNX Runtime's profiler over 10 decode steps (past 128): the share of kernel time per
    op type, largest first."""
    import onnxruntime as ort

    sys.path.insert(0, str(ROOT / "src"))
    from onnxmedic.genpackage import read_package

    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.log_severity_level = 3
    so.enable_profiling = True
    so.profile_file_prefix = str(BUILD / f"profile_{Path(folder).name}")
    sess = ort.InferenceSession(str(Path(folder) / "model.onnx"), so,
                                providers=["CPUExecutionProvider"])
    layout = read_package(folder)
    rng = np.random.default_rng(0)
    past = [rng.standard_normal((1, e.shape[1], PAST, e.shape[3])).astype(e.dtype)
            for e in layout.empty_past()]
    feeds = layout.feed(np.asarray([[5]], np.int64), past)
    for _ in range(10):
        sess.run(None, feeds)
    trace = json.loads(Path(sess.end_profiling()).read_text())
    per: dict[str, float] = {}
    for ev in trace:
        if ev.get("cat") == "Node" and ev["name"].endswith("_kernel_time"):
            op = ev.get("args", {}).get("op_name", "?")
            per[op] = per.get(op, 0.0) + ev["dur"] / 10 / 1000
    total = sum(per.values())
    return {"step_ms": total, "ops_ms": dict(sorted(per.items(), key=lambda kv: -kv[1])[:8])}


def child_genai(folder: str) -> dict[str, Any]:
    """onnxruntime-genai: prefill of 128 tokens, then 32 greedy tokens; tokens/s, peak RSS."""
    import onnxruntime_genai as og

    Path("/proc/self/clear_refs").write_text("5")
    cfg_path = Path(folder) / "genai_config.json"
    cfg = json.loads(cfg_path.read_text())
    threads = {"intra_op_num_threads": 2}
    if cfg["model"]["decoder"]["session_options"].get("intra_op_num_threads") != 2:
        raise SystemExit("set intra_op_num_threads=2 in the measured copy first")
    model = og.Model(folder)
    ids = np.random.default_rng(0).integers(4, 300, PREFILL).tolist()
    runs = []
    for _ in range(2):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=PREFILL + DECODE + 1, do_sample=False)
        gen = og.Generator(model, params)
        t = time.perf_counter()
        gen.append_tokens(ids)
        t1 = time.perf_counter()
        n = 0
        while not gen.is_done() and n < DECODE:
            gen.generate_next_token()
            n += 1
        t2 = time.perf_counter()
        runs.append((PREFILL / (t1 - t), n / (t2 - t1)))
        del gen
    return {"prefill_tok_s": runs[-1][0], "decode_tok_s": runs[-1][1],
            "peak_rss_mib": _hwm_mib(), "threads": threads}


def _genai_copy(folder: Path) -> Path:
    """A copy of ``folder``'s genai_config.json with 2 intra-op threads (the model files
    linked), for a like-for-like thread count."""
    dst = BUILD / "measure" / folder.name
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for p in folder.iterdir():
        if p.is_file() and p.name != "genai_config.json":
            os.symlink(p.resolve(), dst / p.name)
    cfg = json.loads((folder / "genai_config.json").read_text())
    cfg["model"]["decoder"]["session_options"]["intra_op_num_threads"] = 2
    (dst / "genai_config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def size_mib(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.iterdir()
               if p.name.startswith("model.onnx")) / 2**20


def _child(name: str, kind: str) -> dict[str, Any]:
    folder = BUILD / name
    target = str(_genai_copy(folder) if kind == "genai" else folder)
    proc = subprocess.run([sys.executable, __file__, f"--child-{kind}", target],
                          capture_output=True, text=True, timeout=900)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": proc.stderr.strip()[-300:]}


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    out = {k: statistics.median(r[k] for r in ok) for k in ok[0]
           if isinstance(ok[0][k], (int, float))}
    out["runs"] = len(ok)
    out["decode_tok_s_each"] = [round(r["decode_tok_s"], 1) for r in ok]  # round by round
    return out


def measure(only: list[str], rounds: int = 1) -> dict[str, Any]:
    """Every package in a child per runtime, ``rounds`` times with the packages alternating
    (ours, the builder's, ...) in each round; each figure the median over the rounds."""
    path = BUILD / "results.json"
    rows = json.loads(path.read_text()) if path.exists() else {}
    names = [n for n in (only or PACKAGES) if (BUILD / n / "model.onnx").exists()]
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in range(rounds):
        for name in names:
            for kind in ("ort", "genai"):
                runs.setdefault((name, kind), []).append(_child(name, kind))
                print(r, name, kind, runs[name, kind][-1], flush=True)
    for name in names:
        rows[name] = {"size_mib": size_mib(BUILD / name),
                      **{kind: _medians(runs[name, kind]) for kind in ("ort", "genai")}}
    path.write_text(json.dumps(rows, indent=1))
    return rows


def write(rows: dict[str, Any], cmd: str) -> None:
    """bench/results/int4_half_b.md (+ .json)."""
    cpu = next((ln.split(":", 1)[1].strip() for ln in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines()
        if ln.startswith("Model name")), platform.processor())
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "int4_half_b.json").write_text(json.dumps(rows, indent=1))
    n = max((r.get("ort", {}).get("runs", 1) for r in rows.values()), default=1)
    lines = [f"`{cmd}` - {datetime.date.today()} - {cpu}, {os.cpu_count()} cores, 2 intra-op "
             f"threads; Qwen2.5-0.5B shape (random weights, float32 checkpoint); decode after a "
             f"past of {PAST} (ORT) / after a {PREFILL}-token prompt (genai); medians of {n} "
             "rounds, packages alternating", "",
             "| package | size MiB | ORT decode tok/s | ORT prefill-128 tok/s | ORT peak RSS MiB "
             "| genai decode tok/s | genai prefill-128 tok/s | genai peak RSS MiB |",
             "|---|---|---|---|---|---|---|---|"]

    def cell(r: dict[str, Any], key: str) -> str:
        if key in r:
            return f"{r[key]:.1f}" if "decode" in key else f"{r[key]:.0f}"
        return "not measured" if "error" in r else "-"

    for name, r in rows.items():
        o, g = r.get("ort", {}), r.get("genai", {})
        lines.append(f"| {name} | {r['size_mib']:.0f} | {cell(o, 'decode_tok_s')} | "
                     f"{cell(o, 'prefill_tok_s')} | {cell(o, 'peak_rss_mib')} | "
                     f"{cell(g, 'decode_tok_s')} | {cell(g, 'prefill_tok_s')} | "
                     f"{cell(g, 'peak_rss_mib')} |")
    acc = BUILD / "accuracy.json"
    if acc.exists():
        lines += _accuracy_lines(json.loads(acc.read_text()))
    tied = RESULTS / "int4_peers_figures-tied.json"
    if tied.exists():
        lines += _tied_lines(json.loads(tied.read_text()))
    (RESULTS / "int4_half_b.md").write_text("\n".join(lines) + "\n")


def _tied_lines(t: dict[str, Any]) -> list[str]:
    """The accuracy side with the embedding tied to the head, as Qwen2.5's: bench/peers/int4.py
    --preset figures-tied's figures of ours and the builder's files."""
    lines = ["", "`python bench/peers/int4.py --preset figures-tied` - the accuracy side, "
             f"embedding tied to the LM head: train_decoder.py's figures-tied preset "
             f"({t['parameters'] / 1e6:.1f} M parameters, trained), PyTorch float32 perplexity "
             f"{t['reference_perplexity']:.4g}; decoder step files, ONNX Runtime (bench/results/"
             "int4_peers_figures-tied.md)", "",
             "| file | decode tok/s | prefill-128 tok/s | peak RSS MiB | size MiB | perplexity "
             "delta | greedy agreement (own) | within budget |", "|---|---|---|---|---|---|---|---|"]
    for name, r in t["rows"].items():
        if "error" in r:
            lines.append(f"| {name} | {r['error']} |||||||")
            continue
        lines.append(f"| {name} | {r['decode_tokens_s']:.0f} | {r['prefill_tokens_s']:.0f} | "
                     f"{r['peak_rss_mib']:.0f} | {r['size_mib']:.2f} | "
                     f"{r['perplexity_delta_pct']:+.2f} % | {r['agreement_pct']:.1f} % "
                     f"({r['free_agreement_pct']:.1f} %) | {'yes' if r['within_budget'] else 'no'} |")
    return lines


def _accuracy_lines(a: dict[str, Any]) -> list[str]:
    """The trained decoder's int4 search (``--accuracy``): each candidate's figures."""
    s = a["search"] or {"candidates": []}
    folder = a.get("folder", "build/trained")
    lines = ["", f"`python bench/peers/int4_half_b.py --accuracy {folder}` - the accuracy "
             f"side: bench/accuracy/train_decoder.py's {Path(folder).name.rsplit('-', 1)[0]} "
             f"preset ({a['parameters'] / 1e6:.1f}"
             f" M parameters, trained); package fused: {a['fused_ok']} ({a['fused_ops']}); int4 "
             f"package written: {a['int4_ok']} (onnxruntime-genai's tokens = ONNX Runtime's: "
             f"{a['tokens_genai_match']}); chosen: {s.get('chosen')}; PyTorch float32 "
             f"perplexity {s.get('reference_perplexity', float('nan')):.4g}", ""]
    return lines + candidate_table(s["candidates"])


def candidate_table(candidates: list[dict[str, Any]]) -> list[str]:
    """The int4 search's candidates (int4_search.Int4Result.to_dict()'s), one row each."""
    lines = ["| candidate | perplexity delta | greedy agreement (own) | decode ms | MiB | "
             "rejected |", "|---|---|---|---|---|---|"]
    for c in candidates:
        if c.get("perplexity") is None:
            lines.append(f"| {c['name']} | - | - | - | - | {c['rejected'][:80]} |")
            continue
        ms = f"{c['decode_ms']:.3f}" if c.get("decode_ms") is not None else "-"
        lines.append(f"| {c['name']} | {(c['perplexity_ratio'] - 1) * 100:+.2f} % | "
                     f"{c['agreement'] * 100:.1f} % ({c['free_agreement'] * 100:.1f} %) | {ms} | "
                     f"{(c.get('size_bytes') or 0) / 2**20:.2f} | {c['rejected'][:80]} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", action="store_true")
    ap.add_argument("--measure", action="store_true")
    ap.add_argument("--only", nargs="*", default=[])
    ap.add_argument("--rounds", type=int, default=3, help="measure rounds (packages "
                    "alternating in each; medians)")
    ap.add_argument("--write", action="store_true", help="rewrite the table from the cached "
                    "measurements")
    ap.add_argument("--accuracy", type=Path, metavar="TRAINED",
                    help="the accuracy side on a trained decoder folder (train_decoder.py)")
    ap.add_argument("--checkpoint", type=Path, default=CKPT)
    ap.add_argument("--plain", type=Path, help="an existing onnxmedic package of the checkpoint")
    ap.add_argument("--child-ort", help=argparse.SUPPRESS)
    ap.add_argument("--child-genai", help=argparse.SUPPRESS)
    ap.add_argument("--profile", metavar="PACKAGE", help="ONNX Runtime's per-op time of one "
                    "package's decode step")
    ns = ap.parse_args()
    if ns.child_ort or ns.child_genai:
        out = child_ort(ns.child_ort) if ns.child_ort else child_genai(ns.child_genai)
        print(json.dumps(out))
        return
    if ns.profile:
        print(json.dumps(child_profile(str(BUILD / ns.profile)), indent=1))
    if ns.accuracy:
        print(json.dumps(accuracy(ns.accuracy), indent=1, default=str)[:3000])
    if ns.build:
        build(ns.checkpoint, ns.plain)
    cmd_file = BUILD / "measure_command.txt"  # the command that measured results.json
    if ns.write:
        write(json.loads((BUILD / "results.json").read_text()),
              cmd_file.read_text().strip() if cmd_file.exists()
              else "python bench/peers/int4_half_b.py --measure")
    if ns.measure:
        rows = measure(ns.only, ns.rounds)
        cmd = ("python bench/peers/int4_half_b.py --measure"
               + (f" --only {' '.join(ns.only)}" if ns.only else ""))
        cmd_file.write_text(cmd + "\n")
        write(rows, cmd)
        print((RESULTS / "int4_half_b.md").read_text())


if __name__ == "__main__":
    main()
