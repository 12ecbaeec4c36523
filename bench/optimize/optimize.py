"""Benchmark for issue 17: onnxmedic optimize against its peers, same run, one table.

    PYTHONPATH=src python bench/optimize/optimize.py [--models bert,gpt2,resnet50,...] [--threads 2]
    PYTHONPATH=src python bench/optimize/optimize.py --target cuda    # a GPU, onnxruntime-gpu

Columns per model: PyTorch eager; the plain torch.onnx.export (dynamo=True); ONNX Runtime's
transformers optimizer on the same export (model types it knows); blind quantize_dynamic on the
same export (and for convolutional models blind quantize_static, QDQ, every layer); onnxmedic
optimize at each precision (--precisions; fp16 is for GPU targets). Every ONNX variant is timed
with the same sandbox timer (alternating rounds, medians, 2 intra-op threads) and judged on the
same input sets as onnxmedic's own candidates (the reduced-precision budget: cosine >= 0.999 per
output unless --accuracy, worst over every input set; worst cosine and max abs error shown).
Models (random weights): BERT-base (seq 128), GPT-2 (seq 128), ResNet-50, ViT-B/16,
Whisper-base encoder (80x3000 mel), a Llama-shaped ~110M decoder step (1 new token, 128 past
positions per layer, keys/values out).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from onnxmedic import inputs as inputs_mod
from onnxmedic import sandbox
from onnxmedic.optimize import (
    calibration_feeds,
    judge_reduced,
    optimize,
    parse_accuracy,
    reference_sets,
    time_variants,
)
from onnxmedic.optimize.cli import took
from onnxmedic.optimize.graphs import (
    GRAPH_SUFFIX,
    NHWC_OPTIONS,
    NHWC_SUFFIX,
    twin_options,
)
from onnxmedic.optimize.passes import is_convolutional


class _Hidden(torch.nn.Module):
    """A transformers model's ``last_hidden_state``: one tensor out, as onnxmedic exports it."""

    def __init__(self, m: Any) -> None:
        super().__init__()
        self.m = m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.m(x).last_hidden_state


class _DecoderStep(torch.nn.Module):
    """One decoding step with past: ``ids`` (1 new token) and each layer's past key and value
    as plain tensors in; the hidden state and the grown keys/values out (transformers' cache
    object is built inside, so the ONNX file has tensors only)."""

    def __init__(self, m: Any) -> None:
        super().__init__()
        self.m = m
        self.n = m.config.num_hidden_layers

    def forward(self, ids: torch.Tensor, *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.m.config)
        for i in range(self.n):
            cache.update(past[2 * i], past[2 * i + 1], i)
        seen = past[0].shape[2]
        # on the ids' device: the step also runs eagerly on a GPU (bench --target cuda)
        pos = torch.arange(seen, seen + ids.shape[1], device=ids.device).unsqueeze(0)
        out = self.m(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True)
        kv = out.past_key_values.layers
        return (out.last_hidden_state,) + tuple(t for layer in kv[:self.n]
                                                for t in (layer.keys, layer.values))


# Each returns (module, example args, ONNX Runtime optimizer model_type or None): the
# model_type optimum picks for the architecture (llama -> gpt2, whisper -> bart).
def bert() -> tuple[Any, tuple[Any, ...], str | None]:
    from transformers import BertConfig, BertModel

    m = BertModel(BertConfig()).eval()
    return _Hidden(m), (torch.randint(0, 30000, (1, 128)),), "bert"


def gpt2() -> tuple[Any, tuple[Any, ...], str | None]:
    from transformers import GPT2Config, GPT2Model

    m = GPT2Model(GPT2Config(use_cache=False)).eval()
    return _Hidden(m), (torch.randint(0, 50000, (1, 128)),), "gpt2"


def resnet50() -> tuple[Any, tuple[Any, ...], str | None]:
    from transformers import ResNetConfig, ResNetModel

    m = ResNetModel(ResNetConfig()).eval()
    return _Hidden(m), (torch.randn(1, 3, 224, 224),), None


