"""``onnxmedic export hf:DIR --precision int4`` against onnxruntime-genai's builder ``-p int4`` on a
trained decoder (issue 50's second goal).

    python bench/peers/int4_package.py --rounds 7       # train (cached), build both, measure

The decoder: bench/accuracy/train_decoder.py's ``qwen2`` preset (Qwen2-shaped, 4 layers, hidden
256, 8 heads, 2 KV heads, untied head; trained here, seeded, cached under build/decoders;
``--checkpoint`` takes another folder). The packages, under ``build/int4_package/<preset>``:

- ``onnxmedic``: ``python -m onnxmedic export hf:CKPT --precision int4 -o ... --report
  onnxmedic.json`` (one command: exported, fused, int4 judged by the default task budget,
  served by onnxruntime-genai), its wall time;
- ``builder``: ``python -m onnxruntime_genai.models.builder -i CKPT -o ... -p int4 -e cpu``;
- ``fp32``: ``python -m onnxmedic export hf:CKPT -o ...`` (what the int4 road starts from),
  for the rounding check.

Accuracy, as docs/int4.md defines it: PyTorch float32 generates 32 tokens greedily from each
of optimize/int4.py's 4 built-in prompts; each package, in onnxruntime-genai, is appended the
prompt and then PyTorch's tokens one at a time, and at each step its argmax is compared with
PyTorch's next token (teacher-forced greedy agreement, 128 decisions). Speed: both packages in
one child process (2 intra-op threads), rounds alternating which goes first; in each, a
64-token prompt then 64 tokens appended one at a time; decode ms per token, the median of each
round, and the ratio onnxmedic / builder per round. Results: bench/results/int4_package.md
(+ .json; ``int4_package_<preset>`` for another preset).
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

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "int4_package" / "qwen2"  # per preset (main)
TABLE = "int4_package"  # bench/results/<TABLE>.md: int4_package_<preset> for another preset
RESULTS = ROOT / "bench" / "results"
PACKAGES = ("onnxmedic", "builder")
STEPS, PROMPT, DECODE = 32, 64, 64


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT / "src"))


def build(ckpt: Path) -> dict[str, Any]:
    """Both packages of ``ckpt`` (rebuilt), the commands and their wall times."""
    BUILD.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {}
    cmds = {
        "onnxmedic": [sys.executable, "-m", "onnxmedic", "export", f"hf:{ckpt}", "--precision",
                      "int4", "-o", str(BUILD / "onnxmedic"), "--no-progress", "--report",
                      str(BUILD / "onnxmedic.json")],
        "builder": [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt),
                    "-o", str(BUILD / "builder"), "-p", "int4", "-e", "cpu", "-c",
                    str(BUILD / "builder_cache")],
        # the float32 package the int4 road starts from (the same backend, deterministic):
        # what the rounding check (optimize/int4.py's rounding_problem) compares against
        "fp32": [sys.executable, "-m", "onnxmedic", "export", f"hf:{ckpt}", "-o",
                 str(BUILD / "fp32"), "--no-progress"]}
    for name, cmd in cmds.items():
        shutil.rmtree(BUILD / name, ignore_errors=True)
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_env())
        (BUILD / f"{name}.log").write_text(proc.stdout + proc.stderr)
        out[name] = {"command": " ".join(["python", *cmd[1:]]).replace(str(ROOT) + "/", ""),
                     "seconds": round(time.perf_counter() - t, 1), "rc": proc.returncode}
        print(name, out[name], flush=True)
    return out


def reference(ckpt: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """PyTorch float32's greedy tokens from the built-in prompts (optimize/int4.py's harness
    over int4_package's step reference of the causal LM), and the task budget's verdict
    (ONNX Runtime, as the int4 search judges) on onnxmedic's int4 decoder and on two faulted
    copies of its package (bench/accuracy/int4_ties.py's faults: a corrupted 4-bit block, a
    block's scale x16)."""
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT / "bench" / "accuracy"))
    from int4_ties import FAULTS, inject
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from onnxmedic.genpackage import read_package
    from onnxmedic.hf.transforms.int4_package import PackageReference
    from onnxmedic.hf.transforms.passes import copy_side_files
    from onnxmedic.optimize import int4

    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    tok = AutoTokenizer.from_pretrained(ckpt)
    data = int4.builtin_data(tok.encode)
    ours = BUILD / "onnxmedic"
    layout = read_package(ours)
    ref = int4.score(int4.torch_step(PackageReference(model, layout)), layout.empty_past(), data,
                     STEPS)
    folders = {"onnxmedic": ours}
    for i, fault in enumerate(FAULTS):
        folder = BUILD / f"fault{i + 1}"
        shutil.rmtree(folder, ignore_errors=True)
        copy_side_files(ours, folder, "model.onnx")
        node = inject(str(ours / "model.onnx"), str(folder / "model.onnx"), fault)
        folders[f"onnxmedic, {fault} ({node})"] = folder
    judged = {}
    for name, folder in folders.items():
        got = int4.score_onnx(folder / "model.onnx", data, STEPS, ref["tokens"],
                              layout=read_package(folder))
        j = int4.judge(ref, got, int4.DEFAULT_BUDGET)
        judged[name] = {"folder": str(folder), "agreement": j["agreement"],
                        "perplexity_ratio": j["perplexity_ratio"], "rejected": j["rejected"]}
    rounding(judged)
    return {"prompts": data.prompts, "tokens": ref["tokens"],
            "perplexity": ref.get("perplexity")}, judged


