#!/usr/bin/env bash
# Pack onnxruntime-gpu for a lent GPU machine (never run by the tests). A call to the device tool
# carries at most 64 MiB and the onnxruntime-gpu wheel is ~250 MB (its CUDA provider alone
# 284 MB, 185 MB as xz), so it travels in pieces, one carried folder per call (.gpu1, .gpu2, ...
# ignored through .git/info/exclude), each call moving its piece to /tmp/g there; the last call
# assembles and runs (bench/gpu_assemble.sh). A machine idle over 30 s is given back, /tmp/g
# with it: issue the calls back to back (several run calls in one message run in turn).
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 -d .whl onnxruntime-gpu==1.31.1 \
#       onnxslim==0.1.98 onnx-ir==1.1.0
#   bench/gpu_pack.sh .whl/onnxruntime_gpu-*.whl .whl/onnxslim-*.whl .whl/onnx_ir-*.whl
#   # then, one call each: run(command="mkdir -p /tmp/g && mv .gpuN/* /tmp/g/", carry=[".gpuN"])
#   # for N = 1 .. last-1, and for the last one:
#   # run(command="bash bench/gpu_assemble.sh bash bench/gpu_session.sh opt $OUT", carry=[".gpuLAST"])
#
# Left out of the wheel: libonnxruntime.so (the C API's; the Python module does not load it),
# the TensorRT provider (its libraries are not on the machine) and the license notices.
set -eu
wheel=${1:?the onnxruntime-gpu wheel}; shift
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/site"
(cd "$work/site" && unzip -q "$(realpath "$wheel")")
capi="$work/site/onnxruntime/capi"
mv "$capi/libonnxruntime_providers_cuda.so" "$work/"
rm -f "$capi"/libonnxruntime.so.* "$capi/libonnxruntime_providers_tensorrt.so" \
    "$work/site/onnxruntime/ThirdPartyNotices.txt"
tar -C "$work/site" -cf - . | xz -9 -T0 >"$work/rest.tar.xz"
xz -9 -T0 -c "$work/libonnxruntime_providers_cuda.so" >"$work/cuda.xz"
(cd "$work" && sha256sum cuda.xz >cuda.sha && split -b 45M -d -a 2 cuda.xz cuda.xz.part)
cd "$here"
rm -rf .gpu[0-9]*
n=0
for part in "$work"/cuda.xz.part*; do
    n=$((n + 1))
    mkdir -p ".gpu$n"
    grep -qx "/.gpu$n/" .git/info/exclude 2>/dev/null || echo "/.gpu$n/" >>.git/info/exclude
    mv "$part" ".gpu$n/"
done
cp "$work/rest.tar.xz" "$work/cuda.sha" .gpu1/
for w in "$@"; do cp "$w" .gpu1/; done
du -sh .gpu[0-9]*
echo "$n calls: .gpu1 .. .gpu$n (bench/gpu_assemble.sh in the last)"
