#!/usr/bin/env bash
# vLLM's own pre-commit checks, as the applied tree's .pre-commit-config.yaml
# configures them, on every file the named series entries touch (their
# commits in work/vllm, found by their Stack-Entry trailer):
#   ruff check + ruff format --check (the config's ruff version), typos, mypy
#   (tools/pre_commit/mypy.py for Python 3.11, with the config's mypy and its
#   additional dependencies only, as pre-commit's isolated env has), and the
#   local Python hooks that apply to Python files (SPDX header, torch.cuda
#   calls, forbidden imports, boolean context managers, root lazy imports,
#   config docstrings, test tethering, trust_remote_code).
# The tools are pinned to the versions the tree's config names and installed
# once into work/vllm-hooks-venv (pip, from the configured index; pre-commit
# itself would clone the hook repositories from GitHub).
#
#   usage: ci/vllm-hooks.sh ENTRY [ENTRY ...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ $# -gt 0 ] || { echo "usage: $0 ENTRY [ENTRY ...]" >&2; exit 2; }
ROOT=$PWD
TREE=$ROOT/work/vllm
CFG=$TREE/.pre-commit-config.yaml
[ -f "$CFG" ] || { echo "vllm-hooks: no $CFG: run 'hybrid-stack apply' first" >&2; exit 2; }

# versions from the tree's pre-commit config
rev_of() { grep -A1 "repo: $1" "$CFG" | sed -n 's/^ *rev: v\{0,1\}\([0-9.]*\).*/\1/p'; }
RUFF=$(rev_of https://github.com/astral-sh/ruff-pre-commit)
TYPOS=$(rev_of https://github.com/crate-ci/typos)
MYPY_DEPS=$(sed -n 's/.*id: mypy.*//;/entry: python tools\/pre_commit\/mypy.py/,/additional_dependencies/{s/^ *additional_dependencies: \[\(.*\)\]/\1/p}' "$CFG" | tr -d '"' | tr ',' ' ')
[ -n "$RUFF" ] && [ -n "$TYPOS" ] && [ -n "$MYPY_DEPS" ] || {
    echo "vllm-hooks: could not read ruff / typos / mypy versions from $CFG" >&2; exit 2; }

VENV=$ROOT/work/vllm-hooks-venv
STAMP="ruff==$RUFF typos==$TYPOS $MYPY_DEPS"
if [ "$(cat "$VENV/stamp" 2>/dev/null)" != "$STAMP" ]; then
    rm -rf "$VENV"
    "${PYTHON:-python3}" -m venv "$VENV"
    # shellcheck disable=SC2086
    "$VENV/bin/pip" install -q --disable-pip-version-check "ruff==$RUFF" "typos==$TYPOS" \
        $MYPY_DEPS regex PyYAML
    echo "$STAMP" > "$VENV/stamp"
fi

cd "$TREE"
files=()
for entry in "$@"; do
    commit=$(git log --format=%H -n1 --grep="^Stack-Entry: $entry\$" HEAD)
    [ -n "$commit" ] || { echo "vllm-hooks: no commit of entry '$entry' in $TREE" >&2; exit 2; }
    while IFS= read -r f; do files+=("$f"); done < <(
        git diff --name-only --diff-filter=d "$commit~1" "$commit")
done
mapfile -t files < <(printf '%s\n' "${files[@]}" | sort -u)
mapfile -t py < <(printf '%s\n' "${files[@]}" | grep '\.py$' || true)
mapfile -t vllm_py < <(printf '%s\n' "${py[@]}" | grep '^vllm/' || true)
echo "vllm-hooks: ${#files[@]} files of $*"

fail=0
run() { echo "--> $*"; "$@" || { fail=1; echo "vllm-hooks: FAILED: $1 ${2:-}" >&2; }; }
export PATH="$VENV/bin:$PATH"
run ruff check --output-format concise "${py[@]}"
run ruff format --check "${py[@]}"
run typos --force-exclude "${files[@]}"
run python tools/pre_commit/mypy.py 3.11 "${py[@]}"
for hook in check_spdx_header check_torch_cuda check_forbidden_imports \
    check_boolean_context_manager check_init_lazy_imports validate_config; do
    run python "tools/pre_commit/$hook.py" "${py[@]}"
done
run python tools/pre_commit/check_test_tethering.py "${py[@]}"
[ ${#vllm_py[@]} -eq 0 ] || run python tools/pre_commit/check_trust_remote_code.py "${vllm_py[@]}"
exit $fail
