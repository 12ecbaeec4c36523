"""Generation packages side by side: onnxmedic (its own export, and the default
--backend auto from the checkpoint folder), transformers.exporters, the onnxruntime-genai model
builder and optimum-cli on the same tiny decoder checkpoints (bench/zoo/generation.py),
same machine.

For each family and tool (each in a process of its own, so that its peak memory is its own):
whether the package generates PyTorch's greedy tokens (``generate(do_sample=False)``, STEPS
tokens), the export time (onnxmedic's includes its verification), the peak resident memory of
the tool's process and its children, the size of the ONNX files, and tokens/s in ONNX Runtime
(CPU): onnxmedic's and the builder's folders in onnxruntime-genai, transformers.exporters'
prefill/decode pair through its own ONNX Runtime runners (it writes no GenAI folder),
optimum-cli's folder through optimum's ORTModelForCausalLM.generate.

optimum-cli runs in its own venv (``make bench-optimum-venv``: build/venv-optimum): optimum-onnx
0.1.0, the latest, pins transformers<4.58, which pip refuses beside transformers 5.x
(ResolutionImpossible), so it runs with the transformers 4.57 its pins allow, on the same
checkpoints (saved by transformers 5.x); its tokens are compared with PyTorch's under 5.x.

    python bench/peers/generation.py [--families llama,gpt2] [--steps 16]

Rows go to build/gen_peers/results.jsonl as they finish (a later run's row for the same family
and tool replaces the earlier one); the table of all of them to
bench/results/generation_peers.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

# onnxmedic: its own export (a loaded model); onnxmedic-auto: the checkpoint folder with the
# default --backend auto (the genai builder's package where it serves and verifies)
TOOLS = ("onnxmedic", "onnxmedic-auto", "transformers.exporters", "genai-builder",
         "optimum-cli")
PROMPT = "Return the number of items in the list"
CHILD = ROOT / "src" / "onnxmedic" / "hf" / "genai_child.py"
OPTIMUM_VENV = ROOT / "build" / "venv-optimum"
OPTIMUM_PINS = ("optimum-onnx 0.1.0 (the latest) pins transformers<4.58; `pip install "
                "'optimum-onnx[onnxruntime]' transformers==5.23.0` answers \"ERROR: Cannot install "
                "optimum-onnx[onnxruntime]==0.0.1, optimum-onnx[onnxruntime]==0.0.2, "
                "optimum-onnx[onnxruntime]==0.0.3, optimum-onnx[onnxruntime]==0.1.0 and "
                "transformers==5.23.0 because these package versions have conflicting "
                "dependencies ... optimum-onnx[onnxruntime] 0.1.0 depends on transformers<4.58.0 "
                "and >=4.36 ... ResolutionImpossible\"; so it runs in its own venv (make "
                "bench-optimum-venv) with transformers 4.57.6 and the same torch 2.13.0")
# greedy generation through optimum's ORTModelForCausalLM, run in optimum's venv
OPTIMUM_CHILD = r"""
import json, sys, time
import torch
from optimum.onnxruntime import ORTModelForCausalLM
model = ORTModelForCausalLM.from_pretrained(sys.argv[1], use_cache=True)
ids = torch.tensor([json.loads(sys.argv[2])])
steps = int(sys.argv[3])
t0 = time.perf_counter()
out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                     min_new_tokens=steps, do_sample=False, num_beams=1)
seconds = time.perf_counter() - t0
import transformers
print(json.dumps({"tokens": out[0, ids.shape[1]:].tolist(), "seconds": seconds,
                  "transformers": transformers.__version__}))
