"""int4 decoders against onnxruntime-genai's model builder, on the same trained model folder.

    pip install --no-deps --target build/genai onnxruntime-genai   # needs numpy, onnxruntime>=1.31
    python bench/peers/int4.py --preset figures

The model is bench/accuracy/train_decoder.py's (trained here, cached under build/decoders).
The files: onnxmedic's verified float32 decoder step; its ``optimize --precision int4
--calibration TEXT`` choice (optimize/int4_search.py: the default RTN grid, HQQ at blocks 32
and 128, and the GPTQ grid calibrated on TEXT - the last six standard-library modules by name,
which the model was not trained on), and the fastest candidate within the budget of each
algorithm (RTN, HQQ, GPTQ) rebuilt; the builder's ``-p fp32`` and ``-p int4`` packages
(``-e cpu``) of the same folder; and Olive's int4 recipe where Olive runs (``--olive``:
olive-ai in build/olive, see :func:`olive_int4`; its failure is recorded otherwise). Each is measured in its own child process
with ONNX Runtime's CPU provider and 2 intra-op threads: decode tokens/s (one token after a
past of 128, median of 50 runs), prefill tokens/s (128 tokens from an empty past, median of
10), the child's peak RSS from loading the session on (after importing onnxruntime and numpy;
``/proc/self/clear_refs``), the file size, and the task figures of optimize/int4.py against
PyTorch float32 (perplexity on the built-in text, greedy agreement over 32 steps from 4
prompts, teacher-forced and free-running; perplexity on the held-out part of TEXT). Results:
bench/results/int4_peers.md and .json.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
GENAI = ROOT / "build" / "genai"
RESULTS = ROOT / "bench" / "results"


def _train_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "train_decoder", ROOT / "bench" / "accuracy" / "train_decoder.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def genai_step(path: str, threads: int = 2) -> Any:
    """A step function (optimize/int4.py's contract: ids, flat past [k0, v0, ...] -> logits,
    present) over a builder package's model.onnx (attention_mask, past_key_values.N.key)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    layers = sum(1 for i in sess.get_inputs() if i.name.endswith(".key"))
    outs = ["logits"] + [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]

    def step(ids: np.ndarray, past: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        total = past[0].shape[2] + ids.shape[1]
        feeds = {"input_ids": ids, "attention_mask": np.ones((1, total), np.int64)}
        for i in range(layers):
            feeds[f"past_key_values.{i}.key"] = past[2 * i]
            feeds[f"past_key_values.{i}.value"] = past[2 * i + 1]
        res = sess.run(outs, feeds)
        return res[0], res[1:]

    return step


def _median_ms(step: Any, ids: np.ndarray, past: list[np.ndarray], n: int) -> float:
    step(ids, past)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        step(ids, past)
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def measure_child(req_path: str) -> None:
    """One file: speed, peak memory and task figures (run as a child: its own peak RSS)."""
    # optimize/int4.py alone (numpy at its top): not onnxmedic's package, which imports torch
    spec = importlib.util.spec_from_file_location(
        "int4_alone", ROOT / "src" / "onnxmedic" / "optimize" / "int4.py")
    int4 = importlib.util.module_from_spec(spec)
    sys.modules["int4_alone"] = int4  # dataclasses look their module up
    spec.loader.exec_module(int4)
    import onnxruntime  # noqa: F401 - imported before the peak is reset

    req = json.loads(Path(req_path).read_text())
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM): the file's own
    step = (genai_step if req["kind"] == "genai" else int4.ort_step)(req["path"], 2)
    heads, dim, layers = req["heads"], req["head_dim"], req["layers"]
    rng = np.random.default_rng(0)
    past128 = [rng.standard_normal((1, heads, 128, dim)).astype(np.float32)
               for _ in range(2 * layers)]
    empty = [np.zeros((1, heads, 0, dim), np.float32) for _ in range(2 * layers)]
    decode = _median_ms(step, np.asarray([[5]], np.int64), past128, 50)
    prefill = _median_ms(step, rng.integers(4, 100, (1, 128)).astype(np.int64), empty, 10)
    hwm = next(int(ln.split()[1]) for ln in Path("/proc/self/status").read_text().splitlines()
               if ln.startswith("VmHWM"))
    data = int4.TaskData(req["prompts"], req["text"])
    got = int4.score(step, empty, data, 32, req["reference"])
    nll, n = int4.mean_nll(step, empty, req["held"])
    got["user_perplexity"] = float(np.exp(nll / n))
    out = {"decode_tokens_s": 1000 / decode, "prefill_tokens_s": 128 * 1000 / prefill,
           "peak_rss_mib": hwm / 1024,
           "process_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           **got}
    Path(req["out"]).write_text(json.dumps(out))


def build_genai(folder: Path, precision: str) -> Path:
    """The builder's package of ``folder`` (-p precision -e cpu), cached beside it."""
    out = folder / f"genai_{precision}"
    if not (out / "model.onnx").exists():
        env = dict(os.environ, PYTHONPATH=str(GENAI))
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i",
                        str(folder), "-o", str(out), "-p", precision, "-e", "cpu", "-c",
                        str(folder / "genai_cache")], check=True, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out / "model.onnx"


