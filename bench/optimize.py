"""Benchmark for issue 17: onnxmedic optimize against its peers, same run, one table.

    PYTHONPATH=src python bench/optimize.py [--models bert,gpt2,resnet50,...] [--threads 2]

Columns per model: PyTorch eager; the plain torch.onnx.export (dynamo=True); ONNX Runtime's
transformers optimizer on the same export (model types it knows); blind quantize_dynamic on the
same export; onnxmedic optimize at each precision (--precisions; fp16 is for GPU targets). Every ONNX variant is timed with the same sandbox
timer (alternating rounds, medians, 2 intra-op threads) and judged on the same input sets as
onnxmedic's own candidates (the reduced-precision budget: cosine >= 0.999 per output, worst over
every input set; worst cosine and max abs error shown). Models (random weights): BERT-base
(seq 128), GPT-2 (seq 128), ResNet-50, ViT-B/16, Whisper-base encoder (80x3000 mel), a
Llama-shaped ~110M decoder step (1 new token, 128 past positions per layer, keys/values out).
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
from onnxmedic.optimize import judge_reduced, optimize, reference_sets, time_variants


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
        pos = torch.arange(seen, seen + ids.shape[1]).unsqueeze(0)
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


def _peer(label: str, make: Any, dst: Path, paths: dict[str, Path], failed: dict[str, str]
          ) -> None:
    """Run a peer tool writing ``dst``; a peer that cannot handle the export is a row too."""
    try:
        make(dst)
    except Exception as e:  # noqa: BLE001
        failed[label] = f"failed: {type(e).__name__}: {str(e)[:120]}"
        return
    paths[label] = dst


def run_one(name: str, threads: int, folder: Path, precisions: list[str]
            ) -> list[dict[str, Any]]:
    import onnx

    model, args, ort_type = MODELS[name]()
    plain = folder / f"{name}.onnx"
    t0 = time.perf_counter()
    torch.onnx.export(model, args, str(plain), dynamo=True, verbose=False)
    print(f"  {name}: exported in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    names = [o.name for o in onnx.load(str(plain), load_external_data=False).graph.output]
    feeds, expected, labels, _ = reference_sets(plain, model, inputs_mod.Inputs(args))
    print(f"  {name}: {len(feeds)} input sets ({', '.join(labels)})", file=sys.stderr)
    rows: list[dict[str, Any]] = [{"variant": "pytorch eager",
                                   "ms": _eager_ms(model, args, threads), "verified": "-"}]
    paths = {"plain export": plain}
    failed: dict[str, str] = {}
    if ort_type:
        label = f"ORT transformers optimizer ({ort_type})"

        def ortopt(dst: Path) -> None:
            from onnxruntime.transformers.optimizer import optimize_model

            optimize_model(str(plain), model_type=ort_type, opt_level=1).save_model_to_file(
                str(dst))
        _peer(label, ortopt, folder / f"{name}-ortopt.onnx", paths, failed)

    def blind(dst: Path) -> None:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(str(plain), str(dst), weight_type=QuantType.QInt8)
    _peer("blind quantize_dynamic", blind, folder / f"{name}-q.onnx", paths, failed)

    def nbits4(dst: Path) -> None:  # for reference only: int8 means 8 bit
        from onnxmedic.optimize.passes import quantize_weight_only

        quantize_weight_only(str(plain), str(dst), bits=4, block_size=32, accuracy_level=4)
    _peer("blind MatMulNBits 4-bit (reference)", nbits4, folder / f"{name}-q4.onnx", paths,
          failed)
    for prec in precisions:
        out = folder / f"{name}-om-{prec}.onnx"
        t0 = time.perf_counter()
        res = optimize(plain, model, args, out=out, precision=prec, threads=threads)
        paths[f"onnxmedic optimize {prec} ({res.chosen})"] = out
        print(f"  {name} optimize {prec}: {res.message} [{time.perf_counter() - t0:.0f} s]",
              file=sys.stderr)
        for v in res.variants:
            med = f"{v.median_ms:.1f} ms" if v.median_ms is not None else "untimed"
            kept = (f" [{len(v.blocked)} node(s) kept float32]" if v.precision == "fp16" else
                    f" [{len(v.steps[-1].get('excluded', []))} layer(s) kept float32]"
                    if v.precision == "int8" and v.steps else "")
            cos = (f" cos {min(m['cosine'] for m in v.accuracy.values()):.5f}"
                   if v.precision != "fp32" and v.accuracy else "")
            ops = {k: n for st in v.steps for k, n in st.get("new_ops", {}).items()}
            print(f"    {v.name} ({v.precision}): {med}{cos}{kept} {ops or ''} "
                  f"{v.rejected or 'chosen'}"[:400], file=sys.stderr)
    times = time_variants(paths, feeds[0], threads=threads, repeats=10, rounds=3)
    for label, path in paths.items():
        sbx = sandbox.run_model(path, feeds)
        if not sbx.ok:
            ver = f"no ({sbx.status})"
        else:
            ok, acc, why = judge_reduced(names, expected, sbx.outputs)
            cos = min(m["cosine"] for m in acc.values())
            err = max(m["max_abs"] for m in acc.values())
            ver = f"{'yes' if ok else 'NO'} (cos {cos:.5f}, max abs {err:.3g})"
        rows.append({"variant": label, "ms": times.get(label, (float("nan"),))[0],
                     "verified": ver})
    rows += [{"variant": label, "ms": float("nan"), "verified": why}
             for label, why in failed.items()]
    base = next(r["ms"] for r in rows if r["variant"] == "plain export")
    for r in rows:
        r["model"] = name
        r["speedup"] = base / r["ms"] if r["ms"] == r["ms"] else float("nan")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precisions", default="fp32,int8",
                    help="onnxmedic optimize precisions (fp16 is for GPU targets: on cpu ONNX "
                    "Runtime lacks float16 kernels for most ops and the variant is refused)")
    ns = ap.parse_args()
    print(f"{'model':10} {'variant':48} {'median ms':>10} {'vs plain':>9}  verified (accuracy)")
    for name in ns.models.split(","):
        with tempfile.TemporaryDirectory(prefix="onnxmedic-bench-opt-") as tmp:
            try:
                rows = run_one(name, ns.threads, Path(tmp), ns.precisions.split(","))
            except Exception as e:  # noqa: BLE001 - report and go on with the next model
                print(f"{name:10} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
        for r in rows:
            print(f"{r['model']:10} {r['variant']:48} {r['ms']:10.2f} {r['speedup']:8.2f}x  "
                  f"{r['verified']}", flush=True)


if __name__ == "__main__":
    main()
