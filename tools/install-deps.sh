#!/bin/sh
# Installs what building and testing moefuse needs on Debian 12 / Ubuntu 22.04+.
# Compilers, Meson and CMake (CI builds a program against the installed library
# with it), Check for the tests, OpenBLAS for the benchmark ceiling,
# the OpenCL headers, ICD loader and PoCL (a CPU OpenCL platform), and Python
# with venv and its headers for the Python package (pip install . compiles its
# fast path, python/moefuse/_fastcall.c, a CPython extension).
set -eu
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends \
    build-essential pkg-config meson ninja-build cmake \
    check libsubunit-dev \
    libopenblas-dev \
    ocl-icd-opencl-dev opencl-headers pocl-opencl-icd clinfo \
    python3 python3-venv python3-dev >/dev/null