def vit() -> tuple[Any, tuple[Any, ...], str | None]:
    from transformers import ViTConfig, ViTModel

    m = ViTModel(ViTConfig()).eval()  # ViT-B/16 at 224x224
    return _Hidden(m), (torch.randn(1, 3, 224, 224),), "vit"


def whisper() -> tuple[Any, tuple[Any, ...], str | None]:
    """Whisper-base's encoder: d_model 512, 6 layers, 8 heads, 80 mel bins x 3000 frames."""
    from transformers import WhisperConfig, WhisperModel

    cfg = WhisperConfig(d_model=512, encoder_layers=6, encoder_attention_heads=8,
                        encoder_ffn_dim=2048, decoder_layers=6, decoder_attention_heads=8,
                        decoder_ffn_dim=2048, num_mel_bins=80)
    m = WhisperModel(cfg).eval().get_encoder()
    return _Hidden(m), (torch.randn(1, 80, 3000),), "bart"


def llama() -> tuple[Any, tuple[Any, ...], str | None]:
    """A Llama-shaped ~110M decoder (hidden 768, 12 layers, 12 heads, MLP 2048, vocab 32000):
    one new token with 128 past positions per layer."""
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=12, head_dim=64,
                      vocab_size=32000)
    m = LlamaModel(cfg).eval()
    past = tuple(torch.randn(1, 12, 128, 64) for _ in range(2 * cfg.num_hidden_layers))
    return _DecoderStep(m), (torch.randint(0, 32000, (1, 1)),) + past, "gpt2"


MODELS = {"bert": bert, "gpt2": gpt2, "resnet50": resnet50, "vit": vit, "whisper": whisper,
          "llama": llama}


def _eager_ms(model: Any, args: tuple[Any, ...], threads: int, n: int = 10) -> float:
    torch.set_num_threads(threads)
    with torch.no_grad():
        for _ in range(3):
            model(*args)
        t = []
        for _ in range(n):
            s = time.perf_counter()
            model(*args)
            t.append((time.perf_counter() - s) * 1000)
    return statistics.median(t)


def _to(x: Any, dtype: torch.dtype) -> Any:
    x = x.to("cuda")
    return x.to(dtype) if x.is_floating_point() else x


def _eager_cuda(model: Any, args: tuple[Any, ...], dtype: torch.dtype,
                expected: list[Any], n: int = 50) -> tuple[float, float]:
    """PyTorch eager on the GPU in ``dtype`` (a copy of the model): median ms of ``n`` runs
    after warm-up (CUDA synchronised) and the worst output cosine against the float32 CPU
    outputs (``expected``, the example's). cuDNN picks its convolution algorithms by timing
    them (``cudnn.benchmark``, as a fixed-shape deployment sets it; without it ResNet-50's
    float16 took 7.5 ms against 3.3 ms in float32 on the H200)."""
    import copy

    from onnxmedic._tensors import flatten_tensors
    from onnxmedic.optimize.int8 import cosine as _cosine

    torch.backends.cudnn.benchmark = True

    m = copy.deepcopy(model).to("cuda", dtype)
    a = tuple(_to(x, dtype) for x in args)
    with torch.no_grad():
        for _ in range(10):
            m(*a)
        torch.cuda.synchronize()
        t = []
        for _ in range(n):
            s = time.perf_counter()
            m(*a)
            torch.cuda.synchronize()
            t.append((time.perf_counter() - s) * 1000)
        outs = [o.float().cpu().numpy() for o in flatten_tensors(m(*a))]
    cos = min(_cosine(e, o) for e, o in zip(expected, outs))
    del m
    torch.cuda.empty_cache()
    return statistics.median(t), cos


def _static(plain: Path, args: tuple[Any, ...], dst: Path) -> None:
    """quantize_static as ONNX Runtime's docs give it (QDQ, per channel, MinMax), calibrated on
    the calibration sets onnxmedic's own static candidate uses, no layer kept float32."""
    from onnxmedic.optimize.files import save_feeds
    from onnxmedic.optimize.passes import quantize_static_int8

    cal = save_feeds(calibration_feeds(plain, inputs_mod.Inputs(args)), dst.with_suffix(".npz"))
    quantize_static_int8(str(plain), str(dst), str(cal))