def rounding(judged: dict[str, Any]) -> None:
    """Each judged package's rounding check against the float32 package (``BUILD/fp32``)."""
    sys.path.insert(0, str(ROOT / "src"))
    from onnxmedic.optimize.int4 import rounding_problem

    for j in judged.values():
        j["rounding"] = rounding_problem(BUILD / "fp32" / "model.onnx",
                                         Path(j["folder"]) / "model.onnx")


def child(spec_path: str) -> dict[str, Any]:
    """The packages in this process: teacher-forced agreement (of ``extra``'s too), then
    alternating timing rounds (imports onnxruntime_genai and numpy only)."""
    import numpy as np
    import onnxruntime_genai as og

    spec = json.loads(Path(spec_path).read_text())
    models = {}
    for name, folder in {**spec["packages"], **spec["extra"]}.items():
        config = og.Config(folder)
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": 2}}}}))
        models[name] = og.Model(config)

    def generator(model: Any, length: int) -> Any:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=length, do_sample=False)
        return og.Generator(model, params)

    out: dict[str, Any] = {"version": og.__version__, "agreement": {}, "picks": {},
                           "ms_per_token": {n: [] for n in spec["packages"]}}
    for name, model in models.items():
        picks = []
        for prompt, toks in zip(spec["prompts"], spec["tokens"]):
            gen = generator(model, len(prompt) + len(toks) + 1)
            gen.append_tokens(prompt)
            row = []
            for t in toks:
                row.append(int(np.argmax(gen.get_logits()[0, -1])))
                gen.append_tokens([t])
            picks.append(row)
        same = sum(a == b for r, p in zip(spec["tokens"], picks) for a, b in zip(r, p))
        out["agreement"][name] = same / sum(len(r) for r in spec["tokens"])
        out["picks"][name] = picks
    rng = np.random.default_rng(0)
    prompt = rng.integers(4, 1000, PROMPT).tolist()
    tokens = rng.integers(4, 1000, DECODE).tolist()
    names = list(spec["packages"])
    for r in range(spec["rounds"]):
        for name in names if r % 2 == 0 else names[::-1]:
            gen = generator(models[name], PROMPT + DECODE + 1)
            gen.append_tokens(prompt)
            times = []
            for t in tokens:
                t0 = time.perf_counter()
                gen.append_tokens([t])
                gen.get_logits()
                times.append((time.perf_counter() - t0) * 1000)
            out["ms_per_token"][name].append(statistics.median(times))
            del gen
    return out


def measure(ckpt: Path, rounds: int) -> dict[str, Any]:
    """The reference and the budget's verdicts, then the genai child over both packages and
    the faulted ones."""
    ref, judged = reference(ckpt)
    spec = {"packages": {n: str(BUILD / n) for n in PACKAGES}, "rounds": rounds, **ref,
            "extra": {n: j["folder"] for n, j in judged.items() if n != "onnxmedic"}}
    path = BUILD / "spec.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, __file__, "--child", str(path)], capture_output=True,
                          text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-2000:])
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    got["reference_perplexity"] = ref["perplexity"]
    got["judged"] = judged
    return got


def _chosen(report: Path) -> dict[str, Any]:
    """The int4 search's choice and candidates, from the export's JSON report."""
    if not report.exists():
        return {}
    for f in json.loads(report.read_text()).get("findings", []):
        if f.get("code") in ("OM732", "OM731") and f.get("details"):
            return f["details"]
    return {}


