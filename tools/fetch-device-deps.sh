#!/bin/sh
# Downloads (does not install) the Debian packages the GPU machine lacks into
# .deps/ (git-ignored), for tools/device-round.sh to unpack there: Check and
# subunit for the test suite, CLBlast for the OpenCL GEMM ceiling of `moefuse bench`.
set -eu
cd "$(dirname "$0")/.."
mkdir -p .deps
cd .deps
apt-get download check libsubunit0 libsubunit-dev libclblast1 libclblast-dev
