#!/usr/bin/env bash
# One session on a GPU machine (never run by the tests): what produced bench/results/gpu_results.md's
# issue-14/17 sections.
#
#   bench/gpu/gpu_session.sh smoke OUT         # versions, CUDA provider in a sandbox child, one export
#   bench/gpu/gpu_session.sh main OUT          # the two benchmarks below, side by side
#   bench/gpu/gpu_session.sh opt OUT           # bench/optimize/optimize.py --target cuda alone (OPT_MODELS:
#                                          # resnet50,gpt2,whisper,llama by default)
#   bench/gpu/gpu_session.sh probe OUT         # bench/gpu/gpu_probe_fp16.py alone (float16 amplification;
#                                          # PROBE=1 runs it before another mode)
#
# onnxruntime-gpu must be importable (PYTHONPATH), and python3 must hold CUDA torch,
# torchvision and timm. OPT_ROUNDS / OPT_REPEATS / OPT_MODELS /
# OPT_SECONDS / OPT_DEADLINE size the opt run to the device time left.
# `main` runs, at the same time:
#   - bench/optimize/optimize.py --target cuda (GPU: PyTorch eager float32/float16, the plain export on
#     ONNX Runtime's CUDA provider, ORT's float16 recipes, onnxmedic optimize --precision fp16);
#   - bench/accuracy/verify_calibration.py --models vision in two processes (CPU: onnxmedic export+verify
#     of real-size torchvision/timm architectures against torch.onnx's verify=True), 4 threads
#     each, so the GPU benchmark's host side keeps free cores.
# Each writes its JSON after every model: a run cut short keeps what it measured.
set -u
mode=${1:?smoke, main or opt}
out=${2:?output folder}
here=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$here/src:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
# the CUDA/cuDNN/cuBLAS libraries of the nvidia-* wheels the image's torch brought, for the
# sandbox children (they import onnxruntime, never torch)
nv=$(python3 -c "import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))" 2>/dev/null)
if [ -n "$nv" ]; then
    libs=$(find "$nv/nvidia" -name 'lib*.so*' -printf '%h\n' 2>/dev/null | sort -u | paste -sd:)
    export LD_LIBRARY_PATH="$libs:${LD_LIBRARY_PATH:-}"
fi
cd "$here"
if [ "$mode" = smoke ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 - <<'EOF'
import sys, time, tempfile
from pathlib import Path
import numpy as np, torch, onnxruntime as ort
print("python", sys.version.split()[0], "torch", torch.__version__, "onnxruntime",
      ort.__version__, ort.get_available_providers())
for mod in ("onnx", "onnxscript", "onnx_ir", "transformers", "torchvision", "timm"):
    try:
        print(mod, __import__(mod).__version__)
    except Exception as e:
        print(mod, "FAILED", e)
import onnxmedic
from onnxmedic import sandbox
m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.LayerNorm(64)).eval()
x = torch.randn(4, 64)
with tempfile.TemporaryDirectory() as td:
    t0 = time.perf_counter()
    r = onnxmedic.export(m, (x,), Path(td) / "m.onnx")
    print("onnxmedic.export", r.ok, [f.code for f in r.findings], f"{time.perf_counter()-t0:.1f} s")
    for f in r.errors:
        print("  ", f.code, f.message[:300])
    p = Path(td) / "t.onnx"
    torch.onnx.export(m, (x,), str(p), dynamo=True)
    import onnx
    name = onnx.load(str(p)).graph.input[0].name
    s = sandbox.run_model(p, [{name: x.numpy()}], providers=sandbox.providers("cuda"),
                          timing={"warmup": 3, "repeats": 10, "iobinding": True})
    print("sandbox cuda", s.status, s.providers, s.timing_device,
          [round(t * 1e6) for t in s.timed_seconds], s.error[:300])
EOF
    exit 0
fi
mkdir -p "$out"
if [ "${PROBE:-0}" = 1 ] || [ "$mode" = probe ]; then  # bench/gpu/gpu_probe_fp16.py
    timeout "${PROBE_SECONDS:-90}" python3 bench/gpu/gpu_probe_fp16.py --json "$out/probe.json" \
        >"$out/probe.log" 2>&1
    grep -E ' cos |Error|optimize fp16' "$out/probe.log"
    [ "$mode" = probe ] && exit 0
fi
if [ "$mode" = opt ]; then  # the optimize benchmark alone: the rows issue 17 still lacks
    timeout "${OPT_SECONDS:-540}" python3 bench/optimize/optimize.py --target cuda \
        --cuda-graph "${CUDA_GRAPH:-deploy}" \
        --models "${OPT_MODELS:-resnet50,gpt2,whisper,llama}" --threads 4 \
        --repeats "${OPT_REPEATS:-50}" --rounds "${OPT_ROUNDS:-3}" --deadline "${OPT_DEADLINE:-420}" --json "$out/opt.json" >"$out/opt.log" 2>&1
    grep -v '^  ' "$out/opt.log" | tail -60
    grep -i 'cuda-graph' "$out/opt.log" | tail -20
    exit 0
fi
cal() {  # $1: label, $2: models
    OMP_NUM_THREADS=4 timeout "${CAL_SECONDS:-480}" python3 bench/accuracy/verify_calibration.py \
        --models "$2" --no-faults --warmup --threads 4 --json "$out/calib_$1.json" \
        >"$out/calib_$1.log" 2>&1
}
cal a tv:resnet50,tv:mobilenet_v3_large,tv:efficientnet_b0,tv:convnext_tiny,tv:vit_b_16,tv:swin_t,tv:regnet_y_800mf &
cal b tv:densenet121,tv:mnasnet1_0,tv:shufflenet_v2_x1_0,timm:deit_small_patch16_224,timm:efficientnet_b0,timm:resnext50_32x4d,timm:mobilevitv2_100 &
timeout "${OPT_SECONDS:-480}" python3 bench/optimize/optimize.py --target cuda \
    --models "${OPT_MODELS:-bert,vit,resnet50,gpt2,whisper,llama}" --threads 4 --repeats 50 \
    --rounds 3 --deadline "${OPT_DEADLINE:-300}" --json "$out/opt.json" >"$out/opt.log" 2>&1
wait
grep -v '^  ' "$out/opt.log" | tail -60
cat "$out/calib_a.log" "$out/calib_b.log" | grep '^|' | tail -20