def write(rec: dict[str, Any], cmd: str) -> None:
    """bench/results/<TABLE>.md (+ .json)."""
    cpu = next((ln.split(":", 1)[1].strip() for ln in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines()
        if ln.startswith("Model name")), platform.processor())
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{TABLE}.json").write_text(json.dumps(rec, indent=1, default=str))
    m, t = rec["measure"], rec["train"]
    ms = m["ms_per_token"]
    ratios = [a / b for a, b in zip(ms["onnxmedic"], ms["builder"])]
    lines = [f"`{cmd}` - {datetime.date.today()} - {cpu}, {os.cpu_count()} cores shared with "
             f"other jobs, 2 intra-op threads, onnxruntime-genai {m['version']}", "",
             f"Decoder: train_decoder.py's {t['preset']} preset, {t['parameters'] / 1e6:.2f} M "
             f"parameters, {t['settings']['steps']} steps, loss {t['loss_first']} -> "
             f"{t['loss_last']}, held-out perplexity {t['held_out_perplexity']}; PyTorch "
             f"float32 perplexity on the built-in text {rec['measure']['reference_perplexity']:.4g}",
             "", "| package | command s | rc | genai teacher-forced agreement | decode ms/token "
             "(median of rounds) |", "|---|---|---|---|---|"]
    for n in PACKAGES:
        b = rec["build"][n]
        lines.append(f"| {n}: `{b['command']}` | {b['seconds']} | {b['rc']} | "
                     f"{m['agreement'][n] * 100:.1f} % | "
                     f"{statistics.median(ms[n]):.3f} |")
    lines += ["", "Per round (ms/token, onnxmedic / builder, ratio): " + "; ".join(
        f"{a:.3f} / {b:.3f} = {r:.2f}x" for a, b, r in zip(ms["onnxmedic"], ms["builder"],
                                                          ratios)),
              f"Median ratio {statistics.median(ratios):.2f}x.", ""]
    if "judged" in m:
        if "fp32" in rec["build"]:
            lines += [f"The float32 package: `{rec['build']['fp32']['command']}`.", ""]
        lines += ["The task budget's verdict (ONNX Runtime, as the int4 search judges: "
                  "teacher-forced agreement >= 95 %, perplexity <= +5 %), and "
                  "onnxruntime-genai's agreement, on onnxmedic's package and on copies with "
                  "an injected fault:", "",
                  "| package | agreement (ORT) | perplexity delta | within the budget | genai "
                  "agreement | rounding check (against the float32 package) |",
                  "|---|---|---|---|---|---|"]
        for n, j in m["judged"].items():
            lines.append(f"| {n} | {j['agreement'] * 100:.1f} % | "
                         f"{(j['perplexity_ratio'] - 1) * 100:+.2f} % | "
                         f"{'no: ' + j['rejected'][:60] if j['rejected'] else 'yes'} | "
                         f"{m['agreement'][n] * 100:.1f} % | "
                         f"{'fails: ' + j['rounding'][:90] if j.get('rounding') else 'holds'} |")
        lines.append("")
    c = rec.get("chosen") or {}
    if c:
        sys.path.insert(0, str(ROOT / "bench" / "peers"))
        from int4_half_b import candidate_table

        lines += [f"int4 search (export's report): chosen {c.get('chosen')}", "",
                  *candidate_table(c.get("candidates", []))]
    (RESULTS / f"{TABLE}.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2")
    ap.add_argument("--checkpoint", type=Path, help="a trained folder (default: the preset's)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-build", action="store_true", help="measure the packages built before")
    ap.add_argument("--write", action="store_true", help="rewrite the table from its .json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.child:
        print(json.dumps(child(ns.child)))
        return
    global BUILD, TABLE
    BUILD = BUILD.with_name(ns.preset)
    TABLE = "int4_package" + ("" if ns.preset == "qwen2" else f"_{ns.preset}")
    if ns.write:
        rec = json.loads((RESULTS / f"{TABLE}.json").read_text())
        if (BUILD / "fp32").is_dir():
            rounding(rec["measure"]["judged"])
        write(rec, rec["command"] + "`, rounding check by `... --write")
        print((RESULTS / f"{TABLE}.md").read_text())
        return
    sys.path.insert(0, str(ROOT / "bench" / "accuracy"))
    import train_decoder as td
    ckpt = ns.checkpoint or td.folder(ns.preset)
    built = BUILD / "build.json"
    if not ns.no_build:
        built.parent.mkdir(parents=True, exist_ok=True)
        built.write_text(json.dumps(build(ckpt)))
    rec = {"checkpoint": str(ckpt), "train": json.loads((ckpt / "train.json").read_text()),
           "build": json.loads(built.read_text()),
           "chosen": _chosen(BUILD / "onnxmedic.json"),
           "measure": measure(ckpt, ns.rounds)}
    rec["command"] = (f"python bench/peers/int4_package.py --rounds {ns.rounds}"
                      + (f" --preset {ns.preset}" if ns.preset != "qwen2" else "")
                      + (" --no-build" if ns.no_build else ""))
    write(rec, rec["command"])
    print((RESULTS / f"{TABLE}.md").read_text())


if __name__ == "__main__":
    main()