def file_mib(path: Path) -> float:
    return (path.stat().st_size + sum(f.stat().st_size for f in path.parent.glob(
        path.name + ".data"))) / 2**20


HQQ_CELLS = [(32, 4, "int4", "hqq"), (128, 4, "int4", "hqq")]


def calibration_text(folder: Path, chars: int = 60_000) -> Path:
    """TEXT for --calibration: the last six standard-library modules by name (the model trains
    on the first ones), written into the model folder."""
    import sysconfig

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[-6:]
    out = folder / "calibration.txt"
    out.write_text("\n".join(f.read_text(encoding="utf-8") for f in files)[:chars])
    return out


def best_per_algorithm(res: Any, plain: Path, folder: Path, windows: str) -> dict[str, Path]:
    """The fastest candidate within the budget of each algorithm, rebuilt into ``folder``
    (optimize_int4 keeps only the one it writes)."""
    from onnxmedic.optimize import int4

    out = {}
    for algo in ("rtn", "hqq", "gptq"):
        ok = [c for c in res.candidates if c.name != "fp32" and c.algo == algo and c.within]
        if not ok:
            continue
        c = min(ok, key=lambda c: c.decode_ms or float("inf"))
        path = folder / f"step_int4_{algo}.onnx"
        int4.quantize_int4(str(plain), str(path), c.block_size, c.accuracy_level, c.lm_head,
                           algo=algo, nodes_to_exclude=c.excluded,
                           calibration=windows if algo == "gptq" else None)
        out[f"onnxmedic int4 {algo.upper()} ({c.name})"] = path
    return out


def olive_int4(folder: Path, plain: Path) -> tuple[Path | None, str]:
    """Olive's int4 recipe for an ONNX decoder on CPU (its OnnxBlockWiseRtnQuantization pass:
    its own symmetric RTN into MatMulNBits) run by ``olive.workflows.run`` (blocks of 128, its default; accuracy level 4) from
    build/olive (``pip install --no-deps --target build/olive olive-ai``, with its missing pure
    dependencies); (None, the failure) where it does not run."""
    out = folder / "olive_int4"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "build" / "olive"),
                                                      os.environ.get("PYTHONPATH", "")]))
    cfg = {"input_model": {"type": "ONNXModel", "model_path": str(plain)},
           "systems": {"local": {"type": "LocalSystem", "accelerators": [
               {"device": "cpu", "execution_providers": ["CPUExecutionProvider"]}]}},
           "passes": {"int4": {"type": "OnnxBlockWiseRtnQuantization", "block_size": 128,
                               "is_symmetric": True, "accuracy_level": 4}},
           "host": "local", "target": "local", "output_dir": str(out), "log_severity_level": 3}
    (folder / "olive.json").write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, "-c", "import sys; from olive.workflows import run; "
                        "run(sys.argv[1])", str(folder / "olive.json")], env=env,
                       cwd=folder, capture_output=True, text=True, timeout=1200)
    found = sorted(out.rglob("*.onnx")) if out.exists() else []
    if r.returncode != 0 or not found:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        return None, f"olive failed (exit {r.returncode}): {tail[0][:200]}"
    return found[0], ""


