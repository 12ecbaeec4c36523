"""A 0.5 B decoder package built by onnxmedic (export and verification) against the
onnxruntime-genai model builder, on the same checkpoint and machine.

For each tool, one process of its own (and its children): the wall time, the peak resident
memory of the process tree (sampled every 0.1 s, summed over the tree), the size of the ONNX
files; for onnxmedic its stages' seconds (from its JSON report). Then both folders generate
greedily in onnxruntime-genai (float32, CPU), alternately, REPEATS times: the tokens against
PyTorch's ``generate(do_sample=False)`` and the decode tokens/s (the tokens after the first,
over their time; the first's time is the prefill).

    python bench/peers/generation_05b.py [--model /work/coord/models/qwen2-0.5b] [--steps 64]
        [--tools onnxmedic,genai-builder,onnxmedic-export] [--build-rounds 3]

Each tool builds its package ``--build-rounds`` times, the tools alternating, so that a busy
moment hits all: the build time is the median.

The checkpoint: bench/zoo/generation.py's ``save_half_b`` (Qwen2.5-0.5B's shape, float32,
random weights, a trained tokenizer). Run it alone (through the shared lock on a shared
machine): it takes minutes and about 8 GiB.
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
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MODEL = "/work/coord/models/qwen2-0.5b"
# onnxmedic: the default (--backend auto: the genai builder's package, verified by onnxmedic);
# onnxmedic-export: onnxmedic's own export (--backend export); -optimize: with --optimize
TOOLS = ("onnxmedic", "genai-builder", "onnxmedic-export")
BUILD_ROUNDS = 3
PROMPT = "Return the number of items in the list"
REPEATS = 3

# greedy generation in onnxruntime-genai, timed: the prefill (the first token) apart from the
# decode steps; a first generation warms the runtime up
GENAI_CHILD = r"""
import json, sys, time
import onnxruntime_genai as og
folder, ids, steps, repeats = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model = og.Model(folder)
def once():
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + steps, do_sample=False)
    gen = og.Generator(model, params)
    t0 = time.perf_counter()
    gen.append_tokens(ids)
    gen.generate_next_token()
    out = [int(gen.get_next_tokens()[0])]
    t1 = time.perf_counter()
    while not gen.is_done() and len(out) < steps:
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    return out, t1 - t0, time.perf_counter() - t1
once()
runs = [once() for _ in range(repeats)]
print(json.dumps({"tokens": runs[0][0], "prefill_s": [r[1] for r in runs],
                  "decode_s": [r[2] for r in runs], "decoded": len(runs[0][0]) - 1}))
"""

TORCH_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[3])
from transformers import AutoModelForCausalLM
from onnxmedic.hf.gen_verify import torch_generation
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
print(json.dumps(torch_generation(model, json.loads(sys.argv[2]), int(sys.argv[4]))[0]))
"""


def _tree_rss(pid: int) -> int:
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc] + proc.children(recursive=True)
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def measured(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 3600
             ) -> dict[str, Any]:
    """Run ``cmd``: its wall seconds, exit code, peak resident MiB of its process tree, and
    the last lines of its output."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _tree_rss(proc.pid))
            done.wait(0.1)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    done.set()
    thread.join()
    return {"wall_s": time.perf_counter() - t0, "rc": proc.returncode,
            "peak_mib": peak[0] / 2**20, "tail": out.strip().splitlines()[-3:]}


def _size_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if ".onnx" in p.name) / 2**20


def build(tool: str, model: str, out: Path, env: dict[str, str]) -> dict[str, Any]:
    """One tool's package of ``model`` at ``out``, measured."""
    shutil.rmtree(out, ignore_errors=True)
    py = sys.executable
    report = out.parent / f"{tool}_report.json"
    if tool.startswith("onnxmedic"):
        cmd = [py, "-m", "onnxmedic", "export", f"hf:{model}", "--task",
               "text-generation-with-past", "-o", str(out), "--no-progress", "--report",
               str(report)] + (["--optimize"] if tool.endswith("-optimize") else []) + (
               ["--backend", "export"] if tool.startswith("onnxmedic-export") else [])
    else:
        cache = out.parent / "builder_cache"
        shutil.rmtree(cache, ignore_errors=True)
        cmd = [py, "-m", "onnxruntime_genai.models.builder", "-m", model, "-i", model, "-o",
               str(out), "-p", "fp32", "-e", "cpu", "-c", str(cache)]
    row = {"tool": tool, "command": " ".join(cmd[1:]), **measured(cmd, env)}
    row["size_mb"] = _size_mb(out) if out.exists() else None
    row["ok"] = row["rc"] == 0 and (out / "genai_config.json").exists()
    if tool.startswith("onnxmedic") and report.exists():
        row["stages"] = _stage_seconds(json.loads(report.read_text()))
    return row


