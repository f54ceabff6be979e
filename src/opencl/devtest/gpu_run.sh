#!/bin/sh
# Development helper: build a copy of the tree with the OpenCL backend wired in
# (WIRING.md) and run the devtest checks on NVIDIA's OpenCL driver, whose ICD
# file may be missing from /etc/OpenCL/vendors in containers.
# usage (repository root): sh src/opencl/devtest/gpu_run.sh [seed] [rounds]
set -e
seed=${1:-1}
rounds=${2:-20}
work=/tmp/mf_gpu
rm -rf "$work" && mkdir -p "$work/icd" "$work/src"
cp -a . "$work/src"
echo libnvidia-opencl.so.1 > "$work/icd/nvidia.icd"
export OCL_ICD_VENDORS="$work/icd"
cd "$work/src"
python3 - <<'PY'
s = open('src/opencl/WIRING.md').read()
open('/tmp/mf_gpu/wiring.diff', 'w').write(s.split('```diff\n')[1].split('```')[0])
PY
patch -p1 < "$work/wiring.diff" >/dev/null
meson setup "$work/build" -Dtests=false >/dev/null
ninja -C "$work/build" src/libmoefuse.a >/dev/null
cc -std=c11 -O2 -Iinclude src/opencl/devtest/compare.c "$work/build/src/libmoefuse.a" \
   -fopenmp -lOpenCL -lm -o "$work/compare"
export MOEFUSE_OPENCL_CACHE="$work/cache"
"$work/compare" "$seed" "$rounds" || echo "compare: FAILED"
"$work/compare" "$seed" 3 big || echo "compare big: FAILED"
MOEFUSE_OPENCL_GEMM=simple "$work/compare" "$seed" "$rounds" | tail -13