def run(preset: str, olive: bool = False) -> dict[str, Any]:
    """Build the files, measure each in a child, judge each against PyTorch."""
    from onnxmedic.genpackage import read_step
    from onnxmedic.optimize import int4, int4_text
    from onnxmedic.optimize.int4_search import DEFAULT_GRID, optimize_int4

    td = _train_module()
    folder = td.folder(preset)
    step = td.step_model(preset)
    cfg = step.model.config
    plain = td.export_step(preset, folder / "step.onnx")
    data = int4.builtin_data(step.tokenizer.encode)
    past0 = read_step(plain).empty_past()
    ref = int4.score(int4.torch_step(step), past0, data, 32)
    text = calibration_text(folder)
    user = int4_text.load_user_text(text, step.tokenizer, folder)
    nll, n = int4.mean_nll(int4.torch_step(step), past0, user.held)
    user_ref = float(np.exp(nll / n))
    t = time.perf_counter()
    res = optimize_int4(plain, step, out=folder / "step_int4.onnx", data=data,
                        reference_scores=ref, tokenizer=step.tokenizer, calibration=text,
                        grid=DEFAULT_GRID + HQQ_CELLS)
    search_s = time.perf_counter() - t
    files: dict[str, tuple[Path | None, str]] = {
        "onnxmedic fp32": (plain, "ours"),
        f"onnxmedic int4 chosen ({res.chosen})": (folder / "step_int4.onnx", "ours")}
    for name, path in best_per_algorithm(res, plain, folder, user.windows_path).items():
        files[name] = (path, "ours")
    files["genai builder fp32"] = (build_genai(folder, "fp32"), "genai")
    files["genai builder int4"] = (build_genai(folder, "int4"), "genai")
    if olive:
        path, err = olive_int4(folder, plain)
        files["olive int4 (OnnxBlockWiseRtnQuantization b128 a4)"] = (path, "ours" if path else err)
    rows = {}
    for name, (path, kind) in files.items():
        if path is None or not path.exists():
            rows[name] = {"error": kind if path is None else
                          "not built (no int4 candidate within the budget)"}
            continue
        rows[name] = measure_file(path, kind, cfg, data, ref, user.held, folder)
        j = int4.judge(ref, rows[name], int4.DEFAULT_BUDGET)
        rows[name].update(size_mib=file_mib(Path(path)),
                          perplexity_delta_pct=(j["perplexity_ratio"] - 1) * 100,
                          user_delta_pct=(rows[name]["user_perplexity"] / user_ref - 1) * 100,
                          agreement_pct=j["agreement"] * 100,
                          free_agreement_pct=j["free_agreement"] * 100,
                          within_budget=not j["rejected"] and
                          rows[name]["user_perplexity"] / user_ref <= 1.05)
        for k in ("tokens", "picks"):
            rows[name].pop(k, None)
    return {"preset": preset, "parameters": sum(p.numel() for p in step.parameters()),
            "reference_perplexity": ref["perplexity"], "user_reference_perplexity": user_ref,
            "user_text": user.describe(), "rows": rows,
            "int4_search": res.to_dict(), "int4_search_seconds": search_s}


def measure_file(path: Path, kind: str, cfg: Any, data: Any, ref: dict[str, Any],
                 held: list[int], folder: Path) -> dict[str, Any]:
    """:func:`measure_child` of one file in a child process."""
    req = folder / "measure.json"
    req.write_text(json.dumps({
        "path": str(path), "kind": kind, "heads": cfg.num_key_value_heads,
        "head_dim": cfg.hidden_size // cfg.num_attention_heads,
        "layers": cfg.num_hidden_layers, "prompts": data.prompts, "text": data.text,
        "held": held, "reference": ref["tokens"], "out": str(folder / "measured.json")}))
    subprocess.run([sys.executable, __file__, "--measure", str(req)], check=True)
    return json.loads((folder / "measured.json").read_text())