"""


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()
               and (".onnx" in p.name))


def _peak_mib() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(me, kids) / 1024


def _genai(folder: Path, ids: list[int], steps: int) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, str(CHILD), str(folder),
                           json.dumps({"prompts": [ids], "steps": steps})],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode:
        return {"error": " ".join(proc.stderr.strip().splitlines()[-2:])[:300]}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"tokens": out["tokens"][0], "tok_s": out["generated"] / max(out["seconds"], 1e-9)}


def _ort_only(out: Path, ids: list[int], steps: int) -> dict[str, Any]:
    """A package without genai_config.json (OM820: a cache GenAI cannot size): its tokens
    from onnxmedic's ONNX Runtime loop (a sandbox run per step: no tokens/s)."""
    from onnxmedic.genpackage import read_package
    from onnxmedic.hf import gen_verify

    layout = read_package(out)
    check = gen_verify.GenerationCheck()
    tokens, _, _ = gen_verify.onnx_generation(out / "model.onnx", layout, ids, steps, 600.0,
                                              check)
    return {"tokens": tokens, "note": "ONNX Runtime loop; no genai_config.json (OM820)"}


def _onnxmedic(model: Any, tok: Any, folder: Path, out: Path, steps: int) -> dict[str, Any]:
    from onnxmedic.hf import export_generation

    t0 = time.perf_counter()
    r = export_generation(model, out, tokenizer=tok, steps=8)
    row: dict[str, Any] = {"export_s": time.perf_counter() - t0, "verified": r.ok}
    if not r.ok:
        row["error"] = "; ".join(f"{f.code} {f.message[:160]}" for f in r.errors[:2])
    return row


def _onnxmedic_auto(model: Any, tok: Any, folder: Path, out: Path, steps: int
                    ) -> dict[str, Any]:
    from onnxmedic.hf import export_pretrained

    t0 = time.perf_counter()
    r = export_pretrained(folder, out, task="text-generation-with-past")
    row: dict[str, Any] = {"export_s": time.perf_counter() - t0, "verified": r.ok}
    found = {f.code for f in r.findings}
    row["note"] = ("the builder's package" if "OM836" in found else
                   "onnxmedic's export: the builder's package did not verify (OM837)"
                   if "OM837" in found else "onnxmedic's export")
    if not r.ok:
        row["error"] = "; ".join(f"{f.code} {f.message[:160]}" for f in r.errors[:2])
    return row


def _builder(model: Any, tok: Any, folder: Path, out: Path, steps: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-m",
                           str(folder), "-i", str(folder), "-o", str(out), "-p", "fp32",
                           "-e", "cpu", "-c", str(out.parent / "cache")],
                          capture_output=True, text=True, timeout=1200)
    row: dict[str, Any] = {"export_s": time.perf_counter() - t0}
    if proc.returncode or not (out / "genai_config.json").exists():
        # the builder's own error is stderr's last line (its stdout ends with a usage banner)
        lines = [x for x in (proc.stderr or proc.stdout).strip().splitlines() if x.strip()]
        row["error"] = (lines[-1] if lines else f"exit {proc.returncode}")[:300]
    return row


def _exporters(model: Any, tok: Any, folder: Path, out: Path, steps: int) -> dict[str, Any]:
    import torch
    from transformers.exporters import OnnxConfig, OnnxExporter

    ids = torch.tensor([tok(PROMPT)["input_ids"]])
    t0 = time.perf_counter()
    try:
        ex = OnnxExporter().export_for_generation(
            model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
            OnnxConfig(dynamic=True))
        ex.save_pretrained(out)
    except Exception as e:
        return {"export_s": time.perf_counter() - t0, "error": f"{type(e).__name__}: "
                f"{str(e).strip().splitlines()[0][:250] if str(e).strip() else ''}"}
    row: dict[str, Any] = {"export_s": time.perf_counter() - t0}
    try:
        row.update(_exporters_generate(ex, ids, steps, model.config))
    except Exception as e:
        row["error"] = f"generation: {type(e).__name__}: {str(e)[:250]}"
    return row


def _exporters_generate(ex: Any, ids: Any, steps: int, config: Any) -> dict[str, Any]:
    """Greedy generation through transformers.exporters' ONNX Runtime runners, with the cache
    generate() makes (``DynamicCache(config=...)``: sliding-window layers where the model has
    them)."""
    import torch
    from transformers import DynamicCache

    pre, dec = ex.runners["prefill"], ex.runners["decode"]
    n = ids.shape[1]
    t0 = time.perf_counter()
    out = pre(input_ids=ids, position_ids=torch.arange(n)[None],
              past_key_values=DynamicCache(config=config))
    tokens = [int(out.logits[0, -1].argmax())]
    cache = out.past_key_values
    for k in range(1, steps):
        out = dec(input_ids=torch.tensor([[tokens[-1]]]),
                  position_ids=torch.tensor([[n + k - 1]]), past_key_values=cache)
        cache = out.past_key_values
        tokens.append(int(out.logits[0, -1].argmax()))
    return {"tokens": tokens, "tok_s": steps / (time.perf_counter() - t0)}


