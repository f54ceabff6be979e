#!/bin/bash
# One round on the GPU machine: build, test, benchmark, in one call.
#
#   tools/device-round.sh STAGE...     (from the repository root)
#
# Stages, run in the order given:
#   info            nvidia-smi, OpenCL platforms, `moefuse info`
#   test-cpu        the Check suite on the CPU backend (16 cores)
#   test-opencl     the Check suite on OpenCL, device picked by MOEFUSE_OPENCL_DEVICE (default NVIDIA)
#   test-cuda       the Check suite on CUDA
#   tests           only the tests named in TESTS (meson test names, e.g. test_moe_fp8@cuda)
#   test-cuda-computed the same with the table kernels off (MOEFUSE_CUDA_ACT_TABLE=0)
#   sanitize-cuda   compute-sanitizer memcheck and racecheck over the CUDA tests
#   numerics-cuda   src/cuda/tools: the host proof of numerics.cuh over every float, and
#                   device_check.cu (the device computes the same bits; hardware shortcuts)
#   bench-opencl    the `moefuse bench` runs of tools/bench-opencl.txt on OpenCL
#   bench-opencl-computed the same with act(g) computed (MOEFUSE_OPENCL_ACT_TABLE=0)
#   bench-cuda      the runs of tools/bench-cuda.txt on CUDA
#   bench-cuda-computed the same with the table kernels off (MOEFUSE_CUDA_ACT_TABLE=0)
#                   (BENCH_FILE names another list, e.g. tools/bench-rows.txt)
#   test-python     the pytest suite (torch CUDA tensors included) on this build's library
#   compare-torch   bench/compare_torch.py (COMPARE_ARGS adds options, e.g. --quick)
#   call-overhead   bench/call_overhead.py: host time per call, Python binding against C
#   peers           .peers/peer_bench.py (copied from the peers' folder, see its README): this
#                   build beside vLLM's, SGLang's and torch's kernels; PEERS_ARGS adds options
#                   (e.g. --only fp8 --Ms 1,32)
# SETUP_ARGS adds `meson setup` options (e.g. -Dcuda=disabled, -Dnvcc_targets=sm_90a);
# NINJA_TARGETS builds only those targets (e.g. src/libmoefuse.so tests/test_moe_fp8).
#
# The machine has no Check and no internet: the Debian packages of Check,
# subunit and CLBlast (the OpenCL GEMM ceiling) travel in .deps/ (fetched by
# `tools/fetch-device-deps.sh`) and are unpacked under /opt/mfdeps, never into /.
# Logs go to $OUT (or out/ when OUT is unset) and a summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }

