"""Generation packages at the sizes people deploy: onnxmedic against the onnxruntime-genai
model builder on bf16 checkpoints of published shapes (random weights, seeded), one tool after
the other on the same folder.

For each tool, one process of its own (and its children): the wall time, the peak resident
memory of the process tree, sampled every 0.1 s from /proc/PID/status (VmRSS, and its
anonymous and file-backed parts, RssAnon and RssFile, each summed over the tree; each column
is its own peak), the size of the package's ONNX files; then onnxruntime-genai generating from
the package (a child of its own): the prefill of a 128-token prompt (tokens/s) and the decode
of the tokens after it (tokens/s), greedy, float32 CPU.

    python bench/peers/generation_scale.py --shape qwen2.5-0.5b [--layers N]
        [--tools onnxmedic,genai-builder] [--root /tmp/lane52] [--cap-gib 10]
    python bench/peers/generation_scale.py --shape qwen2.5-1.5b --make-only

A run whose tree passes ``--cap-gib`` is killed (its row says so): the machine is shared.
``--layers`` overrides the shape's number of decoder layers (the checkpoint is written as
SHAPE-LN), so that two runs give the peak's slope per layer. The checkpoint is written one
decoder layer per safetensors shard, each tensor made and written in turn: never the whole
model in memory (about one layer's float32 weights at a time).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# the published shapes (the models' own config.json figures)
_QWEN = dict(model_type="qwen2", max_position_embeddings=32768, rope_theta=1000000.0,
             rms_norm_eps=1e-6, vocab_size=151936, tie_word_embeddings=True)
_LLAMA = dict(model_type="llama", max_position_embeddings=131072, rope_theta=500000.0,
              rms_norm_eps=1e-5, vocab_size=128256,
              rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                            "original_max_position_embeddings": 8192,
                            "rope_type": "llama3"})
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(_QWEN, hidden_size=896, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864),
    "qwen2.5-1.5b": dict(_QWEN, hidden_size=1536, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960),
    "llama-3.2-3b": dict(_LLAMA, hidden_size=3072, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8,
                         intermediate_size=8192, head_dim=128, tie_word_embeddings=True),
    "llama-3.1-8b": dict(_LLAMA, hidden_size=4096, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, head_dim=128, tie_word_embeddings=False),
    # a family onnxruntime-genai's builder does not serve: onnxmedic's stamped road
    # (hf/stamp.py) at size
    "pythia-1.4b": dict(model_type="gpt_neox", hidden_size=2048, num_hidden_layers=24,
                        num_attention_heads=16, intermediate_size=8192, vocab_size=50304,
                        max_position_embeddings=2048, rotary_pct=0.25, rotary_emb_base=10000,
                        layer_norm_eps=1e-5, use_parallel_residual=True,
                        tie_word_embeddings=False, hidden_act="gelu"),
}
# onnxmedic: `export` (the default backend: the builder's package, verified whole-model);
# onnxmedic-int4: `export --precision int4 --accuracy LOOSE` (at size, the streamed road: the
# builder's int4 graph with the weights quantized from the checkpoint as it makes them,
# hf/transforms/int4_writer.py, then judged streamed); onnxmedic-int4-default: the same under
# the default task budget (for --init margin checkpoints); genai-builder: the builder alone; builder-stream: the builder, then its package verified
# streamed (python -m onnxmedic.hf.stream), one process tree; -int4: the builder's -p int4;
# stream-int4: the builder's float32 package made int4 and judged streamed
# (python -m onnxmedic.hf.transforms.stream_int4), one process tree; stream-int4-loose: the
# same with the budget LOOSE, so that the random checkpoint's package is written and served
TOOLS = ("onnxmedic", "onnxmedic-int4", "onnxmedic-int4-default", "genai-builder", "builder-stream", "stream-int4", "stream-int4-loose",
         "genai-builder-int4")
# random weights make near-uniform logits over a large vocabulary: greedy picks are ties that
# int4's rounding flips (Qwen2.5-1.5B's shape: 5-14 % agreement, perplexity within 3 %; the
# 4-bit tied embedding of the builder's layout flips more of them than a float32 one); the
# loose budget (the perplexity's +5 % holds, the agreement is the ties') measures the whole
# road's cost (genai serving included) on such a checkpoint, not its accuracy
LOOSE = "agreement=1%"
STD = 0.02  # transformers' initializer_range: the weights' normal deviation
# --init: how the random weights are drawn. "default": transformers' own (every matrix and the
# embedding normal(0, STD)): its logits are flat and chaotic (every greedy pick a near tie that
# int4 flips), so only the loose budget writes its package. "margin": a checkpoint whose
# greedy picks have a margin, so that the DEFAULT task budget can judge its int4 package:
# the residual output projections (o_proj, down_proj) at STD / sqrt(2 * layers) (GPT-2's and
# Megatron's scaled init), the embedding at EMBED_STD and an untied head drawn equal to the
# embedding (as a tied model's): where the token's own embedding outweighs the layers' sum in
# the residual stream, the model's pick is its input token, by a margin (Qwen2.5-1.5B's shape
# at 14 layers: ~25 logits; its int4 package passes the default budget, 100 % agreement). At
# Llama-3.1-8B's shape (hidden 4096, 32 layers) the layers' sum (rms ~1.9: a layer's output
# grows with sqrt(hidden) at a fixed STD) outweighs it and the budget refuses the package
# (73 % agreement, perplexity +11 %). What a pass shows: the package computes the checkpoint's
# function within the budget, not that a trained model's near ties survive int4.
# "scaled": the margin init with every deviation scaled to the hidden size, so that the picks'
# margin does not shrink with it (SCALED_NOTE; measured by bench/peers/generation_margin.py)
INITS = ("default", "margin", "scaled")
EMBED_STD = 0.125
EMBED_NORM = 4.9  # scaled: the embedding's rows' expected norm (EMBED_STD * sqrt(1536))
SCALED_NOTE = (
    "Checkpoints named -scaled: `--init scaled`, -margin's layout with every deviation scaled "
    "to the hidden size, so that the greedy picks' margin does not shrink as it grows: the "
    "matrices at normal(0, sqrt(2 / (5 * hidden))) (the \"small init\" of Nguyen and Salazar, "
    "GPT-NeoX's and Pythia's: 0.016 at hidden 1536, 0.0099 at 4096, where Megatron's 8 B "
    "recipes set 0.01), the residual output projections o_proj and down_proj at that / "
    "sqrt(2 * layers) (GPT-2's scaling), the embedding at normal(0, "
    f"{EMBED_NORM} / sqrt(hidden)) (rows of norm ~{EMBED_NORM} at every hidden size: 0.125 at "
    "1536, as -margin's, 0.077 at 4096) and an untied head drawn equal to the embedding (a tied "
    "model's). The layers' sum in the residual stream no longer grows with sqrt(hidden), and "
    "the logits' top-2 gap stays put: measured by `python bench/peers/generation_margin.py "
    "--shape SHAPE --layers 2 --init INIT` (float32 logits along greedy sequences from the "
    "task budget's 4 prompts, 32 steps each, against the same model with every Linear rounded "
    "to 4-bit blocks of 32 and its inputs to int8, as MatMulNBits at accuracy level 4), the "
    "top-2 gap's 5th percentile / median: qwen2.5-1.5b scaled 39.7 / 44.0 logits (8.1 / 9.0 "
    "deviations of the position's logits), llama-3.1-8b scaled 42.8 / 57.9 (8.7 / 11.8), "
    "against qwen2.5-1.5b margin 11.6 / 14.7 (2.4 / 3.0); greedy agreement 100 % in all three. "
    "What the init is: the margin is the tied embedding's (the token's own row scores ~c^2 "
    "against the others' normal(0, c), c the rows' norm), so every greedy pick is the input "
    "token (measured: 100 % of the picks in all three, -margin's included) and the text's "
    "perplexity is astronomical (the next token is never the input token). A pass shows that "
    "int4 keeps that margin through every layer and the head, that the perplexity over the "
    "whole vocabulary's logits stays within the budget, and that onnxruntime-genai serves the "
    "package token for token; not that a trained model's near ties survive int4.")
PREFILL = 128
DECODE = 32
TOKENIZER_VOCAB = 4096

GENAI_CHILD = r"""
import json, sys, time
import onnxruntime_genai as og
folder, ids, steps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
model = og.Model(folder)
def once():
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + steps, do_sample=False)
    gen = og.Generator(model, params)
    t0 = time.perf_counter()
    gen.append_tokens(ids)
    gen.generate_next_token()
    t1 = time.perf_counter()
    n = 0
    while not gen.is_done() and n < steps - 1:
        gen.generate_next_token()
        n += 1
    return t1 - t0, n, time.perf_counter() - t1