def _optimum(model: Any, tok: Any, folder: Path, out: Path, steps: int) -> dict[str, Any]:
    """optimum-cli export onnx --task text-generation-with-past, in optimum's own venv, then
    greedy generation there (ORTModelForCausalLM)."""
    cli = OPTIMUM_VENV / "bin" / "optimum-cli"
    if not cli.exists():
        return {"error": f"not installed: {OPTIMUM_PINS}"}
    t0 = time.perf_counter()
    proc = subprocess.run([str(cli), "export", "onnx", "--model", str(folder), "--task",
                           "text-generation-with-past", str(out)],
                          capture_output=True, text=True, timeout=1200)
    row: dict[str, Any] = {"export_s": time.perf_counter() - t0}
    if proc.returncode or not (out / "model.onnx").exists():
        lines = [x for x in (proc.stderr or proc.stdout).strip().splitlines() if x.strip()]
        row["error"] = (lines[-1] if lines else f"exit {proc.returncode}")[:300]
        return row
    ids = [int(t) for t in tok(PROMPT)["input_ids"]]
    gen = subprocess.run([str(OPTIMUM_VENV / "bin" / "python"), "-c", OPTIMUM_CHILD, str(out),
                          json.dumps(ids), str(steps)], capture_output=True, text=True,
                         timeout=600)
    if gen.returncode:
        row["error"] = "generation: " + " ".join(gen.stderr.strip().splitlines()[-2:])[:300]
        return row
    res = json.loads(gen.stdout.strip().splitlines()[-1])
    row.update(tokens=res["tokens"], tok_s=steps / max(res["seconds"], 1e-9),
               note=f"transformers {res['transformers']} in optimum's venv")
    return row