def _stage_seconds(report: dict[str, Any]) -> dict[str, float]:
    """The report's timings: the checkpoint's loading (inputs), the graph's export stages,
    the package's, and the generation's parts (generate: ...)."""
    return {k: round(float(v), 1) for k, v in (report.get("timings") or {}).items()}


def genai_speed(folder: Path, ids: list[int], steps: int, env: dict[str, str]
                ) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", GENAI_CHILD, str(folder), json.dumps(ids),
                           str(steps), "1"], capture_output=True, text=True, env=env,
                          timeout=1800)
    if proc.returncode:
        return {"error": " ".join(proc.stderr.strip().splitlines()[-2:])[:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def session_ab(model: str, folder: Path) -> dict[str, Any]:
    """The package's generation verification (onnxruntime-genai left out) with a session per
    step, as before keep_session, and with one kept session: wall and ONNX-loop seconds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from onnxmedic import sandbox
    from onnxmedic.hf import gen_verify

    lm = AutoModelForCausalLM.from_pretrained(model).eval()
    tok = AutoTokenizer.from_pretrained(model)
    run, out = sandbox.run_model, {}
    try:
        for mode, keep in (("session per step", False), ("kept session", True)):
            gen_verify.sandbox.run_model = (  # type: ignore[assignment]
                lambda *a, keep=keep, **k: run(*a, **dict(k, keep_session=keep)))
            t0 = time.perf_counter()
            c = gen_verify.verify_generation(folder, lm, tok, genai=False)
            out[mode] = {"ok": c.ok, "wall_s": round(time.perf_counter() - t0, 1),
                         "onnx_s": round(c.seconds["onnx"], 1),
                         "tokens_match": c.tokens_onnx == c.tokens_torch}
    finally:
        gen_verify.sandbox.run_model = run  # type: ignore[assignment]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=REPEATS)
    ap.add_argument("--build-rounds", type=int, default=BUILD_ROUNDS)
    ap.add_argument("--skip-build", action="store_true", help="time the folders already built")
    ap.add_argument("--root", default=str(ROOT / "build" / "gen_05b"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "generation_05b.md"))
    ap.add_argument("--session-ab", action="store_true", help="only: the verification of the "
                    "onnxmedic folder built before, a session per step against one kept")
    a = ap.parse_args()
    root = Path(a.root)
    if a.session_ab:
        sys.path.insert(0, str(ROOT / "src"))
        print(json.dumps(session_ab(a.model, root / "onnxmedic")))
        return
    root.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    tools = a.tools.split(",")
    rows_file = root / "builds.json"
    rows: dict[str, Any] = json.loads(rows_file.read_text()) if rows_file.exists() else {}
    if not a.skip_build:
        walls: dict[str, list[float]] = {t: [] for t in tools}
        for _ in range(a.build_rounds):  # alternately, as the speeds below
            for tool in tools:
                rows[tool] = build(tool, a.model, root / tool, env)
                walls[tool].append(rows[tool]["wall_s"])
                rows[tool]["walls"] = walls[tool]
                rows[tool]["wall_s"] = sorted(walls[tool])[len(walls[tool]) // 2]
                rows_file.write_text(json.dumps(rows, indent=1))
                print(json.dumps(rows[tool]), flush=True)
    from transformers import AutoTokenizer

    ids = [int(t) for t in AutoTokenizer.from_pretrained(a.model)(PROMPT)["input_ids"]]
    want = json.loads(subprocess.run(
        [sys.executable, "-c", TORCH_CHILD, a.model, json.dumps(ids), str(ROOT / "src"),
         str(a.steps)], capture_output=True, text=True, env=env, check=True
    ).stdout.strip().splitlines()[-1])
    speeds: dict[str, list[dict[str, Any]]] = {t: [] for t in tools}
    for _ in range(a.repeats):  # alternately, so that a busy moment hits both
        for tool in tools:
            if rows.get(tool, {}).get("ok"):
                speeds[tool].append(genai_speed(root / tool, ids, a.steps, env))
    for tool in tools:
        runs = [s for s in speeds[tool] if "error" not in s]
        row = rows.setdefault(tool, {"tool": tool})
        row["genai_error"] = next((s["error"] for s in speeds[tool] if "error" in s), None)
        if runs:
            row["tokens_match"] = all(r["tokens"] == want for r in runs)
            row["decode_tok_s"] = [r["decoded"] / r["decode_s"][0] for r in runs]
            row["prefill_ms"] = [1000 * r["prefill_s"][0] for r in runs]
    rows_file.write_text(json.dumps(rows, indent=1))
    Path(a.out).write_text(table(rows, tools, a, len(ids)))
    print(Path(a.out).read_text())


def table(rows: dict[str, Any], tools: list[str], a: argparse.Namespace, n_prompt: int) -> str:
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo")
                if x.startswith("model name")), platform.processor())
    import onnxruntime
    import onnxruntime_genai

    lines = [f"`python bench/peers/generation_05b.py --model {a.model} --steps {a.steps} "
             f"--tools {','.join(tools)} --build-rounds {a.build_rounds}` · "
             f"{datetime.date.today()} · {cpu}, {os.cpu_count()} cores (shared) · onnxruntime "
             f"{onnxruntime.__version__}, onnxruntime-genai {onnxruntime_genai.__version__}, "
             f"float32 CPU; builds: {a.build_rounds} alternating rounds (median; each "
             f"round's in brackets); genai: prompt {n_prompt} tokens, {a.steps} generated, "
             f"{a.repeats} alternating runs each (median)", "",
             "| tool | built | build s (verification included for onnxmedic) | peak MiB "
             "(process tree) | ONNX MB | tokens = PyTorch's | decode tokens/s (genai) | "
             "prefill ms |", "|---|---|---|---|---|---|---|---|"]
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else None  # noqa: E731
    for tool in tools:
        r = rows.get(tool, {})
        tps, pre = med(r.get("decode_tok_s") or []), med(r.get("prefill_ms") or [])
        lines.append(
            f"| {tool} | {'yes' if r.get('ok') else 'no: ' + ' '.join(r.get('tail', []))[:120]}"
            f" | {r.get('wall_s', 0):.1f} ({', '.join(f'{w:.1f}' for w in r.get('walls', []))})"
            f" | {r.get('peak_mib', 0):.0f} | "
            f"{r.get('size_mb') or 0:.0f} | {r.get('tokens_match', '-')} | "
            f"{'-' if tps is None else f'{tps:.1f}'} | {'-' if pre is None else f'{pre:.0f}'} |")
    gb = rows.get("genai-builder", {})
    oms = [t for t in tools if t.startswith("onnxmedic") and rows.get(t, {}).get("wall_s")]
    if gb.get("wall_s") and oms:
        lines += [""] + [f"{t} / builder build time: {rows[t]['wall_s'] / gb['wall_s']:.2f}x"
                         for t in oms]
    staged = [t for t in oms if rows[t].get("stages")]
    if staged:
        keys = list(dict.fromkeys(k for t in staged for k in rows[t]["stages"]))
        lines += ["", f"| stage (s) | {' | '.join(staged)} |", "|---" * (len(staged) + 1) + "|"]
        lines += [f"| {k} | " + " | ".join(str(rows[t]["stages"].get(k, "-")) for t in staged)
                  + " |" for k in keys]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
