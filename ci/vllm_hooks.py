# SPDX-License-Identifier: Apache-2.0
"""vLLM's own pre-commit hooks on the files of series entries (ci/vllm-hooks.sh).

Runs the hooks of the patched tree's ``.pre-commit-config.yaml`` that check
Python sources, each on the files pre-commit would give it: the entries' files
(their commits in the tree, found by the ``Stack-Entry:`` trailer) filtered by
the config's top-level ``exclude`` and the hook's own ``files`` / ``exclude`` /
``types`` / ``types_or``, as pre-commit does.

mypy checks whole files, so a file an entry edits also shows the errors the
base release already has in it. Upstream's CI never sees those for a PR (its
base is clean by its own hooks, or the errors are not the PR's). So mypy runs
twice: on the patched tree and on the base tree (the parent of the first entry
commit, extracted once into ``work/vllm-hooks-base/<commit>``) with the files
that exist there, and an error counts only if the base has no error with the
same message on the same source line (lines matched through the diff of the
file between base and patched). Errors on lines an entry changed always count.

    usage: vllm_hooks.py --tree DIR --series FILE --base-cache DIR (--carried | ENTRY ...)
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

import yaml

# The hooks run, by id. Remote hooks (ruff, typos) are invoked directly, with the
# file types their own manifests declare; local hooks run their config entry.
REMOTE = {
    "ruff-check": (
        ["ruff", "check", "--output-format", "concise"],
        {"types_or": ["python", "pyi", "jupyter"]},
    ),
    "ruff-format": (["ruff", "format", "--check"], {"types_or": ["python", "pyi", "jupyter"]}),
    "typos": (["typos", "--force-exclude"], {"types": ["text"]}),
}
LOCAL = [
    "mypy",
    "check-spdx-header",
    "check-torch-cuda-call",
    "check-forbidden-imports",
    "check-boolean-context-manager",
    "check-root-lazy-imports",
    "validate-config",
    "check-test-tethering",
    "check-trust-remote-code",
]
BASELINE_HOOKS = {"mypy"}

_TAGS = {
    ".py": {"python"},
    ".pyi": {"pyi"},
    ".ipynb": {"jupyter"},
    ".rs": {"rust"},
    ".proto": {"proto"},
}
_BINARY = {".png", ".jpg", ".jpeg", ".gif", ".gz", ".tar", ".zip", ".whl", ".so", ".pt"}


def tags(path: str) -> set[str]:
    """pre-commit's (identify's) file type tags, for the types these hooks name."""
    ext = os.path.splitext(path)[1]
    return (set() if ext in _BINARY else {"text"}) | _TAGS.get(ext, set())


@dataclass
class Hook:
    id: str
    argv: list[str]
    files: str = ""
    exclude: str = "^$"
    types: list[str] = field(default_factory=list)
    types_or: list[str] = field(default_factory=list)

    @classmethod
    def from_config(cls, hid: str, argv: list[str], h: dict, types: dict) -> Hook:
        """The hook as the config declares it; ``types`` fills in the type
        filters the hook's own repository declares (not in the config)."""
        return cls(
            hid,
            argv,
            h.get("files", ""),
            h.get("exclude", "^$"),
            h.get("types", types.get("types", [])),
            h.get("types_or", types.get("types_or", [])),
        )

    def select(self, paths: Iterable[str], top_exclude: str) -> list[str]:
        out = []
        for p in paths:
            t = tags(p)
            if top_exclude and re.search(top_exclude, p):
                continue
            if not re.search(self.files, p) or re.search(self.exclude, p):
                continue
            if self.types and not set(self.types) <= t:
                continue
            if self.types_or and not set(self.types_or) & t:
                continue
            out.append(p)
        return out