def write(out: dict[str, Any], cmd: str) -> Path:
    """bench/results/int4_peers.md (+ .json; other presets: int4_peers_<preset>.md)."""
    cpu = next((ln.split(":", 1)[1].strip() for ln in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines()
        if ln.startswith("Model name")), platform.processor())
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "int4_peers" + ("" if out["preset"] == "figures" else f"_{out['preset']}")
    (RESULTS / f"{stem}.json").write_text(json.dumps(out, indent=1, default=str))
    lines = [f"`{cmd}` - {datetime.date.today()} - {cpu}, {os.cpu_count()} cores, ONNX Runtime "
             f"CPU, 2 intra-op threads; model: train_decoder.py preset {out['preset']} "
             f"({out['parameters'] / 1e6:.1f} M parameters), PyTorch float32 perplexity "
             f"{out['reference_perplexity']:.4g} (built-in text), "
             f"{out['user_reference_perplexity']:.4g} (TEXT: {out['user_text']})", "",
             "| file | decode tok/s | prefill-128 tok/s | peak RSS MiB (session on) | size MiB | "
             "perplexity delta (built-in) | perplexity delta (TEXT, held out) | greedy "
             "agreement teacher-forced | free-running | within budget |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in out["rows"].items():
        if "error" in r:
            lines.append(f"| {name} | {r['error']} |||||||||")
            continue
        lines.append(f"| {name} | {r['decode_tokens_s']:.0f} | {r['prefill_tokens_s']:.0f} | "
                     f"{r['peak_rss_mib']:.0f} | {r['size_mib']:.2f} | "
                     f"{r['perplexity_delta_pct']:+.2f} % | {r['user_delta_pct']:+.2f} % | "
                     f"{r['agreement_pct']:.1f} % | {r['free_agreement_pct']:.1f} % | "
                     f"{'yes' if r['within_budget'] else 'no'} |")
    lines += ["", "onnxmedic's int4 candidates (decode step at past 128, in optimize's timing "
              "child; own: free-running agreement, gap: PyTorch's top-2 logit gap at each "
              f"prompt's first divergence, median over all steps "
              f"{out['int4_search']['median_margin']:.3g}):", "",
              "| candidate | perplexity delta | on TEXT | teacher-forced | own | gap at first "
              "divergence | decode ms | MiB | rejected |", "|---|---|---|---|---|---|---|---|---|"]
    for c in out["int4_search"]["candidates"]:
        if c["perplexity"] is None:
            lines.append(f"| {c['name']} | - | - | - | - | - | - | - | {c['rejected']} |")
            continue
        gaps = ", ".join("-" if g is None else f"{g:.2g}" for g in c["divergence_margins"])
        lines.append(f"| {c['name']} | {(c['perplexity_ratio'] - 1) * 100:+.2f} % | "
                     f"{(c['user_perplexity_ratio'] - 1) * 100:+.2f} % | "
                     f"{c['agreement'] * 100:.1f} % | {c['free_agreement'] * 100:.1f} % | "
                     f"{gaps} | {c['decode_ms']:.3f} | {c['size_bytes'] / 2**20:.2f} | "
                     f"{c['rejected'][:80]} |")
    path = RESULTS / f"{stem}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="figures")
    ap.add_argument("--olive", action="store_true", help="also Olive's int4 recipe "
                    "(olive-ai in build/olive)")
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.measure:
        measure_child(ns.measure)
        return
    out = run(ns.preset, ns.olive)
    path = write(out, f"python bench/peers/int4.py --preset {ns.preset}"
                 + (" --olive" if ns.olive else ""))
    print(path.read_text())


if __name__ == "__main__":
    main()
