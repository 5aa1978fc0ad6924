#!/usr/bin/env bash
# Peers that the benchmarks compare against but the GPU machine does not have (it cannot fetch
# packages): download their wheels here into .whl/ (git-ignored through .git/info/exclude), then
# name .whl in the device call's `carry` and start its command with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH || exit;
# liger-kernel and gemlite are pure Python + Triton: their needs (torch, triton, numpy, tqdm)
# are on the GPU machine already. gemlite ships an sdist only: it is built into a wheel here.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp -d .whl "liger-kernel${LIGER_VERSION:+==$LIGER_VERSION}"
python3 -m pip wheel -q --no-deps -w .whl "gemlite${GEMLITE_VERSION:+==$GEMLITE_VERSION}"
ls -la .whl
