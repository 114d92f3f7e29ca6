#!/usr/bin/env bash
# vLLM's own pre-commit checks, as the applied tree's .pre-commit-config.yaml
# configures them, on every file the named series entries touch (their
# commits in work/vllm, found by their Stack-Entry trailer), each hook on the
# files pre-commit would give it (the config's top-level exclude, e.g.
# vllm/third_party/, and the hook's files / exclude / types):
#   ruff check + ruff format --check (the config's ruff version), typos, mypy
#   (tools/pre_commit/mypy.py for Python 3.11, with the config's mypy and its
#   additional dependencies only, as pre-commit's isolated env has), and the
#   local Python hooks (SPDX header, torch.cuda calls, forbidden imports,
#   boolean context managers, root lazy imports, config docstrings, test
#   tethering, trust_remote_code).
# mypy's errors count only where the base release (the tree below the first
# entry, extracted once into work/vllm-hooks-base) has no such error on the
# same line: what an entry introduces, not what the file already had.
# The tools are pinned to the versions the tree's config names and installed
# once into work/vllm-hooks-venv (pip, from the configured index; pre-commit
# itself would clone the hook repositories from GitHub). ci/vllm_hooks.py
# does the rest.
#
#   usage: ci/vllm-hooks.sh ENTRY [ENTRY ...]
#          ci/vllm-hooks.sh --carried        (every carried entry of patches/series.toml)
# VLLM_HOOKS_TREE, _VENV, _SERIES, _BASE_CACHE: another tree, hooks venv, series,
# base copy (the tests use them).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ $# -gt 0 ] || { echo "usage: $0 ENTRY [ENTRY ...] | --carried" >&2; exit 2; }
ROOT=$PWD
TREE=${VLLM_HOOKS_TREE:-$ROOT/work/vllm}
CFG=$TREE/.pre-commit-config.yaml
[ -f "$CFG" ] || { echo "vllm-hooks: no $CFG: run 'hybrid-stack apply' first" >&2; exit 2; }

# versions from the tree's pre-commit config
rev_of() { grep -A1 "repo: $1" "$CFG" | sed -n 's/^ *rev: v\{0,1\}\([0-9.]*\).*/\1/p'; }
RUFF=$(rev_of https://github.com/astral-sh/ruff-pre-commit)
TYPOS=$(rev_of https://github.com/crate-ci/typos)
MYPY_DEPS=$(sed -n 's/.*id: mypy.*//;/entry: python tools\/pre_commit\/mypy.py/,/additional_dependencies/{s/^ *additional_dependencies: \[\(.*\)\]/\1/p}' "$CFG" | tr -d '"' | tr ',' ' ')
[ -n "$RUFF" ] && [ -n "$TYPOS" ] && [ -n "$MYPY_DEPS" ] || {
    echo "vllm-hooks: could not read ruff / typos / mypy versions from $CFG" >&2; exit 2; }

VENV=${VLLM_HOOKS_VENV:-$ROOT/work/vllm-hooks-venv}
STAMP="ruff==$RUFF typos==$TYPOS $MYPY_DEPS"
if [ "$(cat "$VENV/stamp" 2>/dev/null)" != "$STAMP" ]; then
    rm -rf "$VENV"
    "${PYTHON:-python3}" -m venv "$VENV"
    # shellcheck disable=SC2086
    "$VENV/bin/pip" install -q --disable-pip-version-check "ruff==$RUFF" "typos==$TYPOS" \
        $MYPY_DEPS regex PyYAML
    echo "$STAMP" > "$VENV/stamp"
fi

VENV=$(cd "$VENV" && pwd)
export PATH="$VENV/bin:$PATH"
exec "$VENV/bin/python" "$ROOT/ci/vllm_hooks.py" --tree "$TREE" \
    --series "${VLLM_HOOKS_SERIES:-$ROOT/patches/series.toml}" \
    --base-cache "${VLLM_HOOKS_BASE_CACHE:-$ROOT/work/vllm-hooks-base}" "$@"