deps=/opt/mfdeps
if ls .deps/*.deb >/dev/null 2>&1; then
    mkdir -p "$deps"
    for f in .deps/*.deb; do dpkg -x "$f" "$deps"; done
    for pc in "$deps"/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc; do
        sed -i "s|^prefix=.*|prefix=$deps/usr|" "$pc"
    done
    export PKG_CONFIG_PATH="$deps/usr/lib/x86_64-linux-gnu/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
    export LD_LIBRARY_PATH="$deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

# NVIDIA's OpenCL ICD file is missing in some containers: list the vendors ourselves.
if [ ! -e /etc/OpenCL/vendors/nvidia.icd ] && [ -z "${OCL_ICD_VENDORS:-}" ]; then
    mkdir -p /tmp/mf_icd
    cp /etc/OpenCL/vendors/*.icd /tmp/mf_icd/ 2>/dev/null
    echo libnvidia-opencl.so.1 >/tmp/mf_icd/nvidia.icd
    export OCL_ICD_VENDORS=/tmp/mf_icd
fi
export MOEFUSE_OPENCL_DEVICE=${MOEFUSE_OPENCL_DEVICE:-NVIDIA}
export MOEFUSE_OPENCL_CACHE=/tmp/mf_clcache

build=build-device
# A build from earlier calls is reused only when it was set up with the same options.
if [ "$(cat "$build/.setup-args" 2>/dev/null)" != "${SETUP_ARGS:-}" ]; then
    rm -rf "$build"
fi
if [ ! -f "$build/build.ninja" ]; then
    # shellcheck disable=SC2086
    meson setup "$build" -Dopencl=enabled ${SETUP_ARGS:-} >"$out/setup.log" 2>&1 ||
        { note "meson setup FAILED"; tail -40 "$out/setup.log"; exit 1; }
    echo "${SETUP_ARGS:-}" >"$build/.setup-args"
fi
t0=$(date +%s)
# shellcheck disable=SC2086
ninja -C "$build" ${NINJA_TARGETS:-} >"$out/build.log" 2>&1 ||
    { note "build FAILED"; tail -60 "$out/build.log"; exit 1; }
note "build: $(( $(date +%s) - t0 )) s"

run_suite() { # backend
    local log="$out/test-$1${SUITE_TAG:-}.log" t=$(date +%s)
    meson test -C "$build" --suite "$1" --print-errorlogs --num-processes 8 >"$log" 2>&1
    local rc=$?
    note "test-$1${SUITE_TAG:-}: rc=$rc, $(.ci/check-summary.sh "$build"), $(( $(date +%s) - t )) s;" \
         "$(grep -E '^(Ok|Fail|Skipped|Timeout):' "$log" | tr -s ' ' | tr '\n' ' ')"
    [ $rc -eq 0 ] || grep -E "FAIL|seed|Assertion" "$log" | head -30
}

run_bench() { # backend
    local log="$out/bench-$1${BENCH_TAG:-}.txt" list=${BENCH_FILE:-tools/bench-$1.txt}
    : >"$log"
    grep -vE '^\s*(#|$)' "$list" | while read -r line; do
        echo "== moefuse bench --backend $1 $line" >>"$log"
        # shellcheck disable=SC2086
        timeout 120 "$build/tools/moefuse" bench --backend "$1" $line >>"$log" 2>&1 ||
            echo "(exit $?)" >>"$log"
    done
    note "bench-$1${BENCH_TAG:-}: $(grep -c '^== ' "$log") runs, table:"
    awk '/^== /{cmd=$0} /^(time|figure|ceiling|ratio|roofline ratio|read floor|read-floor ratio|graph):/{print cmd " | " $0}' "$log" | tee -a "$summary" >/dev/null
}

for stage in "$@"; do
    case "$stage" in
    info)
        nvidia-smi -L 2>&1 | tee -a "$summary"
        "$build/tools/moefuse" info 2>&1 | tee -a "$summary"
        ;;
    test-cpu | test-opencl | test-cuda) run_suite "${stage#test-}" ;;
    test-cuda-computed) MOEFUSE_CUDA_ACT_TABLE=0 SUITE_TAG=-computed run_suite cuda ;;
    tests)
        log="$out/tests.log"
        # shellcheck disable=SC2086
        meson test -C "$build" --print-errorlogs --num-processes 4 ${TESTS:-} >"$log" 2>&1
        note "tests: rc=$?; $(grep -E '^ *[0-9]+/[0-9]+ ' "$log" | awk '{print $2, $3, $4}' | tr '\n' ';')"
        grep -E "Assertion|failed|FAIL" "$log" | head -30
        ;;
    peers)
        # shellcheck disable=SC2086
        MOEFUSE_LIBRARY="$build/src/libmoefuse.so" PYTHONUNBUFFERED=1 python3 .peers/peer_bench.py \
            --project . ${PEERS_ARGS:-} --out "$out" >"$out/peers.txt" 2>&1
        note "peers: rc=$?"
        grep -E "^(ceiling|moe |fp8moe|router|topk)" "$out/peers.txt" >>"$summary"
        ;;
    sanitize-cuda)
        for tool in memcheck racecheck; do
            log="$out/sanitize-$tool.log"
            : >"$log"
            # test_large (4.3 GB) and test_cross_backend would take the sanitizer minutes
            for t in "$build"/tests/test_*; do
                [ -f "$t" ] && [ -x "$t" ] || continue
                case "$(basename "$t")" in test_large | test_cross_backend | test_opencl) continue ;; esac
                MOEFUSE_TEST_BACKEND=cuda CK_FORK=no compute-sanitizer --tool "$tool" \
                    --error-exitcode 9 "$t" >>"$log" 2>&1
                echo "$(basename "$t"): rc=$?" >>"$log"
            done
            note "sanitize $tool: $(grep -c 'rc=0' "$log") clean of $(grep -c 'rc=' "$log");" \
                 "$(grep -h 'ERROR SUMMARY' "$log" | sort | uniq -c | tr '\n' ' ')"
        done
        ;;
    numerics-cuda)
        gcc -O2 -std=c11 -ffp-contract=off -fno-fast-math -fopenmp -Iinclude -Isrc \
            src/cuda/tools/check_numerics.c -lm \
            -o "$build/check_numerics" && "$build/check_numerics" >"$out/check_numerics.txt" 2>&1
        note "check_numerics (host): rc=$?, $(tail -1 "$out/check_numerics.txt")"
        nvcc -O2 -std=c++17 --fmad=false -gencode=arch=compute_90a,code=sm_90a -Isrc -Iinclude \
            -Xcompiler -fopenmp src/cuda/tools/device_check.cu -o "$build/device_check" -lgomp &&
            "$build/device_check" >"$out/device_check.txt" 2>&1
        note "device_check: rc=$?, $(tail -1 "$out/device_check.txt")"
        ;;
    bench-opencl | bench-cuda) run_bench "${stage#bench-}" ;;
    bench-cuda-computed) MOEFUSE_CUDA_ACT_TABLE=0 BENCH_TAG=-computed run_bench cuda ;;
    bench-opencl-computed) MOEFUSE_OPENCL_ACT_TABLE=0 BENCH_TAG=-computed run_bench opencl ;;
    test-python)
        log="$out/test-python.log"
        MOEFUSE_LIBRARY="$build/src/libmoefuse.so" python3 -m pytest -p no:cacheprovider -q -rs \
            python/tests >"$log" 2>&1
        note "test-python: rc=$?, $(tail -1 "$log")"
        grep -E "^(FAILED|ERROR)" "$log" | head -30
        ;;
    call-overhead)
        MOEFUSE_LIBRARY="$build/src/libmoefuse.so" python3 bench/call_overhead.py \
            >"$out/call-overhead.txt" 2>&1
        note "call-overhead: rc=$?"
        cat "$out/call-overhead.txt" >>"$summary"
        ;;
    compare-torch)
        # shellcheck disable=SC2086
        MOEFUSE_LIBRARY="$build/src/libmoefuse.so" python3 bench/compare_torch.py \
            ${COMPARE_ARGS:-} --json "$out/compare-torch.json" >"$out/compare-torch.txt" 2>&1
        note "compare-torch: rc=$?"
        sed -n '/^# moefuse vs PyTorch/,/^| op /p' "$out/compare-torch.txt" >>"$summary"
        sed -n '/^## Table/,$p' "$out/compare-torch.txt" >>"$summary"
        ;;
    *) note "unknown stage $stage" ;;
    esac
done
echo "===== summary"
cat "$summary"
