#!/usr/bin/env bash
# On the lent GPU machine, in the repository root: move the carried pieces (bench/gpu_pack.sh)
# to /tmp/g, assemble onnxruntime-gpu (and the other carried wheels) into /tmp/site, put it first
# on PYTHONPATH and run the command given, e.g.
#   bash bench/gpu_assemble.sh bash bench/gpu_session.sh opt $OUT
# Where /tmp/site already holds a CUDA-capable onnxruntime (a warm machine) it is reused.
set -u
repo=$PWD
G=${G:-/tmp/g}
S=${S:-/tmp/site}
export PYTHONPATH="$S${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$G"
for d in .gpu[0-9]*; do [ -d "$d" ] && mv "$d"/* "$G"/ 2>/dev/null; done
if ! python3 -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())" 2>/dev/null; then
    cd "$G" || exit 3
    cat cuda.xz.part* >cuda.xz && sha256sum -c cuda.sha || { echo "pieces missing: $(ls)"; exit 4; }
    mkdir -p "$S"
    python3 - "$S" <<'PY' || exit 5
import lzma, os, shutil, sys, tarfile
s = sys.argv[1]
with tarfile.open("rest.tar.xz", "r:xz") as t:
    t.extractall(s, filter="data")
dst = os.path.join(s, "onnxruntime", "capi", "libonnxruntime_providers_cuda.so")
with lzma.open("cuda.xz") as f, open(dst, "wb") as o:
    shutil.copyfileobj(f, o, 1 << 24)
os.chmod(dst, 0o755)
PY
    if ls "$G"/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$S" "$G"/*.whl || exit 6
    fi
    cd "$repo"
    echo "onnxruntime-gpu assembled in $SECONDS s"
fi
"$@"