def load_hooks(config: Path) -> tuple[str, list[Hook]]:
    """The config's top-level exclude and the hooks this script runs, in order."""
    cfg = yaml.safe_load(config.read_text())
    by_id: dict[str, dict] = {}
    for repo in cfg.get("repos", []):
        for h in repo.get("hooks", []):
            by_id.setdefault(h["id"], h)
    hooks = []
    for hid, (argv, types) in REMOTE.items():
        h = by_id.get(hid)
        if h is None:
            continue
        hooks.append(Hook.from_config(hid, argv, h, types))
    for hid in LOCAL:
        h = by_id.get(hid)
        if h is None:
            raise SystemExit(f"vllm-hooks: {config} has no hook '{hid}'")
        argv = shlex.split(h["entry"]) + list(h.get("args", []))
        hooks.append(Hook.from_config(hid, argv, h, {}))
    return cfg.get("exclude", ""), hooks


# ------------------------------------------------------------------ the entries


def git(tree: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=tree, check=True, capture_output=True, text=True
    ).stdout


def carried_entries(series: Path) -> list[str]:
    data = tomllib.loads(series.read_text())
    return [
        e["name"]
        for e in data.get("entry", [])
        if e.get("status") == "carried" and (e.get("patch") or e.get("overlay"))
    ]


def entry_files(tree: Path, entries: list[str]) -> dict[str, list[str]]:
    """Each file the entries' commits add or modify and still in HEAD -> the entries."""
    owners: dict[str, list[str]] = {}
    for entry in entries:
        commit = git(
            tree, "log", "--format=%H", "-n1", f"--grep=^Stack-Entry: {entry}$", "HEAD"
        ).strip()
        if not commit:
            raise SystemExit(f"vllm-hooks: no commit of entry '{entry}' in {tree}")
        for f in git(tree, "diff", "--name-only", "--diff-filter=d", f"{commit}~1", commit).split():
            if (tree / f).is_file():
                owners.setdefault(f, []).append(entry)
    return dict(sorted(owners.items()))


def base_commit(tree: Path) -> str:
    """The commit below the series: the parent of the first entry commit."""
    first = git(tree, "log", "--reverse", "--format=%H", "--grep=^Stack-Entry: ", "HEAD").split()
    if not first:
        raise SystemExit(f"vllm-hooks: no entry commit in {tree}")
    return git(tree, "rev-parse", f"{first[0]}~1").strip()


