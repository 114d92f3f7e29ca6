# SPDX-License-Identifier: Apache-2.0
"""`hybrid-stack pr-stack`: the carried entries as a stack of upstream PRs.

For carried entry N (series order) the work tree gets a branch `pr/NN-<name>`
at the entry's commit, i.e. the base plus entries 1..N, so each branch stacks
on the previous one. Each entry's PR body follows vLLM's template (Purpose,
Test Plan, Test Result, then the base's own checklist) and is written to
`results/pr-stack/NN-<name>.md`, with `index.md` listing the stack:

- Purpose: the entry's purpose line and its description (through the Entry
  object only), without the description's Test Plan / Test Result sections;
- Test Plan: the description's Test Plan text and the exact commands: the
  CPU suite, the entry's CPU / GPU test ids, the commands of its results;
- Test Result: generated, never typed: the number of tests in each test file
  the entry adds, and the rows of every results/*.json that belongs to the
  entry (its metadata names the entry, `entry` / `entries`; or its
  `stack_kernel` is in a module the entry adds and its bench is one of the
  tool's; or its command runs a file the entry adds);
- related upstream PRs and the stack order, and an AI-assistance line.

Nothing leaves the machine unless `--push REMOTE` is given. Running it twice
gives the same branches and byte-identical bodies.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from pathlib import Path

from hybrid_stack.errors import StackError
from hybrid_stack.gitops import Repo
from hybrid_stack.stack import Entry, Stack, load_stack

BRANCH_PREFIX = "pr/"
OWN_SECTIONS = ("test plan", "test result")
AI_LINE = (
    "**AI assistance:** this change, its tests and this description were written with "
    "an AI coding assistant in the vllm-hybrid-stack repository; the submitter reviews "
    "every changed line before marking the PR ready."
)


def branch_name(i: int, entry: Entry) -> str:
    return f"{BRANCH_PREFIX}{i:02d}-{entry.name}"


def sections(description: str) -> tuple[str, list[tuple[str, str]]]:
    """(text before the first '## ' heading, [(heading, text)])."""
    pre: list[str] = []
    out: list[tuple[str, list[str]]] = []
    for line in description.strip().splitlines():
        if line.startswith("## "):
            out.append((line[3:].strip(), []))
        elif out:
            out[-1][1].append(line)
        else:
            pre.append(line)
    return "\n".join(pre).strip(), [(h, "\n".join(t).strip()) for h, t in out]


def tool_benches() -> set[str]:
    here = Path(__file__).parent / "bench"
    return {p.stem for p in here.glob("*.py") if p.stem not in ("__init__", "common")}


def _module_files(dotted: str) -> list[str]:
    parts = dotted.split()[0].split(".")
    return ["/".join(parts[:n]) + ".py" for n in range(len(parts), 0, -1)]


def entry_results(stack: Stack, entry: Entry) -> list[tuple[str, dict]]:
    """results/*.json that belong to `entry` (see the module doc), by path."""
    out = []
    benches = tool_benches()
    for path in sorted((stack.root / "results").glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError as e:
            raise StackError(f"{path} is not valid JSON ({e}): fix or remove it") from None
        if not isinstance(data, dict):
            continue
        named = data.get("entry") == entry.name or entry.name in data.get("entries", [])
        kernel = str(data.get("stack_kernel", ""))
        by_kernel = (
            bool(kernel)
            and data.get("bench") in benches
            and any(f in entry.overlay for f in _module_files(kernel))
        )
        command = str(data.get("command", ""))
        by_command = any(f in command for f in entry.overlay if not f.startswith("tests/"))
        if named or by_kernel or by_command:
            out.append((path.relative_to(stack.root).as_posix(), data))
    return out


def _num(v: object) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k}={_num(x)}" for k, x in v.items())
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def results_markdown(path: str, data: dict, max_rows: int = 60) -> list[str]:
    env = ", ".join(
        f"{k} {data[k]}" for k in ("vllm_base", "torch", "triton", "cuda") if data.get(k)
    )
    lines = [
        f"**{data.get('bench', Path(path).stem)}** on {data.get('gpu_name', data.get('gpu', '?'))}"
        f" (`{path}`; {env})",
        "",
        f"Command: `{data.get('command', '?')}`",
        "",
    ]
    if data.get("legend"):
        lines += [str(data["legend"]), ""]
    rows = data.get("rows", [])
    lines += ["| case | metric | baseline | value | ratio |", "|---|---|---|---|---|"]
    lines += [
        f"| {_num(r.get('case'))} | {r.get('metric')} | {_num(r.get('baseline'))} | "
        f"{_num(r.get('value'))} | {_num(r.get('ratio'))} |"
        for r in rows[:max_rows]
    ]
    if len(rows) > max_rows:
        lines.append(f"| ... | {len(rows) - max_rows} more rows in `{path}` | | | |")
    lines.append("")
    if isinstance(data.get("tests"), str):
        lines += [f"Tests recorded with these results: {data['tests']}", ""]
    return lines


def count_tests(source: str) -> int:
    """Test functions in a pytest file: module-level test_* and test_* methods
    of Test* classes (parametrized cases count once)."""
    tree = ast.parse(source)
    n = 0
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith(
            "test"
        ):
            n += 1
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            n += sum(
                1
                for m in node.body
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                and m.name.startswith("test")
            )
    return n


def template_checklist(repo: Repo, base: str) -> list[str]:
    """The base's PR template from its '---' on, AI-assistance box ticked."""
    got = repo.blob(base, ".github/PULL_REQUEST_TEMPLATE.md")
    if got is None:
        return []
    text = got[1].decode(errors="replace")
    if "\n---\n" not in text:
        return []
    tail = text.split("\n---\n", 1)[1].strip("\n")
    tail = re.sub(r"- \[ \] (AI assistance was used)", r"- [x] \1", tail)
    return ["---", "", tail, ""]


def pr_body(
    stack: Stack,
    repo: Repo,
    entries: list[Entry],
    i: int,
    base: str,
) -> str:
    entry = entries[i - 1]
    n = len(entries)
    pre, secs = sections(entry.description)
    by_name = {h.lower(): t for h, t in secs}
    below = f"`{branch_name(i - 1, entries[i - 2])}`" if i > 1 else f"vLLM `{stack.pin.tag}`"
    lines = [
        "<!-- Generated by `hybrid-stack pr-stack` from patches/series.toml and results/; "
        "do not edit by hand. -->",
        f"# {entry.subject}",
        "",
        f"PR {i} of {n} of the vllm-hybrid-stack series on vLLM {stack.pin.version}: branch "
        f"`{branch_name(i, entry)}`, stacked on {below}.",
        "",
        "## Purpose",
        "",
        entry.purpose.strip() + ".",
        "",
    ]
    if pre:
        lines += [pre, ""]
    for h, t in secs:
        if h.lower() == "purpose":
            lines += [t, ""]
        elif h.lower() not in OWN_SECTIONS:
            lines += [f"### {h}", "", t, ""]
    results = entry_results(stack, entry)
    lines += ["## Test Plan", ""]
    if by_name.get("test plan"):
        lines += [by_name["test plan"], ""]
    lines += ["Exact commands:", "", "```bash"]
    lines += [
        "# CPU, from a vllm-hybrid-stack checkout (this stack's tree, Python-only build):",
        "hybrid-stack apply && hybrid-stack build && hybrid-stack test",
    ]
    if entry.cpu_tests:
        lines.append("# ... whose suite includes this PR's CPU tests:")
        lines += [f"#   {t}" for t in entry.cpu_tests]
    if entry.gpu_tests:
        lines += ["# GPU:", "pytest -v " + " ".join(entry.gpu_tests)]
    for path, data in results:
        lines.append(f"# {path}:")
        lines.append(str(data.get("command", "?")))
    lines += ["```", "", "## Test Result", ""]
    tests = [p for p in entry.overlay if Path(p).name.startswith("test_")]
    if tests:
        lines += ["Tests this PR adds:", "", "| file | test functions |", "|---|---|"]
        for p in tests:
            count = count_tests((stack.overlay_dir / p).read_text())
            lines.append(f"| `{p}` | {count} |")
        lines.append("")
    if results:
        for path, data in results:
            lines += results_markdown(path, data)
    else:
        lines += ["No committed results file (`results/*.json`) belongs to this entry.", ""]
    lines += ["## Related", ""]
    if entry.upstream_pr:
        lines.append(f"- Upstream PR: {entry.upstream_pr}")
    for j, e in enumerate(entries[: i - 1], 1):
        lines.append(f"- Depends on PR {j} of the stack: {e.subject} (`{branch_name(j, e)}`)")
    for e in stack.entries:
        if not e.carried and e.upstream_pr:
            lines.append(f"- Earlier upstreamed work of the series: {e.upstream_pr} ({e.name})")
    lines += ["", AI_LINE, ""]
    lines += template_checklist(repo, base)
    return "\n".join(lines).rstrip() + "\n"


def index_markdown(stack: Stack, entries: list[Entry], stats: list[str]) -> str:
    lines = [
        "<!-- Generated by `hybrid-stack pr-stack`; do not edit by hand. -->",
        f"# The stack as upstream PRs (vLLM {stack.pin.version})",
        "",
        "Each branch is the base plus the entries up to it; open each PR against the one "
        "below it (the first against vLLM's main), e.g. "
        "`gh pr create --head pr/01-... --body-file results/pr-stack/01-....md`.",
        "Command: `hybrid-stack pr-stack` (dry run: branches in work/vllm only; "
        "`--push REMOTE` pushes them).",
        "",
        "| # | branch | on | title | files, +/- | body |",
        "|---|---|---|---|---|---|",
    ]
    for i, e in enumerate(entries, 1):
        below = branch_name(i - 1, entries[i - 2]) if i > 1 else stack.pin.tag
        lines.append(
            f"| {i} | `{branch_name(i, e)}` | `{below}` | {e.subject} | {stats[i - 1]} | "
            f"[{i:02d}-{e.name}.md]({i:02d}-{e.name}.md) |"
        )
    return "\n".join(lines) + "\n"


def _is_current(path: Path, text: str) -> bool:
    return path.is_file() and path.read_text() == text


def _write_if_changed(path: Path, text: str) -> bool:
    if _is_current(path, text):
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return True


def pr_stack(
    stack: Stack, work: Path, out: Path, push: str = "", check: bool = False
) -> list[tuple[str, str]]:
    """Branches and bodies; returns [(branch, commit)]. With ``check`` nothing is
    written (no branch, no body): a body or index that differs from what would be
    written, or one that would be removed, raises StackError."""
    from hybrid_stack.applier import open_work
    from hybrid_stack.workstate import commit_entries, current_files, export_files

    repo = open_work(stack, work)
    if export_files(stack, work) != current_files(stack):
        raise StackError(
            f"{work} and patches/ / overlay/ disagree: run hybrid-stack apply (or export) "
            "so the PRs are the committed series, then pr-stack"
        )
    base = repo.rev(stack.pin.tag)
    pairs = commit_entries(stack, repo, base)
    entries = [stack.entry(name) for _, name in pairs]
    branches = []
    stats = []
    wanted: dict[str, str] = {}
    for i, ((commit, _), e) in enumerate(zip(pairs, entries), 1):
        name = branch_name(i, e)
        if not check:
            repo.run("branch", "--force", "--no-track", name, commit)
        branches.append((name, commit))
        num = repo.run("diff", "--numstat", f"{commit}~1", commit).splitlines()
        add = sum(int(x.split("\t")[0]) for x in num if x.split("\t")[0].isdigit())
        rem = sum(int(x.split("\t")[1]) for x in num if x.split("\t")[1].isdigit())
        stats.append(f"{len(num)}, +{add}/-{rem}")
        wanted[f"{i:02d}-{e.name}.md"] = pr_body(stack, repo, entries, i, base)
    wanted["index.md"] = index_markdown(stack, entries, stats)
    if check:
        stale = [n for n, text in wanted.items() if not _is_current(out / n, text)]
        stale += [p.name for p in sorted(out.glob("*.md")) if p.name not in wanted]
        if stale:
            raise StackError(f"{out} is stale ({', '.join(stale)}): run hybrid-stack pr-stack")
        return branches
    # wanted keeps the entries' order, index.md last
    for i, ((name, commit), fname) in enumerate(zip(branches, wanted), 1):
        if _write_if_changed(out / fname, wanted[fname]):
            print(f"pr-stack: wrote {out / fname}")
        print(f"pr-stack: [{i}/{len(entries)}] {name} at {commit[:12]}")
    _write_if_changed(out / "index.md", wanted["index.md"])
    for stale in sorted(out.glob("*.md")):
        if stale.name not in wanted:
            stale.unlink()
            print(f"pr-stack: removed {stale}")
    keep = {b for b, _ in branches}
    for ref in repo.run("for-each-ref", "--format=%(refname:short)", "refs/heads/pr/").split():
        if ref not in keep:
            repo.run("branch", "-D", ref)
            print(f"pr-stack: deleted stale branch {ref}")
    if push:
        print(f"pr-stack: pushing {len(branches)} branches to {push}")
        repo.run("push", "--force-with-lease", push, *[f"{b}:{b}" for b, _ in branches])
    return branches


def run(args: argparse.Namespace) -> int:
    stack = load_stack(args.root)
    work = (args.work or stack.default_work).resolve()
    out = (args.out or stack.root / "results" / "pr-stack").resolve()
    if args.check:
        if args.push:
            raise StackError("--check writes nothing; it does not take --push")
        pr_stack(stack, work, out, check=True)
        print(f"pr-stack: {out} is current")
        return 0
    branches = pr_stack(stack, work, out, args.push)
    where = f"pushed to {args.push}" if args.push else "local only (no --push)"
    print(f"pr-stack: {len(branches)} branches in {work}, bodies in {out}; {where}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("pr-stack", help="one stacked branch and PR body per carried entry")
    p.add_argument("--work", type=Path, default=None, help="work tree (default work/vllm)")
    p.add_argument("--out", type=Path, default=None, help="bodies (default results/pr-stack)")
    p.add_argument("--push", default="", metavar="REMOTE", help="push the branches to REMOTE")
    p.add_argument(
        "--check",
        action="store_true",
        help="write nothing; fail when the bodies in --out are not what pr-stack writes",
    )
    p.set_defaults(func=run)