def _peer(label: str, make: Any, dst: Path, paths: dict[str, Path], failed: dict[str, str]
          ) -> None:
    """Run a peer tool writing ``dst``; a peer that cannot handle the export is a row too."""
    try:
        make(dst)
    except Exception as e:  # noqa: BLE001
        failed[label] = f"failed: {type(e).__name__}: {str(e)[:120]}"
        return
    paths[label] = dst


def run_one(name: str, threads: int, folder: Path, precisions: list[str],
            target: str = "cpu", repeats: int = 10, rounds: int = 3,
            cuda_graph: str = "auto", accuracy: str | None = None) -> list[dict[str, Any]]:
    import onnx

    torch.manual_seed(0)  # the same random weights and inputs in every run of the table
    model, args, ort_type = MODELS[name]()
    model.eval()  # the wrappers too (their training flag is what export warns about)
    plain = folder / f"{name}.onnx"
    t0 = time.perf_counter()
    torch.onnx.export(model, args, str(plain), dynamo=True, verbose=False)
    print(f"  {name}: exported in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    names = [o.name for o in onnx.load(str(plain), load_external_data=False).graph.output]
    feeds, expected, labels, _ = reference_sets(plain, model, inputs_mod.Inputs(args))
    print(f"  {name}: {len(feeds)} input sets ({', '.join(labels)})", file=sys.stderr)
    if target == "cuda":
        rows: list[dict[str, Any]] = []
        for dt, label in ((torch.float32, "float32"), (torch.float16, "float16")):
            ms, cos = _eager_cuda(model, args, dt, expected[0])
            rows.append({"variant": f"pytorch eager CUDA {label}", "ms": ms,
                         "verified": f"- (cos {cos:.5f} vs float32 CPU)"})
    else:
        rows = [{"variant": "pytorch eager", "ms": _eager_ms(model, args, threads),
                 "verified": "-"}]
    paths = {"plain export": plain}
    options: dict[str, dict[str, str]] = {}  # CUDA provider options of a graph row (nhwc)
    failed: dict[str, str] = {}
    if target == "cuda":
        _gpu_peers(name, plain, ort_type, folder, paths, failed)
    elif ort_type:
        label = f"ORT transformers optimizer ({ort_type})"

        def ortopt(dst: Path) -> None:
            from onnxruntime.transformers.optimizer import optimize_model

            optimize_model(str(plain), model_type=ort_type, opt_level=1).save_model_to_file(
                str(dst))
        _peer(label, ortopt, folder / f"{name}-ortopt.onnx", paths, failed)

    def blind(dst: Path) -> None:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(str(plain), str(dst), weight_type=QuantType.QInt8)

    def nbits4(dst: Path) -> None:  # for reference only: int8 means 8 bit
        from onnxmedic.optimize.passes import quantize_weight_only

        quantize_weight_only(str(plain), str(dst), bits=4, block_size=32, accuracy_level=4)
    def slim(dst: Path) -> None:
        from onnxmedic.optimize.passes import onnxslim_pass

        onnxslim_pass(str(plain), str(dst))
    _peer("onnxslim", slim, folder / f"{name}-slim.onnx", paths, failed)
    if target == "cpu":
        _peer("blind quantize_dynamic", blind, folder / f"{name}-q.onnx", paths, failed)
        _peer("blind MatMulNBits 4-bit (reference)", nbits4, folder / f"{name}-q4.onnx", paths,
              failed)
        if is_convolutional(plain):  # ONNX Runtime's static int8, every layer, same calibration
            _peer("blind quantize_static (QDQ)", lambda dst: _static(plain, args, dst),
                  folder / f"{name}-qs.onnx", paths, failed)
    for prec in precisions:
        out = folder / f"{name}-om-{prec}.onnx"
        t0 = time.perf_counter()
        res = optimize(plain, model, args, out=out, precision=prec, threads=threads,
                       target=target, repeats=repeats, rounds=rounds, cuda_graph=cuda_graph,
                       accuracy=accuracy)
        paths[f"onnxmedic optimize {prec} ({res.chosen})"] = out
        if res.run_settings:  # as optimize recommends running it: a CUDA graph (in NHWC)
            opts = twin_options(res.run_settings) or {}
            label = (f"onnxmedic optimize {prec} ({res.chosen}){GRAPH_SUFFIX}"
                     + (NHWC_SUFFIX if opts else ""))
            paths[label], options[label] = out, opts
        print(f"  {name} optimize {prec}: {res.message} [{time.perf_counter() - t0:.0f} s; "
              f"{took(res)}]", file=sys.stderr)
        for v in res.variants:
            med = f"{v.median_ms:.1f} ms" if v.median_ms is not None else "untimed"
            kept = (f" [{len(v.blocked)} node(s) kept float32]" if v.precision == "fp16" else
                    f" [{len(v.steps[-1].get('excluded', []))} layer(s) kept float32]"
                    if v.precision == "int8" and v.steps else "")
            cos = (f" cos {v.worst_cosine():.5f}"
                   if v.precision != "fp32" and v.accuracy else "")
            ops = {k: n for st in v.steps for k, n in st.get("new_ops", {}).items()}
            print(f"    {v.name} ({v.precision}): {med}{cos}{kept} {ops or ''} "
                  f"{v.rejected or 'chosen'}"[:400], file=sys.stderr)
    if target == "cuda":  # the peers of a CUDA-graph run setting: the plain file as a graph
        paths["plain export" + GRAPH_SUFFIX] = plain
        if is_convolutional(plain):
            label = "plain export" + GRAPH_SUFFIX + NHWC_SUFFIX
            paths[label], options[label] = plain, dict(NHWC_OPTIONS)
    graphs = {k for k in paths if GRAPH_SUFFIX in k}
    times = time_variants(paths, feeds[0], threads=threads, repeats=repeats, rounds=rounds,
                          target=target, graphs=graphs, cuda_options=options)
    for label, path in paths.items():
        graph = label in graphs  # checked on its replays' outputs, at the example's shape
        sbx = sandbox.run_model(path, feeds[:1] if graph else feeds,
                                providers=sandbox.providers(target),
                                timing={"warmup": 2, "repeats": 1, "graph": True} if graph
                                else None, cuda_options=options.get(label))
        if label == "plain export":
            used = sbx.providers
        if not sbx.ok:
            ver = f"no ({sbx.status}: {sbx.error[:120]})"
        else:
            outs = [sbx.timed_outputs] if graph else sbx.outputs
            ok, acc, why = judge_reduced(names, expected[:len(outs)], outs,
                                         cosine=parse_accuracy(accuracy))
            cos = min(m["cosine"] for m in acc.values())
            err = max(m["max_abs"] for m in acc.values())
            ver = f"{'yes' if ok else 'NO'} (cos {cos:.5f}, max abs {err:.3g})"
        rows.append({"variant": label, "ms": times.get(label, (float("nan"),))[0],
                     "verified": ver})
    rows += [{"variant": label, "ms": float("nan"), "verified": why}
             for label, why in failed.items()]
    base = next(r["ms"] for r in rows if r["variant"] == "plain export")
    if target == "cuda" and used[:1] != ["CUDAExecutionProvider"]:
        raise RuntimeError(f"--target cuda, but ONNX Runtime used {used}")
    for r in rows:
        r["model"] = name
        r["speedup"] = base / r["ms"] if r["ms"] == r["ms"] else float("nan")
    return rows


def _gpu_peers(name: str, plain: Path, ort_type: str | None, folder: Path,
               paths: dict[str, Path], failed: dict[str, str]) -> None:
    """The float16 recipes users pick for a GPU, applied blind to the same export: ONNX
    Runtime's float16 converter (float32 I/O kept, its default op block list), and for the model
    types it knows its transformers optimizer (use_gpu) in float32 and then float16."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    def blind16(dst: Path) -> None:
        onnx.save(convert_float_to_float16(onnx.load(str(plain)), keep_io_types=True),
                  str(dst))
    _peer("blind float16 (ORT converter)", blind16, folder / f"{name}-f16.onnx", paths, failed)
    if not ort_type:
        return

    def ortopt(dst: Path, fp16: bool) -> None:
        from onnxruntime.transformers.optimizer import optimize_model

        m = optimize_model(str(plain), model_type=ort_type, opt_level=0, use_gpu=True)
        if fp16:
            m.convert_float_to_float16(keep_io_types=True)
        m.save_model_to_file(str(dst))
    for fp16 in (False, True):
        _peer(f"ORT transformers optimizer ({ort_type}){' fp16' if fp16 else ''}",
              lambda dst, f=fp16: ortopt(dst, f), folder / f"{name}-ortopt{int(fp16)}.onnx",
              paths, failed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: PyTorch eager float32/float16 on the GPU, every ONNX variant "
                    "timed on ONNX Runtime's CUDA provider (IOBinding, default options: TF32) "
                    "and verified on it; needs onnxruntime-gpu")
    ap.add_argument("--precisions", default=None,
                    help="onnxmedic optimize precisions (default fp32,int8 on cpu, fp16 on "
                    "cuda - whose candidates include the float32 ones); fp16 on cpu is built "
                    "and verified but ONNX Runtime lacks float16 kernels for most CPU ops")
    ap.add_argument("--cuda-graph", choices=["auto", "deploy", "off"], default="auto",
                    help="onnxmedic optimize's cuda_graph on --target cuda")
    ap.add_argument("--accuracy", default=None,
                    help="the reduced-precision budget for optimize and the table's verified "
                    "column, e.g. cosine=0.995 (default: cosine=0.999)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--deadline", type=float, default=0.0,
                    help="seconds: start no model after this much time has passed")
    ap.add_argument("--json", help="write every row here (after each model)")
    ns = ap.parse_args()
    precisions = (ns.precisions or ("fp16" if ns.target == "cuda" else "fp32,int8")).split(",")
    if ns.target == "cuda":
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():  # before any model
            sys.exit(f"--target cuda: onnxruntime {ort.__version__} at {ort.__file__} has no "
                     f"CUDA provider ({ort.get_available_providers()}); install onnxruntime-gpu")
        print(f"onnxruntime {ort.__version__} {ort.get_available_providers()}, torch "
              f"{torch.__version__}, {torch.cuda.get_device_name(0)}", flush=True)
    print(f"{'model':10} {'variant':48} {'median ms':>10} {'vs plain':>9}  verified (accuracy; "
          f"reduced precision: cosine >= {parse_accuracy(ns.accuracy)})")
    t_start, every = time.perf_counter(), []
    for name in ns.models.split(","):
        if ns.deadline and time.perf_counter() - t_start > ns.deadline:
            print(f"{name:10} skipped: past the --deadline", flush=True)
            continue
        # one kept sandbox child for the model's every run, optimize's and the table's
        with tempfile.TemporaryDirectory(prefix="onnxmedic-bench-opt-") as tmp, \
                sandbox.reuse():
            try:
                rows = run_one(name, ns.threads, Path(tmp), precisions, ns.target,
                               ns.repeats, ns.rounds, ns.cuda_graph, ns.accuracy)
            except Exception as e:  # noqa: BLE001 - report and go on with the next model
                print(f"{name:10} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
        for r in rows:
            print(f"{r['model']:10} {r['variant']:48} {r['ms']:10.2f} {r['speedup']:8.2f}x  "
                  f"{r['verified']}", flush=True)
        every += rows
        if ns.json:
            import json

            Path(ns.json).write_text(json.dumps(every, indent=1, default=str))


if __name__ == "__main__":
    main()
