# SPDX-License-Identifier: Apache-2.0
"""Tests of ci/vllm-hooks.sh (and ci/vllm_hooks.py): which files each of vLLM's
hooks gets, and that mypy counts only the errors the entries introduce.

The tree is a tiny git repository with the shape of the patched vLLM tree: a
base commit, entry commits with ``Stack-Entry:`` trailers, a
``.pre-commit-config.yaml`` and ``tools/pre_commit/`` hooks. Its mypy is fake:
``tools/pre_commit/mypy.py`` reports ``path:line: error: MSG  [misc]`` for each
line holding ``# mypy-error: MSG``. The hooks venv is fake too: ruff and typos
only log their arguments, ``python`` is this interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HOOKS_SH = REPO / "ci" / "vllm-hooks.sh"
sys.path.insert(0, str(REPO / "ci"))
import vllm_hooks  # noqa: E402

CONFIG = """\
exclude: 'vllm/third_party/.*'
repos:
- repo: https://github.com/astral-sh/ruff-pre-commit
  rev: v0.14.0
  hooks:
  - id: ruff-check
    args: [--output-format, github, --fix]
  - id: ruff-format
- repo: https://github.com/crate-ci/typos
  rev: v1.43.5
  hooks:
  - id: typos
    args: [--force-exclude]
- repo: local
  hooks:
  - id: check-test-tethering
    entry: python tools/pre_commit/log.py tethering
    files: ^tests/.*\\.py$
  - id: mypy
    entry: python tools/pre_commit/mypy.py "3.11"
    types_or: [python, pyi]
    additional_dependencies: ["mypy==1.20.2", regex]
  - id: check-spdx-header
    entry: python tools/pre_commit/log.py spdx
    types_or: [python, rust, proto]
  - id: check-root-lazy-imports
    entry: python tools/pre_commit/log.py lazy
    types: [python]
  - id: check-forbidden-imports
    entry: python tools/pre_commit/log.py forbidden
    types: [python]
  - id: check-torch-cuda-call
    entry: python tools/pre_commit/cuda.py
    types: [python]
  - id: validate-config
    entry: python tools/pre_commit/log.py validate
  - id: check-boolean-context-manager
    entry: python tools/pre_commit/log.py boolean
    types: [python]
  - id: check-trust-remote-code
    entry: python tools/pre_commit/log.py trust
    types: [python]
    files: ^vllm/
"""
STAMP = "ruff==0.14.0 typos==1.43.5 mypy==1.20.2  regex"

FAKE_MYPY = """\
import sys
bad = 0
for path in sys.argv[2:]:
    for n, line in enumerate(open(path), 1):
        if "# mypy-error: " in line:
            print(f"{path}:{n}: error: {line.split('# mypy-error: ')[1].strip()}  [misc]")
            print(f"{path}:{n}: note: a note on it")
            bad += 1