def base_tree(tree: Path, commit: str, cache: Path) -> Path:
    """The base commit's files, extracted once (other bases' copies are removed)."""
    dest = cache / commit[:12]
    if dest.is_dir():
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    for old in cache.iterdir():
        shutil.rmtree(old, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=cache))
    archive = subprocess.Popen(["git", "archive", commit], cwd=tree, stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(tmp)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit(f"vllm-hooks: git archive {commit} failed in {tree}")
    tmp.rename(dest)
    return dest


# ------------------------------------------------------------- mypy vs the base

_MYPY_RE = re.compile(
    r"^(?P<path>[^\s:]+\.pyi?):(?P<line>\d+)(?::\d+)?: (?P<sev>error|note): (?P<msg>.*)$"
)


@dataclass
class MypyError:
    path: str
    line: int
    msg: str
    notes: list[str] = field(default_factory=list)

    def key(self) -> str:
        # "already defined on line 294": other line numbers move with the file
        return re.sub(r"\bline \d+", "line N", self.msg)

    def text(self) -> str:
        return "\n".join([f"{self.path}:{self.line}: error: {self.msg}", *self.notes])


def parse_mypy(output: str) -> list[MypyError]:
    errors: list[MypyError] = []
    for raw in output.splitlines():
        m = _MYPY_RE.match(raw)
        if not m:
            continue
        if m["sev"] == "error":
            errors.append(MypyError(m["path"], int(m["line"]), m["msg"]))
        elif errors and errors[-1].path == m["path"]:
            errors[-1].notes.append(raw)
    return errors


def line_map(base: list[str], head: list[str]) -> dict[int, int]:
    """1-based head line -> base line, for the lines the diff leaves unchanged."""
    out = {}
    sm = difflib.SequenceMatcher(None, base, head, autojunk=False)
    for a, b, n in sm.get_matching_blocks():
        for i in range(n):
            out[b + i + 1] = a + i + 1
    return out


def new_errors(
    head: list[MypyError], base: list[MypyError], head_dir: Path, base_dir: Path
) -> tuple[list[MypyError], list[MypyError]]:
    """(errors the entries introduce, errors the base already has)."""
    in_base: dict[str, set[tuple[int, str]]] = {}
    for e in base:
        in_base.setdefault(e.path, set()).add((e.line, e.key()))
    maps: dict[str, dict[int, int]] = {}
    new, old = [], []
    for e in head:
        if e.path not in in_base:
            new.append(e)
            continue
        if e.path not in maps:
            maps[e.path] = line_map(
                (base_dir / e.path).read_text().splitlines(),
                (head_dir / e.path).read_text().splitlines(),
            )
        base_line = maps[e.path].get(e.line)
        (old if (base_line, e.key()) in in_base[e.path] else new).append(e)
    return new, old


# ------------------------------------------------------------------------ main


def run(argv: list[str], cwd: Path, capture: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, text=True, capture_output=capture)


def run_mypy(
    hook: Hook, files: list[str], tree: Path, base_dir: Path, owners: dict[str, list[str]]
) -> bool:
    head = run(hook.argv + files, tree, capture=True)
    head_out = head.stdout + head.stderr
    head_errors = parse_mypy(head_out)
    if head.returncode != 0 and not head_errors:
        print(head_out, end="")
        return False
    if not head_errors:
        print(head_out, end="")
        return True
    base_files = [f for f in files if (base_dir / f).is_file()]
    base = run(hook.argv + base_files, base_dir, capture=True) if base_files else None
    base_errors = parse_mypy(base.stdout + base.stderr) if base else []
    new, old = new_errors(head_errors, base_errors, tree, base_dir)
    for e in new:
        print(f"{e.text()}    (entry: {', '.join(owners.get(e.path, ['?']))})")
    if old:
        counts: dict[str, int] = {}
        for e in old:
            counts[e.path] = counts.get(e.path, 0) + 1
        listing = ", ".join(f"{p} ({n})" for p, n in counts.items())
        print(f"mypy: {len(old)} error(s) the base {base_dir.name} already has (not counted):")
        print(f"    {listing}")
    print(f"mypy: {len(new)} new error(s) in {len(files)} file(s)")
    return not new


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, required=True)
    ap.add_argument("--series", type=Path, required=True)
    ap.add_argument("--base-cache", type=Path, required=True)
    ap.add_argument("--carried", action="store_true", help="every carried entry of the series")
    ap.add_argument("entries", nargs="*")
    args = ap.parse_args(argv)
    if args.carried == bool(args.entries):
        ap.error("name entries or --carried (not both)")
    entries = carried_entries(args.series) if args.carried else args.entries
    tree = args.tree.resolve()
    top_exclude, hooks = load_hooks(tree / ".pre-commit-config.yaml")
    owners = entry_files(tree, entries)
    print(f"vllm-hooks: {len(owners)} files of {' '.join(entries)}", flush=True)

    base_dir: Path | None = None
    failed = []
    for hook in hooks:
        files = hook.select(owners, top_exclude)
        if not files:
            continue
        print(f"--> {hook.id}: {shlex.join(hook.argv)} ({len(files)} files)", flush=True)
        if hook.id in BASELINE_HOOKS:
            if base_dir is None:
                base_dir = base_tree(tree, base_commit(tree), args.base_cache)
            ok = run_mypy(hook, files, tree, base_dir, owners)
        else:
            ok = run(hook.argv + files, tree).returncode == 0
        sys.stdout.flush()
        if not ok:
            failed.append(hook.id)
            print(f"vllm-hooks: FAILED: {hook.id}", file=sys.stderr, flush=True)
    skipped = sorted(f for f in owners if top_exclude and re.search(top_exclude, f))
    if skipped:
        print(f"vllm-hooks: excluded by the config (as pre-commit does): {' '.join(skipped)}")
    print(f"vllm-hooks: {'FAILED: ' + ' '.join(failed) if failed else 'all hooks passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