def one(tool: str, family: str, root: Path, steps: int) -> dict[str, Any]:
    """One tool on one family, in this process."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.zoo.generation import save_family
    from onnxmedic.hf.gen_verify import torch_generation

    folder = save_family(family, root / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    ids = [int(t) for t in tok(PROMPT)["input_ids"]]
    want, _ = torch_generation(model, ids, steps)
    out = root / tool / family
    out.parent.mkdir(parents=True, exist_ok=True)
    fn = {"onnxmedic": _onnxmedic, "onnxmedic-auto": _onnxmedic_auto, "genai-builder": _builder,
          "transformers.exporters": _exporters, "optimum-cli": _optimum}[tool]
    row = {"tool": tool, "family": family, **fn(model, tok, folder, out, steps)}
    if tool.startswith("onnxmedic") and "error" not in row and \
            not (out / "genai_config.json").exists():
        row.update(_ort_only(out, ids, steps))
    elif tool not in ("transformers.exporters", "optimum-cli") and "error" not in row:
        row.update(_genai(out, ids, steps))
    got = row.get("tokens")
    eos = {int(model.generation_config.eos_token_id or -1)}
    row["correct"] = bool(got) and "error" not in row and got == want[:len(got)] and (
        len(got) == len(want) or got[-1] in eos)
    row["torch_tokens"] = want
    row["size_mb"] = _size(out) / 2**20 if out.exists() else None
    row["peak_mib"] = _peak_mib()
    return row


def _table(rows: list[dict[str, Any]], command: str) -> str:
    import os

    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo")
                if x.startswith("model name")), platform.processor())
    lines = [f"`python bench/peers/generation.py` (each family and tool's latest row; last run "
             f"`{command}`) · {datetime.date.today()} · {cpu}, {os.cpu_count()} cores "
             f"(shared) · CPU onnxruntime, float32", "",
             "| family | tool | generates correctly | export s | peak MiB | ONNX MB | tokens/s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = "yes" if r["correct"] else f"no: {r.get('error', 'tokens differ')}"[:160]
        if r.get("note"):
            ok += f" ({r['note']})"
        fmt = lambda k, f: f.format(r[k]) if r.get(k) is not None else "-"  # noqa: E731
        lines.append(f"| {r['family']} | {r['tool']} | {ok.replace('|', '/')} | "
                     f"{fmt('export_s', '{:.1f}')} | {fmt('peak_mib', '{:.0f}')} | "
                     f"{fmt('size_mb', '{:.2f}')} | {fmt('tok_s', '{:.0f}')} |")
    lines += ["", "| tool | families generating correctly |", "|---|---|"]
    for tool in TOOLS:
        mine = [r for r in rows if r["tool"] == tool]
        lines.append(f"| {tool} | {sum(r['correct'] for r in mine)} of {len(mine)} |")
    lines += ["", f"optimum-cli: {OPTIMUM_PINS}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    from bench.zoo.generation import FAMILIES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--root", default=str(ROOT / "build" / "gen_peers"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "generation_peers.md"))
    ap.add_argument("--one", nargs=2, metavar=("TOOL", "FAMILY"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    root = Path(a.root)
    if a.one:
        print(json.dumps(one(a.one[0], a.one[1], root, a.steps)))
        return
    seed_from_table(root, Path(a.out), _table_rows)
    command = "python bench/peers/generation.py " + " ".join(sys.argv[1:])
    for family in a.families.split(","):
        for tool in a.tools.split(","):
            row = _run_one(tool, family, root, a.steps)
            with open(root / "results.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(_table(_rows(root), command.strip()))
            print(f"{family:12s} {tool:24s} {row['correct']} "
                  f"{row.get('export_s', 0):.1f}s {row.get('error', '')[:120]}", flush=True)


def _table_rows(text: str) -> list[dict[str, Any]]:
    """The rows of a table that ``_table`` wrote, read back (what the table shows: errors and
    notes as truncated there), so that a run in a fresh ``--root`` keeps the other tools' rows
    of the committed table."""
    rows = []
    for line in text.splitlines():
        cells = [c[1:-1] for c in line.strip()[1:-1].split("|")]  # "| a | b |": a, b
        if len(cells) != 7 or cells[1] not in TOOLS:
            continue
        family, tool, ok, *nums = cells
        row: dict[str, Any] = {"tool": tool, "family": family, "correct": ok.startswith("yes")}
        text_ = ok[len("yes "):] if row["correct"] else ok[len("no: "):]
        note = re.search(r" ?\(([^()]*(?:\([^()]*\))?[^()]*)\)$", text_)
        if note and (row["correct"] or note.group(1).startswith("transformers ")):
            row["note"], text_ = note.group(1), text_[:note.start()]
        if not row["correct"] and text_ != "tokens differ":
            row["error"] = text_
        for key, cell in zip(("export_s", "peak_mib", "size_mb", "tok_s"), nums):
            if cell != "-":
                row[key] = float(cell)
        rows.append(row)
    return rows


def seed_from_table(root: Path, table: Path,
                    parse: Callable[[str], list[dict[str, Any]]]) -> None:
    """A fresh ``root`` (no results.jsonl yet) starts from ``table``'s rows (``parse``
    reads them back), so that the rows measured there replace theirs and the other tools'
    rows stay in the table written from ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "results.jsonl").exists() and table.exists():
        with open(root / "results.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in parse(table.read_text()))


def _rows(root: Path) -> list[dict[str, Any]]:
    """Every (family, tool) measured in ``root`` (its latest row): runs over other families
    add to the table."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for line in (root / "results.jsonl").read_text().splitlines():
        r = json.loads(line)
        rows[(r["family"], r["tool"])] = r
    return list(rows.values())


def _run_one(tool: str, family: str, root: Path, steps: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", tool, family, "--root", str(root),
           "--steps", str(steps)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except Exception as e:
        text = proc.stderr.strip().splitlines()[-1] if "proc" in locals() and \
            proc.stderr.strip() else str(e)
        return {"tool": tool, "family": family, "correct": False, "error": text[:300]}


if __name__ == "__main__":
    main()