print(f"Found {bad} errors" if bad else "Success: no issues found")
sys.exit(1 if bad else 0)
"""
LOG_HOOK = """\
import json, os, sys
with open(os.environ["HOOK_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
"""
CUDA_HOOK = """\
import sys
bad = [p for p in sys.argv[1:] if "torch.cuda.synchronize()" in open(p).read()]
for p in bad:
    print(f"{p}: Found torch.cuda API call")
sys.exit(1 if bad else 0)
"""
BASE_A = "".join(f"x{i} = {i}\n" for i in range(10)) + "y = 1  # mypy-error: old problem\n"
SERIES = """\
[[entry]]
name = "old-one"
subject = "s"
status = "upstreamed"
purpose = "p"

[[entry]]
name = "e1"
subject = "s"
status = "carried"
purpose = "p"
patch = "e1.patch"

[[entry]]
name = "e2"
subject = "s"
status = "carried"
purpose = "p"
overlay = ["tests/test_e2.py"]

[[entry]]
name = "gone"
subject = "s"
status = "dropped"
purpose = "p"
patch = "gone.patch"
"""


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout


class Tree:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = root / "vllm"
        self.log = root / "hook-log.jsonl"

    def write(self, files: dict[str, str]) -> None:
        for name, text in files.items():
            p = self.path / name
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)

    def commit(self, files: dict[str, str], entry: str | None = None) -> None:
        self.write(files)
        git(self.path, "add", "-A")
        msg = ["-m", entry or "base"]
        if entry:
            msg += ["-m", f"Stack-Entry: {entry}"]
        git(self.path, "commit", "-q", *msg)

    def hooks(self, *args: str) -> subprocess.CompletedProcess:
        self.log.write_text("")
        env = dict(
            os.environ,
            VLLM_HOOKS_TREE=str(self.path),
            VLLM_HOOKS_VENV=str(self.root / "hooks-venv"),
            VLLM_HOOKS_SERIES=str(self.root / "series.toml"),
            VLLM_HOOKS_BASE_CACHE=str(self.root / "base-cache"),
            HOOK_LOG=str(self.log),
        )
        return subprocess.run(
            ["bash", str(HOOKS_SH), *args], env=env, capture_output=True, text=True
        )

    def logged(self) -> dict[str, list[str]]:
        """hook name -> the files it got (the fake local hooks and ruff / typos)."""
        out: dict[str, list[str]] = {}
        for line in self.log.read_text().splitlines():
            name, *files = json.loads(line)
            out.setdefault(name, []).extend(f for f in files if (self.path / f).is_file())
        return out


@pytest.fixture
def tree(tmp_path: Path) -> Tree:
    t = Tree(tmp_path)
    t.path.mkdir()
    git(t.path, "init", "-q")
    git(t.path, "config", "user.name", "t")
    git(t.path, "config", "user.email", "t@t")
    t.commit(
        {
            ".pre-commit-config.yaml": CONFIG,
            "tools/pre_commit/mypy.py": FAKE_MYPY,
            "tools/pre_commit/log.py": LOG_HOOK,
            "tools/pre_commit/cuda.py": CUDA_HOOK,
            "vllm/a.py": BASE_A,
            "vllm/third_party/fla.py": "z = 1  # mypy-error: vendored\n",
        }
    )
    venv = tmp_path / "hooks-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "stamp").write_text(STAMP + "\n")
    for tool in ("ruff", "typos"):
        # log ["tool", args...] as JSON (arguments here have no quotes)
        script = (
            '#!/bin/sh\nname=$(basename "$0")\nargs=""\n'
            'for a in "$@"; do args="$args, \\"$a\\""; done\n'
            'echo "[\\"$name\\"$args]" >> "$HOOK_LOG"\n'
        )
        (venv / "bin" / tool).write_text(script)
        (venv / "bin" / tool).chmod(0o755)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    (tmp_path / "series.toml").write_text(SERIES)
    return t


def test_base_errors_do_not_count_and_new_ones_fail(tree: Tree) -> None:
    # e1 shifts the base's error down two lines and touches the vendored file
    tree.commit(
        {
            "vllm/a.py": "import os\nimport sys\n" + BASE_A,
            "vllm/third_party/fla.py": "z = 2  # mypy-error: vendored, changed\n",
        },
        entry="e1",
    )
    r = tree.hooks("e1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 error(s) the base" in r.stdout and "vllm/a.py (1)" in r.stdout
    assert "mypy: 0 new error(s)" in r.stdout
    assert "old problem" not in r.stdout

    tree.commit(
        {"vllm/a.py": "import os\nimport sys\n" + BASE_A + "w = 2  # mypy-error: new problem\n"},
        entry="e2",
    )
    r = tree.hooks("e1", "e2")
    assert r.returncode == 1
    assert "vllm/a.py:14: error: new problem  [misc]" in r.stdout
    assert "vllm/a.py:14: note: a note on it" in r.stdout
    assert "(entry: e1, e2)" in r.stdout
    assert "old problem" not in r.stdout
    assert "FAILED: mypy" in r.stderr


def test_error_on_a_line_an_entry_changed_counts(tree: Tree) -> None:
    tree.commit({"vllm/a.py": BASE_A.replace("y = 1", "y = 3")}, entry="e1")
    r = tree.hooks("e1")
    assert r.returncode == 1
    assert "vllm/a.py:11: error: old problem" in r.stdout


def test_new_file_errors_count_and_moved_line_references_match(tree: Tree) -> None:
    tree.commit({"vllm/b.py": "b = 1  # mypy-error: in a new file\n"}, entry="e1")
    r = tree.hooks("e1")
    assert r.returncode == 1 and "vllm/b.py:1: error: in a new file" in r.stdout

    base = [vllm_hooks.MypyError("f.py", 5, 'Name "b" already defined on line 3')]
    head = [vllm_hooks.MypyError("f.py", 6, 'Name "b" already defined on line 4')]
    d = Path(tree.root / "lm")
    (d / "base").mkdir(parents=True)
    (d / "head").mkdir()
    lines = [f"l{i}\n" for i in range(6)]
    (d / "base" / "f.py").write_text("".join(lines))
    (d / "head" / "f.py").write_text("new\n" + "".join(lines))
    new, old = vllm_hooks.new_errors(head, base, d / "head", d / "base")
    assert (new, len(old)) == ([], 1)


def test_each_hook_gets_the_files_pre_commit_would_give_it(tree: Tree) -> None:
    tree.commit(
        {
            "vllm/a.py": BASE_A + "import torch\ntorch.cuda.synchronize()\n",
            "vllm/third_party/fla.py": "torch.cuda.synchronize()\n",
            "tests/test_e2.py": "def test_x():\n    pass\n",
            "docs/notes.md": "text\n",
        },
        entry="e1",
    )
    r = tree.hooks("e1")
    assert r.returncode == 1
    assert "FAILED: check-torch-cuda-call" in r.stderr
    assert "vllm/a.py: Found torch.cuda API call" in r.stdout
    assert "third_party" not in r.stdout.split("excluded by the config")[0]
    assert "excluded by the config (as pre-commit does): vllm/third_party/fla.py" in r.stdout
    got = tree.logged()
    assert sorted(got["ruff"]) == ["tests/test_e2.py", "tests/test_e2.py", "vllm/a.py", "vllm/a.py"]
    assert sorted(got["typos"]) == ["docs/notes.md", "tests/test_e2.py", "vllm/a.py"]
    assert got["tethering"] == ["tests/test_e2.py"]
    assert got["trust"] == ["vllm/a.py"]
    assert sorted(got["validate"]) == ["docs/notes.md", "tests/test_e2.py", "vllm/a.py"]
    assert sorted(got["spdx"]) == ["tests/test_e2.py", "vllm/a.py"]


def test_carried_takes_the_series_carried_entries(tree: Tree) -> None:
    tree.commit({"vllm/c.py": "c = 1\n"}, entry="e1")
    tree.commit({"tests/test_e2.py": "e = 2\n"}, entry="e2")
    r = tree.hooks("--carried")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "vllm-hooks: 2 files of e1 e2\n" in r.stdout
    assert sorted(tree.logged()["lazy"]) == ["tests/test_e2.py", "vllm/c.py"]


def test_unknown_entry_and_no_arguments_are_errors(tree: Tree) -> None:
    tree.commit({"vllm/c.py": "c = 1\n"}, entry="e1")
    r = tree.hooks("nope")
    assert r.returncode != 0 and "no commit of entry 'nope'" in r.stderr
    assert tree.hooks().returncode == 2


def test_ci_runs_the_hooks_on_the_carried_entries() -> None:
    text = (REPO / "ci" / "test.sh").read_text()
    calls = [ln for ln in text.splitlines() if ln.startswith("ci/vllm-hooks.sh")]
    assert calls == ["ci/vllm-hooks.sh --carried"]