once()
runs = [once() for _ in range(2)]
pre = sorted(r[0] for r in runs)[0]
dec = sorted(r[2] / max(r[1], 1) for r in runs)[0]
print(json.dumps({"prefill_tok_s": len(ids) / pre, "decode_tok_s": 1 / dec}))
"""


def _std(name: str, init: str, layers: int, hidden: int) -> float:
    """The normal deviation of the matrix ``name`` under ``init`` (see INITS) in a model of
    ``layers`` decoder layers and hidden size ``hidden``."""
    if init == "default":
        return STD
    base = STD if init == "margin" else (2 / (5 * hidden)) ** 0.5  # scaled: small init
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return EMBED_STD if init == "margin" else EMBED_NORM / hidden ** 0.5
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return base / (2 * layers) ** 0.5
    return base


def shape_config(shape: str, layers: int | None) -> dict[str, Any]:
    cfg = dict(SHAPES[shape], bos_token_id=1, eos_token_id=2, pad_token_id=0,
               torch_dtype="bfloat16", initializer_range=STD)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    return cfg


def _init(name: str, shape: tuple[int, ...], seed: int, std: float = STD) -> Any:
    """One tensor as transformers initialises it (normal(0, ``std``) for matrices and
    embeddings, ones for norms, zeros for biases), in bf16, made in row chunks (a float32 copy
    of at most 64 Mi elements at a time)."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    out = torch.empty(shape, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    rows = max(1, (64 << 20) // max(1, out[0].numel()))
    for i in range(0, shape[0], rows):
        out[i:i + rows] = (torch.randn((min(rows, shape[0] - i),) + shape[1:], generator=g)
                           * std).to(torch.bfloat16)
    return out


