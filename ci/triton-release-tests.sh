#!/usr/bin/env bash
# The fused SSD entries' CPU tests of Triton's launch machinery (native: real
# Triton, no GPU, no interpreter) under another Triton release than the build
# venv's: the release installed by `hybrid-stack kernel-stats --triton X.Y.Z`
# into work/triton-X.Y.Z, put first on the import path.
#
#   usage: ci/triton-release-tests.sh X.Y.Z
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ $# -eq 1 ] || { echo "usage: $0 X.Y.Z" >&2; exit 2; }
ROOT=$PWD
TRITON=$ROOT/work/triton-$1
[ -d "$TRITON/triton" ] || {
    echo "triton-release-tests: no $TRITON: run 'hybrid-stack kernel-stats --triton $1' first" >&2
    exit 2
}
T=tests/kernels/mamba
cd "$ROOT/work/vllm"
got=$(CUDA_VISIBLE_DEVICES="" PYTHONPATH="$TRITON" "$ROOT/work/venv/bin/python" -c \
    'import triton; print(triton.__version__)')
[ "$got" = "$1" ] || { echo "triton-release-tests: imported Triton $got, not $1" >&2; exit 1; }
CUDA_VISIBLE_DEVICES="" PYTHONPATH="$TRITON:$ROOT/work/vllm" HF_HUB_OFFLINE=1 \
    VLLM_TARGET_DEVICE=cpu "$ROOT/work/venv/bin/python" -m pytest -p no:cacheprovider -q -rfE \
    "$T/test_ssd_fused.py::test_direct_run_matches_triton_runner" \
    "$T/test_ssd_fused.py::test_launch_skips_only_empty_hooks" \
    "$T/test_ssd_fused.py::test_launch_key_determines_the_specialization" \
    "$T/test_ssd_fused_sm90.py::test_launch_skips_only_empty_hooks" \
    "$T/test_ssd_fused_sm90.py::test_launch_key_determines_the_specialization" \
    "$T/test_ssd_fused_sm90.py::test_gluon_gate_is_the_triton_release"
