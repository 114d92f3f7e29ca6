#!/usr/bin/env bash
# The README's test command: installs what the tests need, then runs them all.
#   1. the tooling (.venv, editable, with test extras)
#   2. fetch + apply the pinned base and the series into work/vllm
#   3. build the patched tree Python-only into work/venv (lean CPU profile)
#   4. lint: ruff on the tooling, and with vLLM's settings on overlay/
#   5. sm_90 compile check of the stack's kernels (hybrid-stack kernel-stats), with
#      the venv's Triton (3.8) and with Triton 3.6, the release the fused
#      kernel's Gluon form has run with on the H200
#   6. vLLM's own pre-commit hooks on every carried entry's files
#      (ci/vllm-hooks.sh --carried), and the SSD entries' launch tests under
#      Triton 3.6
#   7. the tooling tests (pytest tests/, two at a time); the sm_90 test reads
#      step 5's result instead of compiling the same kernels again; then the
#      report and the PR bodies in results/ are what the tool writes from them
#   8. the stack's CPU suite on the patched tree (hybrid-stack test, two suites
#      at a time)
# Exits non-zero on any failure; pytest's "no tests collected" (5) is a failure.
# JOBS (default 2): tooling tests and CPU suites run at a time.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

step() { printf '\n==> %s\n' "$*"; }
PY=${PYTHON:-python3}
JOBS=${JOBS:-2}

step "tooling: .venv"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
export PATH="$PWD/.venv/bin:$PATH"

step "fetch + apply"
hybrid-stack fetch
hybrid-stack apply

step "build (lean profile)"
hybrid-stack build --profile lean

step "lint (ruff)"
ruff check scripts tests ci/kernel-cases ci/vllm_hooks.py
ruff format --check scripts tests ci/kernel-cases ci/vllm_hooks.py
ruff check --config ci/ruff-vllm.toml overlay
ruff format --check --config ci/ruff-vllm.toml overlay

step "sm_90 compile check (no GPU: registers, spills, shared memory)"
hybrid-stack kernel-stats --arch 90 --json work/kernel-stats-sm90.json
# the fused kernel's sm_90 form (Gluon) compiles with Triton 3.6 and 3.8; the run
# above used the venv's 3.8, this one compiles both forms with 3.6, the release
# the stack's GPU tests and benchmarks ran with
hybrid-stack kernel-stats --arch 90 --triton 3.6.0 --json work/kernel-stats-sm90-triton3.6.0.json

step "vLLM pre-commit checks on every carried entry's files"
# the entries of patches/series.toml; mypy errors the base already has do not count
ci/vllm-hooks.sh --carried

# --- fused Mamba2 SSD entries: their Triton launch-path CPU tests under Triton 3.6
# (installed just above)
step "SSD entries: launch tests under Triton 3.6"
ci/triton-release-tests.sh 3.6.0
# --- end fused Mamba2 SSD entries

step "tooling tests"
set +e
HYBRID_STACK_KSTATS_SM90_JSON="$PWD/work/kernel-stats-sm90.json" \
  python -m pytest tests -q -ra -n "$JOBS"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "tooling tests: pytest collected no tests" >&2; exit 1; fi
[ "$rc" -eq 0 ] || exit "$rc"
hybrid-stack report --check
hybrid-stack pr-stack --check

step "CPU suite on the patched tree"
hybrid-stack test --jobs "$JOBS"