def make_checkpoint(shape: str, root: Path, layers: int | None = None, seed: int = 0,
                    init: str = "default") -> Path:
    """``root/SHAPE[-LN][-INIT]``: a bf16 checkpoint of the published shape with seeded random
    weights drawn as ``init`` says (INITS) and a tokenizer, written layer by layer (one
    safetensors shard per decoder layer, one for the rest); made once."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench.zoo.generation import train_tokenizer

    folder = root / (shape + (f"-l{layers}" if layers is not None else "") +
                     (f"-{init}" if init != "default" else ""))
    if (folder / "model.safetensors.index.json").exists() and \
            (folder / "tokenizer.json").exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    cfg = shape_config(shape, layers)
    config = AutoConfig.for_model(**cfg)
    with torch.device("meta"):  # names and shapes only: no weights
        meta = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(meta).__name__]  # what the builder reads the family from
    names = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    if config.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    groups: dict[str, list[str]] = {}
    for k in names:
        parts = k.split(".")
        key = parts[2] if len(parts) > 3 and parts[1] == "layers" else "rest"
        groups.setdefault(key, []).append(k)
    keys = sorted(groups, key=lambda g: (g == "rest", int(g) if g.isdigit() else 0))
    index: dict[str, str] = {}
    total = 0
    for n, key in enumerate(keys):
        shard = f"model-{n + 1:05d}-of-{len(keys):05d}.safetensors"
        # (margin: the untied head drawn with the embedding's seed, so equal to it)
        same = {"lm_head.weight": "model.embed_tokens.weight"} if init != "default" else {}
        tensors = {k: _init(k, names[k], seed * 1_000_003 + sorted(names).index(same.get(k, k)),
                            _std(k, init, config.num_hidden_layers, config.hidden_size))
                   for k in groups[key]}
        save_file(tensors, str(folder / shard), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        index.update(dict.fromkeys(tensors, shard))
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": index}, indent=1))
    config.save_pretrained(folder)
    train_tokenizer(folder, vocab=TOKENIZER_VOCAB)
    return folder


def weight_bytes(folder: Path) -> int:
    return int(json.loads((folder / "model.safetensors.index.json").read_text())
               ["metadata"]["total_size"])


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc/*/stat's parent ids)."""
    parent: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parent.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += parent.get(p, [])
    return out


