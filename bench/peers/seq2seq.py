"""Encoder-decoder packages side by side: onnxmedic, transformers.exporters and the
onnxruntime-genai model builder on the same tiny encoder-decoders (bench/zoo/seq2seq.py: T5,
BART, Marian, mBART, Whisper), same machine.

For each model and tool (each in a process of its own, so that its peak memory is its own):
whether the package generates PyTorch's greedy tokens (``generate(do_sample=False)`` from
``decoder_start_token_id``, STEPS tokens, from one text through the tokenizer or one synthetic
waveform through the feature extractor), the export time (onnxmedic's includes its
verification), the peak resident memory, the size of the ONNX files and tokens/s on CPU:
onnxmedic's package in a plain ONNX Runtime loop (encoder once, decoder per token; and in
onnxruntime-genai for Whisper), transformers.exporters' prefill/decode pair through its own
runners (fed PyTorch's encoder output: it exports no encoder), the builder's Whisper folder in
onnxruntime-genai.

    python bench/peers/seq2seq.py [--models t5,whisper] [--steps 16]

Rows go to build/seq2seq_peers/results.jsonl (a later row for the same model and tool
replaces the earlier one); the table to bench/results/seq2seq_peers.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from bench.peers.generation import _peak_mib, _size, seed_from_table  # noqa: E402

TOOLS = ("onnxmedic", "transformers.exporters", "genai-builder")
PROMPT = "Return the number of items in the list"
CHILD = ROOT / "src" / "onnxmedic" / "hf" / "genai_child.py"


def _load(name: str, root: Path) -> tuple[Any, Any, Any, Path]:
    from transformers import (
        AutoFeatureExtractor,
        AutoModelForSeq2SeqLM,
        AutoModelForSpeechSeq2Seq,
        AutoTokenizer,
    )

    from bench.zoo.seq2seq import AUDIO, save_encoder_decoder

    folder = save_encoder_decoder(name, root / "ckpt")
    auto = AutoModelForSpeechSeq2Seq if name in AUDIO else AutoModelForSeq2SeqLM
    proc = AutoFeatureExtractor.from_pretrained(folder) if name in AUDIO else None
    return auto.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder), proc, \
        folder


def _inputs(model: Any, tok: Any, proc: Any) -> dict[str, Any]:
    from onnxmedic.hf.seq2seq_verify import items

    return items(model, tok, proc, 1 if proc is not None else [PROMPT])[0]


def _ort_loop(folder: Path, enc: dict[str, Any], start: int, steps: int) -> dict[str, Any]:
    """onnxmedic's package in a plain ONNX Runtime loop: the encoder once, a decoder run per
    token, its self-attention cache fed back."""
    import numpy as np
    import onnxruntime as ort

    from onnxmedic.hf.seq2seq import DECODER, ENCODER

    e = ort.InferenceSession(str(folder / ENCODER), providers=["CPUExecutionProvider"])
    d = ort.InferenceSession(str(folder / DECODER), providers=["CPUExecutionProvider"])
    feed = {k: v.numpy() for k, v in enc.items()}
    t0 = time.perf_counter()
    out = dict(zip([o.name for o in e.get_outputs()], e.run(None, feed)))
    names = [i.name for i in d.get_inputs()]
    past = {n: (out[n.replace("past_key_values", "present")] if ".encoder." in n else
                np.zeros((1, out["present.0.encoder.key"].shape[1], 0,
                          out["present.0.encoder.key"].shape[3]), np.float32))
            for n in names if n.startswith("past_key_values.")}
    tokens, new = [], start
    for _ in range(steps):
        f = {"input_ids": np.array([[new]], np.int64), **past}
        if "encoder_attention_mask" in names:
            f["encoder_attention_mask"] = feed["attention_mask"]
        res = dict(zip([o.name for o in d.get_outputs()], d.run(None, f)))
        past.update({n: res[n.replace("past_key_values", "present")] for n in past
                     if ".decoder." in n})
        new = int(res["logits"][0, -1].argmax())
        tokens.append(new)
    return {"tokens": tokens, "tok_s": steps / (time.perf_counter() - t0)}


def _genai(folder: Path, enc: dict[str, Any], name: str, start: int, steps: int
           ) -> dict[str, Any]:
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "features.npy"
        np.save(path, enc["input_features"].numpy())
        spec = {"features": [str(path)], "input": name, "start": start, "steps": steps}
        proc = subprocess.run([sys.executable, str(CHILD), str(folder), json.dumps(spec)],
                              capture_output=True, text=True, timeout=600)
    if proc.returncode:
        return {"error": " ".join(proc.stderr.strip().splitlines()[-2:])[:300]}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"tokens": out["tokens"][0], "tok_s": out["generated"] / max(out["seconds"], 1e-9)}


def _onnxmedic(model: Any, tok: Any, proc: Any, folder: Path, out: Path, enc: dict[str, Any],
               start: int, steps: int) -> dict[str, Any]:
    from onnxmedic.hf.seq2seq import export_seq2seq

    t0 = time.perf_counter()
    r = export_seq2seq(model, out, tokenizer=tok, processor=proc, steps=8)
    row: dict[str, Any] = {"export_s": time.perf_counter() - t0, "verified": r.ok}
    if not r.ok:
        row["error"] = "; ".join(f"{f.code} {f.message[:160]}" for f in r.errors[:2])
        return row
    row.update(_ort_loop(out, enc, start, steps))
    if (out / "genai_config.json").exists():
        g = _genai(out, enc, "input_features", start, steps)
        row["genai_tokens"], row["genai_tok_s"] = g.get("tokens"), g.get("tok_s")
    return row


def _builder(model: Any, tok: Any, proc: Any, folder: Path, out: Path, enc: dict[str, Any],
             start: int, steps: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-m",
                        str(folder), "-i", str(folder), "-o", str(out), "-p", "fp32", "-e",
                        "cpu", "-c", str(out.parent / "cache")],
                       capture_output=True, text=True, timeout=1200)
    row: dict[str, Any] = {"export_s": time.perf_counter() - t0}
    if p.returncode or not (out / "genai_config.json").exists():
        lines = [x for x in (p.stderr or p.stdout).strip().splitlines() if x.strip()]
        row["error"] = (lines[-1] if lines else f"exit {p.returncode}")[:300]
        return row
    row.update(_genai(out, enc, "audio_features", start, steps))
    return row


def _exporters(model: Any, tok: Any, proc: Any, folder: Path, out: Path, enc: dict[str, Any],
               start: int, steps: int) -> dict[str, Any]:
    from transformers.exporters import OnnxConfig, OnnxExporter

    t0 = time.perf_counter()
    try:
        ex = OnnxExporter().export_for_generation(model, dict(enc), OnnxConfig(dynamic=True))
        ex.save_pretrained(out)
    except Exception as e:
        return {"export_s": time.perf_counter() - t0, "error": f"{type(e).__name__}: "
                f"{str(e).strip().splitlines()[0][:250] if str(e).strip() else ''}"}
    row: dict[str, Any] = {"export_s": time.perf_counter() - t0}
    try:
        row.update(_exporters_generate(ex, model, enc, start, steps))
    except Exception as e:
        row["error"] = f"generation: {type(e).__name__}: {str(e).splitlines()[0][:250]}"
    return row


def _exporters_generate(ex: Any, model: Any, enc: dict[str, Any], start: int, steps: int
                        ) -> dict[str, Any]:
    """Greedy generation through transformers.exporters' runners: its prefill takes the
    encoder's output (it exports no encoder graph), so PyTorch's encoder gives it."""
    import torch
    from transformers import DynamicCache, EncoderDecoderCache
    from transformers.modeling_outputs import BaseModelOutput

    with torch.no_grad():
        hidden = model.get_encoder()(**enc).last_hidden_state
    pre, dec = ex.runners["prefill"], ex.runners["decode"]
    kw: dict[str, Any] = {"encoder_outputs": BaseModelOutput(last_hidden_state=hidden)}
    if "attention_mask" in enc:
        kw["attention_mask"] = enc["attention_mask"]
    t0 = time.perf_counter()
    out = pre(decoder_input_ids=torch.tensor([[start]]), past_key_values=EncoderDecoderCache(
        DynamicCache(), DynamicCache()), **kw)
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(1, steps):
        out = dec(decoder_input_ids=torch.tensor([[tokens[-1]]]),
                  past_key_values=out.past_key_values, **kw)
        tokens.append(int(out.logits[0, -1].argmax()))
    return {"tokens": tokens, "tok_s": steps / (time.perf_counter() - t0)}


def one(tool: str, name: str, root: Path, steps: int) -> dict[str, Any]:
    """One tool on one model, in this process."""
    from onnxmedic.hf.seq2seq import start_token
    from onnxmedic.hf.seq2seq_verify import torch_generation

    model, tok, proc, folder = _load(name, root)
    enc = _inputs(model, tok, proc)
    start = start_token(model)
    want, _ = torch_generation(model, enc, steps, start)
    out = root / tool / name
    out.parent.mkdir(parents=True, exist_ok=True)
    fn = {"onnxmedic": _onnxmedic, "genai-builder": _builder,
          "transformers.exporters": _exporters}[tool]
    row = {"tool": tool, "family": name, **fn(model, tok, proc, folder, out, enc, start, steps)}
    got = row.get("tokens")
    row["correct"] = bool(got) and "error" not in row and got == want
    if "genai_tokens" in row:
        row["genai_correct"] = row["genai_tokens"] == want
    row["torch_tokens"] = want
    row["size_mb"] = _size(out) / 2**20 if out.exists() else None
    row["peak_mib"] = _peak_mib()
    return row


def _table(rows: list[dict[str, Any]], command: str) -> str:
    import datetime
    import os
    import platform

    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo")
                if x.startswith("model name")), platform.processor())
    lines = [f"`{command}` · {datetime.date.today()} · {cpu}, {os.cpu_count()} cores (shared) "
             "· CPU onnxruntime, float32", "",
             "| model | tool | generates correctly | export s | peak MiB | ONNX MB | tokens/s "
             "| onnxruntime-genai |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = "yes" if r["correct"] else f"no: {r.get('error', 'tokens differ')}"[:200]
        fmt = lambda k, f: f.format(r[k]) if r.get(k) is not None else "-"  # noqa: E731
        genai = "-"
        if "genai_correct" in r:
            genai = ("yes" if r["genai_correct"] else "no") + \
                (f", {r['genai_tok_s']:.0f} tokens/s" if r.get("genai_tok_s") else "")
        elif r["tool"] == "genai-builder" and r["correct"]:
            genai = "yes (its own runtime)"
        lines.append(f"| {r['family']} | {r['tool']} | {ok.replace('|', '/')} | "
                     f"{fmt('export_s', '{:.1f}')} | {fmt('peak_mib', '{:.0f}')} | "
                     f"{fmt('size_mb', '{:.2f}')} | {fmt('tok_s', '{:.0f}')} | {genai} |")
    lines += ["", "| tool | models generating correctly |", "|---|---|"]
    for tool in TOOLS:
        mine = [r for r in rows if r["tool"] == tool]
        lines.append(f"| {tool} | {sum(r['correct'] for r in mine)} of {len(mine)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from bench.zoo.seq2seq import ENCODER_DECODERS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(ENCODER_DECODERS))
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--root", default=str(ROOT / "build" / "seq2seq_peers"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "seq2seq_peers.md"))
    ap.add_argument("--one", nargs=2, metavar=("TOOL", "MODEL"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    root = Path(a.root)
    if a.one:
        print(json.dumps(one(a.one[0], a.one[1], root, a.steps)))
        return
    seed_from_table(root, Path(a.out), _table_rows)
    command = ("python bench/peers/seq2seq.py " + " ".join(sys.argv[1:])).strip()
    for name in a.models.split(","):
        for tool in a.tools.split(","):
            row = _run_one(tool, name, root, a.steps)
            with open(root / "results.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            Path(a.out).write_text(_table(_rows(root), command))
            print(f"{name:8s} {tool:24s} {row['correct']} {row.get('export_s', 0):.1f}s "
                  f"{row.get('error', '')[:120]}", flush=True)


def _table_rows(text: str) -> list[dict[str, Any]]:
    """The rows of a table that ``_table`` wrote, read back (what it shows: errors as
    truncated there; the onnxruntime-genai column's verdict and tokens/s)."""
    rows = []
    for line in text.splitlines():
        cells = [c[1:-1] for c in line.strip()[1:-1].split("|")]  # "| a | b |": a, b
        if len(cells) != 8 or cells[1] not in TOOLS:
            continue
        name, tool, ok, *nums, genai = cells
        row: dict[str, Any] = {"tool": tool, "family": name, "correct": ok == "yes"}
        if not row["correct"] and ok != "no: tokens differ":
            row["error"] = ok[len("no: "):]
        for key, cell in zip(("export_s", "peak_mib", "size_mb", "tok_s"), nums):
            if cell != "-":
                row[key] = float(cell)
        if genai.startswith(("yes", "no")) and genai != "yes (its own runtime)":
            verdict, _, speed = genai.partition(", ")
            row["genai_correct"] = verdict == "yes"
            row["genai_tok_s"] = float(speed.split()[0]) if speed else None
        rows.append(row)
    return rows


def _rows(root: Path) -> list[dict[str, Any]]:
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for line in (root / "results.jsonl").read_text().splitlines():
        r = json.loads(line)
        rows[(r["family"], r["tool"])] = r
    return list(rows.values())


def _run_one(tool: str, name: str, root: Path, steps: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", tool, name, "--root", str(root), "--steps",
           str(steps)]
    proc = None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except Exception as e:
        text = proc.stderr.strip().splitlines()[-1] if proc is not None and \
            proc.stderr.strip() else str(e)
        return {"tool": tool, "family": name, "correct": False, "error": text[:300]}


if __name__ == "__main__":
    main()