def _status_kib(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(val.split()[0])
    except OSError:
        pass
    return out


def tree_memory(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile, RssShmem (KiB) summed over ``pid``'s process tree."""
    total = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0, "RssShmem": 0}
    for p in _tree(pid):
        for k, v in _status_kib(p).items():
            total[k] += v
    return total


def measured(cmd: list[str], env: dict[str, str], cap_gib: float, timeout: float = 7200
             ) -> dict[str, Any]:
    """Run ``cmd``: its wall seconds, the CPU seconds of its process tree (user and system,
    of the processes reaped), exit code, the peaks (GiB) of its process tree's resident
    memory and of its anonymous and file-backed parts, the last lines of its output; killed
    (``capped``) when the tree passes ``cap_gib``."""
    import resource

    def cpu() -> float:
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        return ru.ru_utime + ru.ru_stime

    t0, c0 = time.perf_counter(), cpu()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT, start_new_session=True)
    peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
    capped = threading.Event()
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            m = tree_memory(proc.pid)
            for k in peak:
                peak[k] = max(peak[k], m[k])
            if m["VmRSS"] > cap_gib * 2**20:
                capped.set()
                os.killpg(proc.pid, 9)
                return
            done.wait(0.1)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
    done.set()
    thread.join()
    g = 2**20
    return {"wall_s": time.perf_counter() - t0, "cpu_s": cpu() - c0, "rc": proc.returncode,
            "capped": capped.is_set(), "peak_gib": peak["VmRSS"] / g,
            "anon_gib": peak["RssAnon"] / g, "file_gib": peak["RssFile"] / g,
            "tail": out.strip().splitlines()[-3:]}


def _size_gb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if ".onnx" in p.name) / 1e9


def tool_command(tool: str, ckpt: Path, out: Path) -> list[str]:
    """The command line of ``tool`` building the package of ``ckpt`` at ``out``."""
    py = sys.executable
    if tool.startswith("onnxmedic"):  # onnxmedic-int4: --precision int4 (at size: streamed)
        return [py, "-m", "onnxmedic", "export", f"hf:{ckpt}", "--task",
                "text-generation-with-past", "-o", str(out), "--no-progress", "--report",
                str(out.parent / f"{out.name}_report.json")] + (
            ["--precision", "int4"] if tool.startswith("onnxmedic-int4") else []) + (
            ["--accuracy", LOOSE] if tool == "onnxmedic-int4" else [])
    precision = "int4" if tool.endswith("-int4") and not tool.startswith("stream-int4") \
        else "fp32"
    cmd = [py, "-m", "onnxruntime_genai.models.builder", "-m", str(ckpt), "-i", str(ckpt),
           "-o", str(out), "-p", precision, "-e", "cpu", "-c", str(out.parent / "cache")]
    if tool.startswith("builder-stream"):  # then the streamed verification (hf/stream.py)
        verify = [py, "-m", "onnxmedic.hf.stream", str(out), str(ckpt)]
        return ["sh", "-c", " ".join(cmd) + " && " + " ".join(verify)]
    if tool.startswith("stream-int4"):  # the builder's float32 package, then int4 streamed
        fp32 = out.parent / f"{out.name}-fp32"
        cmd[cmd.index("-o") + 1] = str(fp32)
        int4 = [py, "-m", "onnxmedic.hf.transforms.stream_int4", str(fp32), str(ckpt), "-o",
                str(out)] + (["--accuracy", LOOSE] if tool.endswith("-loose") else [])
        return ["sh", "-c", " ".join(cmd) + " && " + " ".join(int4) + f"; rc=$?; rm -rf {fp32}; "
                "exit $rc"]
    return cmd


def build(tool: str, ckpt: Path, out: Path, env: dict[str, str], cap: float
          ) -> dict[str, Any]:
    """One tool's package of ``ckpt`` at ``out``, measured."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(out.parent / "cache", ignore_errors=True)
    cmd = tool_command(tool, ckpt, out)
    shown = cmd[-1].replace(sys.executable, "python") if cmd[0] == "sh" else " ".join(
        ["python"] + cmd[1:])
    row = {"tool": tool, "command": shown, **measured(cmd, env, cap)}
    row["size_gb"] = _size_gb(out) if out.exists() else None
    row["ok"] = row["rc"] == 0 and (out / "genai_config.json").exists()
    row.update(stages(out.parent / f"{out.name}_report.json"))
    if tool.startswith(("builder-stream", "stream-int4")) and row["tail"]:
        try:  # the streamed verification's verdict, its last line
            row["verdict"] = json.loads(row["tail"][-1])
        except ValueError:
            pass
    shutil.rmtree(out.parent / "cache", ignore_errors=True)
    return row


def stages(report: Path) -> dict[str, Any]:
    """onnxmedic's seconds per stage of the int4 road (its report's timings: the writer, the
    int4 decoder's scoring in ONNX Runtime, PyTorch's streamed passes, onnxruntime-genai's
    check), {} without a report."""
    try:
        timings = json.loads(report.read_text()).get("timings") or {}
    except (OSError, ValueError):
        return {}
    got = {k[5:]: round(v, 1) for k, v in timings.items() if k.startswith("int4 ")}
    return {"stages_s": got} if got else {}


def stage_cells(stages: dict[str, float]) -> str:
    """``write+torch-windows 69/70 (40+28) genai+onnx-windows 30/33 (14+19)``: each stage's
    wall seconds, and its CPU seconds where the report has them (``<stage> cpu``); a stage
    of sides that ran beside each other (``a+b``) with each side's own CPU seconds
    (``<side> own cpu``) in brackets."""
    def cell(k: str, v: float) -> str:
        own = [stages.get(f"{p} own cpu") for p in k.split("+")]
        return (f"{k} {v:.0f}" + (f"/{stages[k + ' cpu']:.0f}" if k + " cpu" in stages
                                  else "")
                + (f" ({'+'.join(f'{c:.0f}' for c in own)})"
                   if "+" in k and None not in own else ""))

    return " ".join(cell(k, v) for k, v in stages.items() if not k.endswith(" cpu"))


def genai_speed(folder: Path, env: dict[str, str], cap: float) -> dict[str, Any]:
    """onnxruntime-genai's prefill of PREFILL tokens and decode of DECODE after it (the
    better of two runs after a warm-up), and that child's peak."""
    ids = [4 + (i * 37) % (TOKENIZER_VOCAB - 4) for i in range(PREFILL)]
    cmd = [sys.executable, "-c", GENAI_CHILD, str(folder), json.dumps(ids), str(DECODE)]
    m = measured(cmd, env, cap, timeout=1800)
    if m["rc"] != 0:
        return {"genai_error": " ".join(m["tail"])[:300], "genai_peak_gib": m["peak_gib"]}
    return dict(json.loads(m["tail"][-1]), genai_peak_gib=m["peak_gib"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--root", default=str(ROOT / "build" / "gen_scale"))
    ap.add_argument("--cap-gib", type=float, default=10.0)
    ap.add_argument("--init", choices=INITS, default="default",
                    help="how the random weights are drawn (INITS in the script)")
    ap.add_argument("--make-only", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the packages")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "generation_scale.md"))
    a = ap.parse_args()
    root = Path(a.root)
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ckpt = make_checkpoint(a.shape, root / "checkpoints", a.layers, init=a.init)
    print(f"checkpoint {ckpt} ({weight_bytes(ckpt) / 2**30:.2f} GiB, "
          f"{time.perf_counter() - t0:.0f} s)", flush=True)
    if a.make_only:
        return
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    results = root / "results.json"
    rows: list[dict[str, Any]] = json.loads(results.read_text()) if results.exists() else []
    for tool in a.tools.split(","):
        out = root / "packages" / f"{ckpt.name}-{tool}"
        out.parent.mkdir(parents=True, exist_ok=True)
        row = build(tool, ckpt, out, env, a.cap_gib)
        if row["ok"]:
            row.update(genai_speed(out, env, a.cap_gib))
        if not a.keep:
            shutil.rmtree(out, ignore_errors=True)
        row.update(checkpoint=ckpt.name, weights_gib=weight_bytes(ckpt) / 2**30,
                   layers=json.loads((ckpt / "config.json").read_text())["num_hidden_layers"],
                   date=str(datetime.date.today()), cpu=cpu_name())
        print(json.dumps(row), flush=True)
        rows = [r for r in rows if (r["checkpoint"], r["tool"]) != (ckpt.name, tool)] + [row]
        results.write_text(json.dumps(rows, indent=1))
    Path(a.out).write_text(table(rows))
    print(Path(a.out).read_text())


def cpu_name() -> str:
    """This machine's CPU model name (/proc/cpuinfo's)."""
    with open("/proc/cpuinfo") as fh:
        return next((x.split(":", 1)[1].strip() for x in fh if x.startswith("model name")),
                    platform.processor())


def table(rows: list[dict[str, Any]]) -> str:
    """The results file as a markdown table (one row per checkpoint and tool)."""
    import onnxruntime
    import onnxruntime_genai

    lines = [f"`python bench/peers/generation_scale.py --shape SHAPE [--layers N] --tools "
             f"TOOLS --root ROOT` (one row per run; its command in the last column) · "
             f"{os.cpu_count()} cores, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} "
             f"GiB (shared); the CPU each row ran on in its machine column (compare rows of one "
             f"machine only) · onnxruntime {onnxruntime.__version__}, onnxruntime-genai "
             f"{onnxruntime_genai.__version__} · peaks: the process tree's, sampled every "
             f"0.1 s from /proc/PID/status, each column its own peak · genai: float32 CPU, "
             f"prefill of {PREFILL} tokens, decode of {DECODE} after it · int4 stages: "
             f"onnxmedic's seconds per stage of the int4 road (write: the writer child; onnx: "
             f"the int4 decoder's scoring in ONNX Runtime; torch: PyTorch's streamed passes; "
             f"genai: onnxruntime-genai's check; a+b: a and b beside each other, -windows: "
             f"over the text's windows, onnx-confirm: ONNX Runtime confirming genai's tokens, "
             f"torch-picks: PyTorch along them), from its report, each as wall/CPU seconds "
             f"(CPU: its process's and the children's it reaped; for a+b, each side's own in "
             f"brackets) · cpu s: the process tree's user and system seconds", "",
             "| checkpoint | layers | bf16 weights GiB | tool | built | wall s | cpu s | peak GiB | "
             "anon GiB | file GiB | peak / weights | package GB | prefill-128 tok/s | "
             "decode tok/s | int4 stages s | date | machine | command |", "|---" * 18 + "|"]
    for r in sorted(rows, key=lambda r: (r["weights_gib"], r["tool"])):
        built = "yes" if r["ok"] else ("no: killed at the cap" if r.get("capped") else
                                       "no: " + " ".join(r.get("tail", []))[:80])
        at_least = ">= " if r.get("capped") else ""  # killed there: it would have grown
        f = lambda k, p=1: "-" if r.get(k) is None else f"{r[k]:.{p}f}"  # noqa: E731
        lines.append(
            f"| {r['checkpoint']} | {r['layers']} | {r['weights_gib']:.2f} | {r['tool']} | "
            f"{built} | {r['wall_s']:.0f} | {f('cpu_s', 0)} | {at_least}{r['peak_gib']:.2f} | "
            f"{r['anon_gib']:.2f} | {r['file_gib']:.2f} | "
            f"{at_least}{r['peak_gib'] / r['weights_gib']:.2f} | "
            f"{f('size_gb', 2)} | {f('prefill_tok_s')} | {f('decode_tok_s')} | "
            f"{stage_cells(r.get('stages_s', {})) or '-'} | "
            f"{r['date']} | {r.get('cpu', 'not recorded')} | "
            f"`{r['command'].replace(str(ROOT) + '/', '')}` |")
    if any(r["checkpoint"].endswith("-margin") for r in rows):
        lines += ["", "Checkpoints named -margin: `--init margin` (the random weights drawn so "
                  "that the model's greedy picks have a margin, which the default task budget "
                  "needs: the residual output projections o_proj and down_proj at normal(0, "
                  f"{STD} / sqrt(2 * layers)), GPT-2's and Megatron's scaled init; the "
                  f"embedding at normal(0, {EMBED_STD}); an untied head drawn equal to the "
                  "embedding). Where the token's own embedding outweighs the layers' sum in "
                  "the residual stream, the model's pick is its input token by a margin "
                  "(~25 logits at qwen2.5-1.5b-l14); at llama-3.1-8b's hidden 4096 and 32 "
                  "layers the layers' sum outweighs it (a layer's output grows with "
                  "sqrt(hidden) at a fixed deviation) and the picks are near ties again. "
                  "onnxmedic-int4-default: `export --precision int4` under the DEFAULT task "
                  "budget (perplexity within +5 %, >= 95 % of greedy tokens identical; the "
                  "default init's flat logits give 0-14 % agreement). What a pass shows: the "
                  "package computes the checkpoint's function within the budget and "
                  "onnxruntime-genai serves it token for token, not that a trained model's "
                  "near ties survive int4."]
    if any(r["checkpoint"].endswith("-scaled") for r in rows):
        lines += ["", SCALED_NOTE]
    lines += slopes(rows)
    return "\n".join(lines) + "\n"


def slopes(rows: list[dict[str, Any]]) -> list[str]:
    """The peak's growth per decoder layer added, for each tool measured at two layer counts
    of one shape (the checkpoint's name without its -lN) on one machine (rows of different
    CPUs are not paired), against one layer's bf16 weights."""
    out = []
    by: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r["ok"]:
            name = r["checkpoint"]  # its shape (and its init: -margin), its -lN dropped
            shape = re.sub(r"-l\d+(?=-|$)", "", name)
            by.setdefault((shape, r["tool"], r.get("cpu", "not recorded")), []).append(r)
    for (shape, tool, cpu), rs in sorted(by.items()):
        rs = sorted(rs, key=lambda r: r["layers"])
        if len(rs) < 2 or rs[0]["layers"] == rs[-1]["layers"]:
            continue
        a, b = rs[0], rs[-1]
        dl = b["layers"] - a["layers"]
        per_layer_w = (b["weights_gib"] - a["weights_gib"]) / dl
        out.append(f"| {shape} | {tool} | {cpu} | {a['layers']} -> {b['layers']} | "
                   f"{1024 * (b['peak_gib'] - a['peak_gib']) / dl:.0f} | "
                   f"{1024 * (b['anon_gib'] - a['anon_gib']) / dl:.0f} | "
                   f"{1024 * per_layer_w:.0f} | "
                   f"{(b['peak_gib'] - a['peak_gib']) / (b['weights_gib'] - a['weights_gib']):.2f} |")
    if out:
        out = ["", "| shape | tool | machine | layers | peak MiB per layer added | anon MiB per "
               "layer | one layer's bf16 weights MiB | slope / weights |", "|---" * 8 + "|"] + out
    return out


if __name__ == "__main__":
    main()
