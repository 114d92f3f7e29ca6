# SPDX-License-Identifier: Apache-2.0
"""`hybrid-stack rebase <version>`: move the series onto another vLLM release.

The work tree's entry commits are replayed one by one onto the target's base
commit (the target sdist, fetched and verified like `fetch` does, or a git ref
with `--source git`), each classified as:

  clean      the entry's diff applies to the new base as it is
  3-way      it applies only through a three-way merge (git cherry-pick)
  upstream   the new base already holds the change (the reverse diff applies,
             or its patch-id equals that of the upstream change to the same
             files): the entry becomes empty, marked upstreamed in the release
  obsolete   every upstream file the entry modifies is gone from the new base
  conflict   the merge leaves conflicts (files and hunks are reported)

A conflict or an obsolete entry stops the rebase, resumable: resolve in the
work tree (git add; for an obsolete entry port the change and commit it with
its Stack-Entry trailer), then `rebase --continue`. `rebase --abort` puts the
pin, patches/, overlay/ and the work tree back exactly as they were. At the
end the series is exported into patches/ and overlay/, the work tree rebuilt
canonically by apply, the report written, and the pin replaced last, in one
atomic rename: an interrupted rebase never leaves a half-moved pin, and
`--continue` (or `--abort`) recovers from any point.

`--dry-run` replays into a throwaway clone, goes on past conflicts and only
writes the report: which entries need work on that release, and why.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import tempfile
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hybrid_stack.errors import StackError, first_few
from hybrid_stack.gitops import Repo
from hybrid_stack.stack import TRAILER_ENTRY, Artifact, Entry, Pin, Stack, load_series, load_stack

OUTCOMES = ("clean", "3-way", "upstream", "obsolete", "conflict")
OUTCOME_TEXT = {
    "clean": "applied cleanly",
    "3-way": "applied with a 3-way merge",
    "upstream": "already upstream",
    "obsolete": "obsolete",
    "conflict": "conflict",
    "resolved": "resolved by hand",
}
PRE_REBASE_REF = "refs/hybrid-stack/pre-rebase"
TRAILER_RE = re.compile(rf"^{TRAILER_ENTRY}:\s*(\S+)\s*$", re.MULTILINE)


# -- where the state lives ---------------------------------------------------------
def state_dir(stack: Stack) -> Path:
    return stack.root / "work" / "rebase"


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_pin(stack: Stack, text: str) -> None:
    """Replace patches/pin.toml in one atomic rename (never half-written)."""
    _write_atomic(stack.patches_dir / "pin.toml", text.encode())


def rebasing(root: Path | None) -> Stack:
    """The stack whose rebase --continue and --abort act on: root's own, or the
    refresh of the port at root that `hybrid-stack port` stages in its work dir
    (hybrid_stack.port.refresh_root), so the port's --root reaches it. The port
    is not read first: a finish killed while installing it may have left it half made."""
    from hybrid_stack.port import refresh_root
    from hybrid_stack.stack import find_root

    root = (root or find_root()).resolve()
    staged = refresh_root(root)
    if (
        not (root / "work" / "rebase" / "state.json").is_file()
        and (staged / "work" / "rebase" / "state.json").is_file()
    ):
        root = staged
    return load_stack(root, check_files=False)


def load_state(stack: Stack) -> dict | None:
    try:
        return json.loads((state_dir(stack) / "state.json").read_text())
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise StackError(
            f"{state_dir(stack)}/state.json is unreadable ({e}): restore it or remove "
            f"{state_dir(stack)} and run apply"
        ) from None


def save_state(stack: Stack, state: dict) -> None:
    _write_atomic(state_dir(stack) / "state.json", (json.dumps(state, indent=1) + "\n").encode())


# -- the target ----------------------------------------------------------------------
def pin_text(old_text: str, old: Pin, new: Pin) -> str:
    """The pin file moved from `old` to `new`: the same text with the version,
    artifacts and git ref replaced, so comments and layout stay as they are."""

    def art(key: str, a: Artifact) -> str:
        return f'{key} = {{ filename = "{a.filename}", sha256 = "{a.sha256}" }}'

    text = re.sub(r'(?m)^version\s*=\s*"[^"]*"', f'version = "{new.version}"', old_text, count=1)
    text = re.sub(r"(?m)^sdist\s*=.*$", art("sdist", new.sdist), text, count=1)
    if new.wheel:
        text = re.sub(r"(?m)^wheel\s*=.*$", art("wheel", new.wheel), text, count=1)
    else:
        text = re.sub(r"(?m)^wheel\s*=.*\n", "", text, count=1)
    if old.git_ref:
        text = re.sub(r'(?m)^ref\s*=\s*"[^"]*"', f'ref = "{new.git_ref}"', text, count=1)
    return text


def _announced(project: str, filename: str) -> tuple[str, str]:
    """(url, sha256) of a file on the first configured index that lists it."""
    from hybrid_stack.downloads import find_file_url, pip_indexes

    errors = []
    for index in pip_indexes():
        try:
            return find_file_url(index, project, filename)
        except StackError as e:
            errors.append(str(e))
    raise StackError(f"{filename} is on no configured index ({'; '.join(errors)})")


def fetch_target(stack: Stack, version: str, git_ref: str = "") -> Pin:
    """The pin for `version`: its sdist downloaded (or cached) and verified
    against the sha256 the index announces; the wheel named like the pinned
    one, with its announced sha256, where the index lists it."""
    from hybrid_stack.downloads import dist_dir, download, sha256_file

    old = stack.pin
    filename = f"{old.project}-{version}.tar.gz"
    url, sha = _announced(old.project, filename)
    if not sha:
        raise StackError(
            f"the index announces no sha256 for {filename}, so it cannot be verified: "
            "use an index that publishes hashes (PEP 503 #sha256= or PEP 691)"
        )
    dest = dist_dir() / filename
    if dest.is_file() and sha256_file(dest) != sha:
        raise StackError(
            f"cached {dest} does not match the sha256 the index announces ({sha}): delete it "
            "and run rebase again"
        )
    if not dest.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        print(f"rebase: fetching {filename} from {urllib.parse.urlparse(url).netloc or url}")
        download(url, dest)
        got = sha256_file(dest)
        if got != sha:
            dest.unlink()
            raise StackError(
                f"{filename}: downloaded sha256 {got} != announced {sha}; try again, or "
                "check the index"
            )
    print(f"rebase: {filename} sha256 {sha[:16]}... verified")
    wheel = None
    if old.wheel:
        wname = old.wheel.filename.replace(f"-{old.version}-", f"-{version}-", 1)
        try:
            _, wsha = _announced(old.project, wname)
        except StackError:
            wsha = ""
        wheel = Artifact(wname, wsha) if wsha else None
        if not wheel:
            print(f"rebase: {wname} is not on the index: the new pin has no wheel")
    return Pin(
        project=old.project,
        version=version,
        sdist=Artifact(filename, sha),
        wheel=wheel,
        git_url=old.git_url,
        git_ref=git_ref or (f"v{version}" if old.git_ref else ""),
        local_path=old.local_path,
    )


def target_from_ref(stack: Stack, ref: str) -> tuple[str, str]:
    """(version, git ref) for `rebase REF` with --source git."""
    if not stack.pin.git_url:
        raise StackError("patches/pin.toml has no [upstream.git] url: add one or use the sdist")
    return ref.removeprefix("v"), ref


# -- replaying one entry ----------------------------------------------------------
@dataclass
class Outcome:
    name: str
    outcome: str
    files: list[str] = field(default_factory=list)
    hunks: list[str] = field(default_factory=list)
    detail: str = ""


def _diff_file(repo: Repo, commit: str, tmp: Path) -> Path:
    patch = tmp / f"{commit[:12]}.diff"
    data = repo._execute(
        ("diff", "--binary", "--full-index", "--no-renames", f"{commit}~1", commit),
        strip_newline_in_stdout=False,
        stdout_as_string=False,
    )
    patch.write_bytes(data)
    return patch


def _name_status(repo: Repo, a: str, b: str, paths: list[str] | None = None) -> list[tuple]:
    out = repo.run(
        "diff", "--name-status", "--no-renames", a, b, *(["--", *paths] if paths else [])
    )
    return [tuple(line.split("\t", 1)) for line in out.splitlines() if line]


def _hunk_ids(repo: Repo, a: str, b: str, paths: list[str]) -> list[str]:
    """A patch-id per hunk of `git diff a b -- paths`: the file and the changed
    lines with whitespace removed (as `git patch-id` does), line numbers ignored."""
    diff = repo._execute(
        ("diff", "--full-index", "--no-renames", "--unified=0", a, b, "--", *paths),
        strip_newline_in_stdout=False,
        stdout_as_string=False,
    ).decode(errors="replace")
    ids: list[str] = []
    current, lines = "", []

    def close() -> None:
        if lines:
            ids.append(hashlib.sha1("\n".join([current, *lines]).encode()).hexdigest())
            lines.clear()

    for line in diff.splitlines():
        if line.startswith("diff --git "):
            close()
            current = line.split(" b/", 1)[-1]
        elif line.startswith("@@"):
            close()
        elif line[:1] in "+-" and not line.startswith(("+++ ", "--- ")):
            lines.append(line[0] + "".join(line[1:].split()))
    close()
    return ids


def _exists(repo: Repo, commit: str, path: str) -> bool:
    return bool(repo.run("ls-tree", commit, "--", path))


def _conflict_regions(work: Path, files: list[str]) -> list[str]:
    out = []
    for f in files:
        try:
            lines = (work / f).read_text(errors="replace").splitlines()
        except OSError:
            out.append(f"{f}: (deleted on one side)")
            continue
        at = [str(i + 1) for i, line in enumerate(lines) if line.startswith("<<<<<<< ")]
        if at:
            out.append(f"{f}: {len(at)} conflict region(s) at line(s) {', '.join(at)}")
        else:
            out.append(f"{f}: changed here, deleted or added on the other side")
    return out


def _failed_hunks(repo: Repo, patch: Path) -> list[str]:
    """The patch hunks that do not apply as they are (git apply -v, no 3-way)."""
    _, _, stderr = repo.status("apply", "--check", "--verbose", "--cached", str(patch))
    heads: dict[tuple[str, int], str] = {}
    current = ""
    for line in patch.read_text(errors="replace").splitlines():
        if line.startswith("--- a/"):
            current = line[6:]
        elif line.startswith("@@ ") and current and (m := re.match(r"@@ -(\d+)", line)):
            heads[(current, int(m.group(1)))] = line.split(" @@")[0] + " @@"
    out = []
    for line in stderr.splitlines():
        m = re.match(r"^error: patch failed: (.+):(\d+)$", line.strip())
        if m:
            f, at = m.group(1), int(m.group(2))
            out.append(f"{f}: {heads.get((f, at), f'hunk at line {at}')}")
    return out


def classify_and_replay(
    repo: Repo, commit: str, entry: Entry, old_base: str, new_base: str, tmp: Path
) -> Outcome:
    """Replay one entry commit onto HEAD (detached); leave a conflict in place."""
    patch = _diff_file(repo, commit, tmp)
    changes = _name_status(repo, f"{commit}~1", commit)
    files = [p for _, p in changes]
    modified = [p for s, p in changes if s[0] in "MD"]
    # obsolete: every upstream file it edits is gone
    gone = [p for p in modified if not _exists(repo, "HEAD", p)]
    if modified and len(gone) == len(modified):
        return Outcome(
            entry.name,
            "obsolete",
            files=gone,
            detail=f"the new base has none of the files it edits ({first_few(gone)})",
        )
    # already upstream: the change is present, or upstream made the same change
    present = repo.ok("apply", "--check", "--reverse", "--cached", str(patch))
    mine = _hunk_ids(repo, f"{commit}~1", commit, files)
    theirs = set(_hunk_ids(repo, old_base, new_base, files))
    same_pid = bool(mine) and all(h in theirs for h in mine)
    if present or same_pid:
        how = []
        if same_pid:
            how.append(
                f"the patch-id of each of its {len(mine)} hunk(s) is among upstream's changes"
            )
        if present:
            how.append("the new base already holds its change (the reverse diff applies)")
        return Outcome(entry.name, "upstream", files=files, detail="; ".join(how))
    clean = repo.ok("apply", "--check", "--cached", str(patch))
    hunks = [] if clean else _failed_hunks(repo, patch)
    repo.run("cherry-pick", commit, check=False)
    if repo.operation_in_progress():
        unmerged = [f for f in repo.run("diff", "--name-only", "--diff-filter=U").splitlines() if f]
        if not unmerged and repo.run("diff", "--cached", "--name-only") == "":
            repo.run("cherry-pick", "--skip", check=False)
            return Outcome(
                entry.name, "upstream", files=files, detail="the merge left nothing to commit"
            )
        why = []
        for f in unmerged:
            num = repo.run("diff", "--numstat", old_base, new_base, "--", f)
            if num:
                add, rem = num.split("\t")[:2]
                why.append(f"`{f}` +{add}/-{rem}")
        return Outcome(
            entry.name,
            "conflict",
            files=unmerged,
            hunks=hunks + _conflict_regions(repo.path, unmerged),
            detail=f"{len(unmerged)} file(s) with conflicts; upstream changed "
            + (", ".join(why) if why else "none of them")
            + " from the old base to the new"
            + (f"; gone in the new base: {', '.join(gone)}" if gone else ""),
        )
    if repo.run("rev-parse", "HEAD~1^{tree}") == repo.run("rev-parse", "HEAD^{tree}"):
        repo.run("reset", "--quiet", "--hard", "HEAD~1")
        return Outcome(entry.name, "upstream", files=files, detail="the merge changed nothing")
    if clean:
        return Outcome(entry.name, "clean", files=files)
    return Outcome(
        entry.name,
        "3-way",
        files=files,
        hunks=hunks,
        detail=f"{len(hunks)} hunk(s) needed the merge" if hunks else "context moved",
    )


# -- range-diff and tests ---------------------------------------------------------
def range_diff(repo: Repo, a_base: str, a_head: str, b_base: str, b_head: str) -> list[dict]:
    """Per commit pair of `git range-diff`: {a, b, relation, subject, text}."""
    out = repo.run(
        "range-diff",
        "--no-color",
        "--creation-factor=95",
        f"{a_base}..{a_head}",
        f"{b_base}..{b_head}",
        strip=False,
    )
    pairs: list[dict] = []
    head_re = re.compile(r"^\s*(-|\d+):\s+(\S+) ([=!<>]) \s*(-|\d+):\s+(\S+) (.*)$")
    for line in out.splitlines():
        m = head_re.match(line)
        if m:
            sha = m.group(5) if m.group(3) != "<" else m.group(2)
            names = TRAILER_RE.findall(repo.message(sha)) if sha.strip("-") else []
            pairs.append(
                {
                    "a": m.group(1),
                    "relation": m.group(3),
                    "b": m.group(4),
                    "subject": m.group(6),
                    "entry": names[0] if len(names) == 1 else "",
                }
            )
            pairs[-1]["text"] = []
        elif pairs:
            pairs[-1]["text"].append(line)
    for p in pairs:
        p["text"] = "\n".join(p["text"]).rstrip()
    return pairs


RELATION = {"=": "unchanged", "!": "changed", "<": "only before", ">": "only after"}


def entry_of_subject(entries: list[Entry], subject: str) -> str:
    for e in entries:
        if e.subject.strip() == subject.strip():
            return e.name
    return subject


def _pair_name(p: dict, entries: list[Entry]) -> str:
    return p.get("entry") or entry_of_subject(entries, p["subject"])


def range_diff_markdown(pairs: list[dict], entries: list[Entry], a: str, b: str) -> str:
    lines = [
        f"| entry | {a} -> {b} |",
        "|---|---|",
        *[f"| `{_pair_name(p, entries)}` | {RELATION[p['relation']]} |" for p in pairs],
        "",
    ]
    for p in pairs:
        if p["relation"] == "!" and p["text"]:
            lines += [
                f"<details><summary><code>{_pair_name(p, entries)}</code>: "
                "what changed in the patch</summary>",
                "",
                "```diff",
                p["text"],
                "```",
                "</details>",
                "",
            ]
    return "\n".join(lines)


def test_files(
    repo: Repo, entry: Entry, commit: str | None, owned: frozenset[str] = frozenset()
) -> list[str]:
    """Upstream test files under an entry: its cpu/gpu tests that no entry
    owns (overlay), plus upstream test files its patch edits."""
    out: list[str] = []
    for t in (*entry.cpu_tests, *entry.gpu_tests):
        path = t.removeprefix("native:").strip().split("::", 1)[0]
        if path not in entry.overlay and path not in owned and path not in out:
            out.append(path)
    if commit:
        for status, p in _name_status(repo, f"{commit}~1", commit):
            name = Path(p).name
            if (
                status[0] == "M"
                and p.startswith("tests/")
                and name.startswith("test_")
                and p not in out
                and p not in owned
            ):
                out.append(p)
    return out


def upstream_test_changes(
    repo: Repo, entries: list[tuple[Entry, str | None]], old_base: str, new_base: str
) -> list[tuple[str, str, str]]:
    """[(test file, entries, change)] between the two bases."""
    owners: dict[str, list[str]] = {}
    owned = frozenset(p for e, _ in entries for p in e.overlay)
    for e, c in entries:
        for f in test_files(repo, e, c, owned):
            owners.setdefault(f, []).append(e.name)
    rows = []
    for f, names in owners.items():
        a, b = _exists(repo, old_base, f), _exists(repo, new_base, f)
        if not a and not b:
            change = "in neither base"
        elif not b:
            change = "removed in the new base"
        elif not a:
            change = "added in the new base"
        else:
            num = repo.run("diff", "--numstat", old_base, new_base, "--", f)
            if num:
                add, rem = num.split("\t")[:2]
                change = f"changed (+{add}/-{rem})"
            else:
                change = "unchanged"
        rows.append((f, ", ".join(names), change))
    return rows


# -- the report ------------------------------------------------------------------------
def report_markdown(state: dict, entries: list[Entry], extra: str = "") -> str:
    outs = [Outcome(**o) for o in state["outcomes"]]
    counts = {k: sum(1 for o in outs if o.outcome == k) for k in OUTCOME_TEXT}
    lines = [
        f"# Rebase of the stack onto vLLM {state['new_version']}",
        "",
        f"Command: `{state['command']}`"
        + (f" (run by `{state['run_by']}`)" if state.get("run_by") else ""),
        "",
        f"From vLLM {state['old_version']} (`{state['old_sdist']}`) to "
        f"{state['new_version']} (`{state['new_sdist']}`, sha256 `{state['new_sha256']}`, "
        "verified against the index)"
        + (f", source {state['source']}" if state["source"] != "sdist" else "")
        + ". Generated by `hybrid-stack rebase`; do not edit by hand.",
        "",
        "Summary: "
        + ", ".join(f"{counts[k]} {OUTCOME_TEXT[k]}" for k in OUTCOME_TEXT if counts[k])
        + f" (of {len(outs)} carried entries).",
        "",
        "| # | entry | outcome | files | detail |",
        "|---|---|---|---|---|",
    ]
    for i, o in enumerate(outs, 1):
        files = ", ".join(f"`{f}`" for f in o.files[:4]) + (
            f" (+{len(o.files) - 4})" if len(o.files) > 4 else ""
        )
        lines.append(f"| {i} | `{o.name}` | {OUTCOME_TEXT[o.outcome]} | {files} | {o.detail} |")
    need = [o for o in outs if o.outcome in ("conflict", "obsolete", "resolved")]
    lines += ["", "## Entries that need work", ""]
    if not need:
        lines.append("None: every entry replays without a hand edit.")
    for o in need:
        lines += [f"### `{o.name}`: {OUTCOME_TEXT[o.outcome]}", ""]
        if o.detail:
            lines += [o.detail, ""]
        lines += [f"- {h}" for h in o.hunks] + ([""] if o.hunks else [])
    notes = [
        e
        for e in entries
        if e.status == "upstreamed" and _ver(e.upstreamed_in) > _ver(state["new_version"])
    ]
    if notes:
        lines += ["## Entries upstreamed after this release", ""]
        lines += [
            f"- `{e.name}` is upstream only since {e.upstreamed_in}: on "
            f"{state['new_version']} the stack would have to carry it again ({e.upstream_pr})."
            for e in notes
        ]
        lines.append("")
    lines += [
        "## Upstream tests that changed under the entries",
        "",
        f"The entries' `cpu_tests` / `gpu_tests` files that upstream owns and the upstream test "
        f"files their patches edit, compared between v{state['old_version']} and "
        f"v{state['new_version']}. To run the new base's CPU suite and the entries' tests: "
        "`hybrid-stack build && hybrid-stack test` (after the rebase).",
        "",
        "| test file | entries | change |",
        "|---|---|---|",
        *[f"| `{f}` | {n} | {c} |" for f, n, c in state.get("tests", [])],
        "",
    ]
    if state.get("notes"):
        lines += [f"## Notes (from `{state['notes'][0]}`, by the person who ran it)", ""]
        lines += [state["notes"][1].strip(), ""]
    if extra:
        lines += [extra, ""]
    return "\n".join(lines).rstrip() + "\n"


def _ver(v: str) -> tuple:
    return tuple(int(x) if x.isdigit() else 0 for x in re.split(r"[.+-]", v))


# -- the verb ----------------------------------------------------------------------
def _stack_files(stack: Stack) -> dict[str, tuple[int, bytes]]:
    """patches/ (every file) and overlay/: stack-relative path -> (mode, bytes)."""
    out = {}
    for sub in ("patches", "overlay"):
        d = stack.root / sub
        if d.is_dir():
            for f in sorted(d.rglob("*")):
                if f.is_file():
                    out[f.relative_to(stack.root).as_posix()] = (
                        f.stat().st_mode & 0o777,
                        f.read_bytes(),
                    )
    return out


def _save_files(stack: Stack) -> None:
    saved = state_dir(stack) / "saved"
    if saved.exists():
        shutil.rmtree(saved)
    for rel, (mode, data) in _stack_files(stack).items():
        p = saved / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        os.chmod(p, mode)


def _restore_files(stack: Stack) -> None:
    saved = state_dir(stack) / "saved"
    keep = {}
    for f in saved.rglob("*"):
        if f.is_file():
            keep[f.relative_to(saved).as_posix()] = (f.stat().st_mode & 0o777, f.read_bytes())
    for rel in _stack_files(stack):
        if rel not in keep:
            (stack.root / rel).unlink()
    pin = keep.pop("patches/pin.toml")
    for rel, (mode, data) in keep.items():
        p = stack.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if not p.is_file() or p.read_bytes() != data:
            p.write_bytes(data)
        os.chmod(p, mode)
    overlay = stack.overlay_dir
    for d in sorted(overlay.rglob("*"), key=lambda p: -len(p.parts)) if overlay.is_dir() else []:
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()
    # pin.toml last, atomically
    write_pin(stack, pin[1].decode())


def _fetch_base(stack: Stack, repo: Repo, new: Pin, source: str) -> str:
    """Bring the new base commit (and its tag) into the work tree; return it."""
    from hybrid_stack.applier import ensure_base

    base_dir = ensure_base(Stack(root=stack.root, pin=new, entries=stack.entries), source)
    repo.run(
        "fetch", "--quiet", "--no-tags", str(base_dir), f"+refs/tags/{new.tag}:refs/tags/{new.tag}"
    )
    return repo.rev(new.tag)


def _move_outputs(project: str, src: Path, dest: Path) -> None:
    """Replace the setuptools build outputs (untracked, ignored) in dest by src's."""
    from hybrid_stack.applier import build_outputs

    for out in build_outputs(project):
        p, q = dest / out, src / out
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
        if q.is_dir():
            shutil.copytree(q, p)
        elif q.is_file():
            p.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(q, p)


def _copy_outputs(stack: Stack, pin: Pin, source: str, work: Path) -> None:
    from hybrid_stack.applier import ensure_base

    s = Stack(root=stack.root, pin=pin, entries=stack.entries)
    _move_outputs(pin.project, ensure_base(s, source), work)


def _entry_commits(stack: Stack, repo: Repo, base: str) -> list[tuple[str, str]]:
    out = []
    for c in repo.commits(base):
        names = TRAILER_RE.findall(repo.message(c))
        out.append((c, names[0] if len(names) == 1 else ""))
    return out


def _replay(stack: Stack, repo: Repo, state: dict, dry: bool) -> bool:
    """Replay state's entries from HEAD on; False when stopped at one."""
    done = {o["name"] for o in state["outcomes"]}
    entries = {e.name: e for e in stack.entries}
    with tempfile.TemporaryDirectory(prefix="hybrid-stack-rebase-") as tmp:
        for i, item in enumerate(state["entries"]):
            if item["name"] in done:
                continue
            e = entries[item["name"]]
            t0 = time.monotonic()
            o = classify_and_replay(
                repo, item["commit"], e, state["old_base"], state["new_base"], Path(tmp)
            )
            state["outcomes"].append(asdict(o))
            print(
                f"rebase: [{i + 1}/{len(state['entries'])}] {e.name}: {OUTCOME_TEXT[o.outcome]}"
                + (f" ({o.detail})" if o.detail else "")
                + f" ({time.monotonic() - t0:.1f} s)"
            )
            if o.outcome in ("conflict", "obsolete"):
                if not dry:
                    state["stopped"] = e.name
                    return False
                # judge the later entries on top of this one, its side of each
                # conflict taken (-X theirs), as a resolution would roughly leave it
                if repo.operation_in_progress():
                    repo.run("cherry-pick", "--abort", check=False)
                if o.outcome == "conflict":
                    repo.run("cherry-pick", "-X", "theirs", item["commit"], check=False)
                    if repo.operation_in_progress():
                        repo.run("cherry-pick", "--abort", check=False)
                        state["outcomes"][-1]["detail"] += (
                            "; left out for the later entries (even -X theirs conflicts)"
                        )
            if not dry:
                save_state(stack, state)
    return True


def _series_mark_upstreamed(stack: Stack, names: list[str], release: str) -> None:
    """Mark entries upstreamed in series.toml (textual edit, the rest kept as is)."""
    path = stack.patches_dir / "series.toml"
    text = path.read_text()
    blocks = re.split(r"(?m)^(?=\[\[entry\]\]\s*$)", text)
    for i, b in enumerate(blocks):
        m = re.search(r'(?m)^name\s*=\s*"([^"]+)"', b)
        if not m or m.group(1) not in names:
            continue
        b = re.sub(r'(?m)^status\s*=\s*"carried"\s*$', 'status = "upstreamed"', b, count=1)
        if not re.search(r"(?m)^upstreamed_in\s*=", b):
            b = re.sub(
                r'(?m)^(status = "upstreamed")$', rf'\1\nupstreamed_in = "{release}"', b, count=1
            )
        b = re.sub(r'(?m)^patch\s*=\s*"[^"]*"\s*$', 'patch = ""', b, count=1)
        b = re.sub(r"(?ms)^overlay\s*=\s*\[.*?\]\s*$", "overlay = []", b, count=1)
        blocks[i] = b
    _write_atomic(path, "".join(blocks).encode())


def _finish(stack: Stack, state: dict) -> int:
    """Export, rebuild canonically, write the report, then move the pin (last)."""
    from hybrid_stack.applier import _write_state, apply
    from hybrid_stack.stack import load_pin
    from hybrid_stack.workstate import current_files, export_files, write_files

    work = Path(state["work"])
    repo = Repo(work)
    state["phase"] = "finish"
    save_state(stack, state)
    upstreamed = [o["name"] for o in state["outcomes"] if o["outcome"] == "upstream"]
    if upstreamed:
        _series_mark_upstreamed(stack, upstreamed, state["new_version"])
    pin_path = state_dir(stack) / "new-pin.toml"
    new_pin = load_pin(pin_path)
    new = Stack(
        root=stack.root, pin=new_pin, entries=load_series(stack.patches_dir / "series.toml")
    )
    repo.run("checkout", "--quiet", "-B", "stack")
    files = export_files(new, work)
    changed = write_files(new, files, current_files(new))
    print(f"rebase: export wrote {len(changed)} file(s) of patches/ and overlay/")
    _write_state(repo, {"head": repo.rev("HEAD"), "entries": []})
    with contextlib.redirect_stdout(io.StringIO()):
        apply(new, work, source=state["source"])
    pairs = range_diff(
        repo, state["old_base"], state["old_head"], state["new_base"], repo.rev("HEAD")
    )
    extra = (
        f"## Range-diff per entry (v{state['old_version']} -> v{state['new_version']})\n\n"
        + range_diff_markdown(pairs, new.entries, state["old_version"], state["new_version"])
    )
    report = report_markdown(state, new.entries, extra)
    out = Path(state["report"])
    _write_atomic(out, report.encode())
    print(f"rebase: report {out}")
    if state.get("port_source"):
        from hybrid_stack.port import Record, write_record

        src = state["port_source"]
        write_record(stack.root, Record(**{**src, "entries": tuple(map(tuple, src["entries"]))}))
        print(f"rebase: the port's source recorded in {stack.root / 'ported-from.toml'}")
    write_pin(stack, pin_path.read_text())  # the one step that moves the pin
    port_root = state.get("port_root")
    if port_root:  # `hybrid-stack port`: only now does the refresh replace the committed port
        from hybrid_stack.port import install

        install(stack.root, Path(port_root), state_dir(stack) / "port")
        print(f"rebase: {port_root} replaced by the refreshed port")
    shutil.rmtree(state_dir(stack))
    if port_root:
        shutil.rmtree(stack.root)  # the staged copy, installed
    print(
        f"rebase: the stack is on vLLM {state['new_version']} "
        f"({work} at {repo.rev('HEAD')[:12]}); the previous head stays at "
        f"{PRE_REBASE_REF}/v{state['old_version']}. Verify: hybrid-stack build && hybrid-stack test"
    )
    return 0


def _stop_message(state: dict) -> str:
    o = state["outcomes"][-1]
    work = state["work"]
    what = "; ".join(o["hunks"]) or ", ".join(o["files"])
    if o["outcome"] == "obsolete":
        todo = (
            f"port the change onto the new code in {work} and commit it with the trailer "
            f"'Stack-Entry: {o['name']}'"
        )
    else:
        todo = f"resolve the conflicts in {work} and git add the files"
    # a port's refresh is resumed with the port's --root (rebasing() finds it there)
    root = f"--root {state['port_root']} " if state.get("port_root") else ""
    return (
        f"entry '{o['name']}' is {OUTCOME_TEXT[o['outcome']]} on vLLM {state['new_version']} "
        f"({what}): {todo}, then hybrid-stack {root}rebase --continue (or rebase --abort to go "
        "back exactly)"
    )


def _read_notes(path: Path | None, root: Path) -> list[str]:
    if path is None:
        return []
    try:
        return [_shown(path, root), Path(path).read_text()]
    except OSError as e:
        raise StackError(f"cannot read the notes file {path}: {e.strerror}") from None


def _shown(path: Path, root: Path) -> str:
    p = Path(path).resolve()
    return p.relative_to(root).as_posix() if p.is_relative_to(root) else str(p)


def start(args: argparse.Namespace) -> int:
    from hybrid_stack.applier import _read_state, apply
    from hybrid_stack.workstate import current_files, export_files

    stack = load_stack(args.root)
    st = load_state(rebasing(stack.root))
    if st:
        raise StackError(
            f"a rebase onto {st['new_version']} is in progress: rebase --continue or "
            "rebase --abort first"
        )
    work = (args.work or stack.default_work).resolve()
    if args.source == "git":
        version, ref = target_from_ref(stack, args.version)
    else:
        version, ref = args.version, ""
    if version == stack.pin.version:
        raise StackError(f"the stack is already on vLLM {version}: nothing to rebase")
    new = fetch_target(stack, version, ref)
    if not (work.exists() and any(work.iterdir())):
        print(f"rebase: no work tree at {work}; applying the series on {stack.pin.tag} first")
        apply(stack, work)
    from hybrid_stack.applier import open_work

    repo = open_work(stack, work)
    if export_files(stack, work) != current_files(stack):
        raise StackError(
            f"{work} and patches/ / overlay/ disagree: run hybrid-stack apply (or export) "
            "so they hold the same series, then rebase"
        )
    old_base = repo.rev(stack.pin.tag)
    old_head = repo.rev("HEAD")
    pairs = _entry_commits(stack, repo, old_base)
    # `hybrid-stack port` rebases a staged copy of the port, installed into port_root at the
    # end; its report names the port command, and paths as seen from the main stack's root
    port_root = getattr(args, "port_root", None)
    run_by = getattr(args, "run_by", None)
    shown_root = getattr(args, "shown_root", None) or stack.root
    command = " ".join(
        ["hybrid-stack rebase", args.version]
        + (["--source", args.source] if args.source != "sdist" else [])
        + (["--dry-run"] if args.dry_run else [])
        + ([f"--report {_shown(args.report, shown_root)}"] if args.report and not run_by else [])
        + ([f"--notes {_shown(args.notes, shown_root)}"] if args.notes and not run_by else [])
    )
    report = args.report or (
        stack.root / "results" / f"rebase-{version}.md"
        if args.dry_run
        else (port_root or stack.root) / "work" / f"rebase-{version}.md"
    )
    state = {
        "version": 1,
        "command": command,
        "run_by": run_by,
        "work": str(work),
        "source": args.source,
        "old_version": stack.pin.version,
        "new_version": version,
        "old_sdist": stack.pin.sdist.filename,
        "new_sdist": new.sdist.filename,
        "new_sha256": new.sdist.sha256,
        "old_base": old_base,
        "old_head": old_head,
        "new_base": "",
        "entries": [{"name": n, "commit": c} for c, n in pairs],
        "outcomes": [],
        "stopped": "",
        "phase": "replay",
        "report": str(Path(report).resolve()),
        "notes": _read_notes(args.notes, shown_root),
        "apply_state": _read_state(repo),
        "had_tag": repo.has_ref(new.tag),
        # `hybrid-stack port`: the main series this port is made from, recorded at the end
        "port_source": asdict(args.port_source) if getattr(args, "port_source", None) else None,
        "port_root": str(port_root) if port_root else None,
    }
    if args.dry_run:
        return _dry_run(stack, repo, new, state)
    # from here on every step can be undone by --abort
    _save_files(stack)
    _move_outputs(stack.pin.project, work, state_dir(stack) / "outputs")
    report_path = Path(state["report"])
    if report_path.is_file():
        shutil.copy2(report_path, state_dir(stack) / "report.md")
    if state["port_source"] and (stack.root / "ported-from.toml").is_file():
        shutil.copy2(stack.root / "ported-from.toml", state_dir(stack) / "ported-from.toml")
    pin_file = (stack.patches_dir / "pin.toml").read_text()
    _write_atomic(state_dir(stack) / "new-pin.toml", pin_text(pin_file, stack.pin, new).encode())
    save_state(stack, state)
    repo.run("update-ref", f"{PRE_REBASE_REF}/v{stack.pin.version}", old_head)
    state["new_base"] = _fetch_base(stack, repo, new, args.source)
    save_state(stack, state)
    repo.run("checkout", "--quiet", "--detach", state["new_base"])
    _copy_outputs(stack, new, args.source, work)
    print(f"rebase: replaying {len(pairs)} entries onto {new.tag}")
    if not _replay(stack, repo, state, dry=False):
        save_state(stack, state)
        raise StackError(_stop_message(state))
    return _tests_then_finish(stack, repo, state)


def _tests_then_finish(stack: Stack, repo: Repo, state: dict) -> int:
    entries = {e.name: e for e in stack.entries}
    state["tests"] = upstream_test_changes(
        repo,
        [(entries[i["name"]], i["commit"]) for i in state["entries"]],
        state["old_base"],
        state["new_base"],
    )
    save_state(stack, state)
    return _finish(stack, state)


def _dry_run(stack: Stack, repo: Repo, new: Pin, state: dict) -> int:
    with tempfile.TemporaryDirectory(prefix="hybrid-stack-rebase-dry-") as tmp:
        clone = Path(tmp) / "vllm"
        Repo(Path(tmp)).run("clone", "--quiet", "--no-checkout", str(repo.path), str(clone))
        trial = Repo(clone)
        state["new_base"] = _fetch_base(stack, trial, new, state["source"])
        trial.run("checkout", "--quiet", "--detach", state["new_base"])
        print(f"rebase (dry run): replaying {len(state['entries'])} entries onto {new.tag}")
        _replay(stack, trial, state, dry=True)
        entries = {e.name: e for e in stack.entries}
        state["tests"] = upstream_test_changes(
            trial,
            [(entries[i["name"]], i["commit"]) for i in state["entries"]],
            state["old_base"],
            state["new_base"],
        )
        applied = [o for o in state["outcomes"] if o["outcome"] in ("clean", "3-way")]
        extra = ""
        if applied:
            pairs = range_diff(
                trial,
                state["old_base"],
                state["old_head"],
                state["new_base"],
                trial.rev("HEAD"),
            )
            extra = (
                f"## Range-diff per entry (v{state['old_version']} -> v{state['new_version']}, "
                "entries that replay)\n\n"
                + range_diff_markdown(
                    pairs, stack.entries, state["old_version"], state["new_version"]
                )
            )
    out = Path(state["report"])
    _write_atomic(out, report_markdown(state, stack.entries, extra).encode())
    print(f"rebase (dry run): report {out}; nothing else changed")
    need = [o["name"] for o in state["outcomes"] if o["outcome"] in ("conflict", "obsolete")]
    return 1 if need else 0


def cont(args: argparse.Namespace) -> int:
    stack = rebasing(args.root)
    state = load_state(stack)
    if not state:
        raise StackError("no rebase in progress (start one with hybrid-stack rebase VERSION)")
    repo = Repo(Path(state["work"]))
    if state["phase"] == "finish":
        print("rebase: finishing an interrupted rebase")
        return _finish(stack, state)
    if not state["new_base"]:
        raise StackError(
            "the rebase was interrupted before the new base was in place: rebase --abort, "
            "then start it again"
        )
    if repo.operation_in_progress():
        unmerged = [f for f in repo.run("diff", "--name-only", "--diff-filter=U").splitlines() if f]
        if unmerged:
            raise StackError(
                f"{len(unmerged)} file(s) still have conflicts ({first_few(unmerged)}): fix "
                "them, git add them, then rebase --continue"
            )
        repo.run("-c", "core.editor=true", "cherry-pick", "--continue", check=False)
        if repo.operation_in_progress():  # nothing left to commit
            repo.run("cherry-pick", "--skip", check=False)
    dirty = repo.dirty()
    if dirty:
        raise StackError(
            f"{repo.path} has uncommitted changes ({first_few(dirty)}): commit them into the "
            "entry (with its Stack-Entry trailer) or discard them, then rebase --continue"
        )
    # what HEAD holds is the truth: entries committed since the last record
    done = [n for _, n in _entry_commits(stack, repo, state["new_base"])]
    recorded = {o["name"]: o for o in state["outcomes"]}
    outcomes = []
    for item in state["entries"]:
        name = item["name"]
        o = recorded.get(name)
        if name in done:
            if o is None:
                o = asdict(Outcome(name, "clean", detail="replayed before an interruption"))
            elif o["outcome"] in ("conflict", "obsolete"):
                o = {**o, "outcome": "resolved", "detail": f"{o['outcome']}: {o['detail']}"}
            outcomes.append(o)
        elif o and o["outcome"] == "upstream":
            outcomes.append(o)
        elif o and o["outcome"] in ("conflict", "obsolete") and name == state["stopped"]:
            raise StackError(
                f"HEAD does not hold entry '{name}' yet: commit it (trailer "
                f"'Stack-Entry: {name}') or resolve and git add, then rebase --continue"
            )
    state["outcomes"] = outcomes
    state["stopped"] = ""
    save_state(stack, state)
    if not _replay(stack, repo, state, dry=False):
        save_state(stack, state)
        raise StackError(_stop_message(state))
    return _tests_then_finish(stack, repo, state)


def abort(args: argparse.Namespace) -> int:
    from hybrid_stack.applier import _write_state
    from hybrid_stack.stack import load_pin

    stack = rebasing(args.root)
    state = load_state(stack)
    if not state:
        raise StackError("no rebase in progress: nothing to abort")
    repo = Repo(Path(state["work"]))
    if repo.operation_in_progress():
        repo.run("cherry-pick", "--abort", check=False)
        repo.run("am", "--abort", check=False)
    repo.run("reset", "--quiet", "--hard")
    repo.run("checkout", "--quiet", "-f", "-B", "stack", state["old_head"])
    repo.run("clean", "--quiet", "-fd")
    new_tag = f"v{state['new_version']}"
    if not state["had_tag"] and repo.has_ref(new_tag):
        repo.run("tag", "--delete", new_tag)
    _restore_files(stack)
    project = load_pin(stack.patches_dir / "pin.toml").project
    _move_outputs(project, state_dir(stack) / "outputs", Path(state["work"]))
    report, kept = Path(state["report"]), state_dir(stack) / "report.md"
    if kept.is_file():
        shutil.copy2(kept, report)
    else:
        report.unlink(missing_ok=True)
    if state.get("port_source"):  # the previous record back (or none)
        rec, kept_rec = stack.root / "ported-from.toml", state_dir(stack) / "ported-from.toml"
        if kept_rec.is_file():
            shutil.copy2(kept_rec, rec)
        else:
            rec.unlink(missing_ok=True)
    repo.run("update-ref", "-d", f"{PRE_REBASE_REF}/v{state['old_version']}", check=False)
    if state["apply_state"]:
        _write_state(repo, state["apply_state"])
    else:
        (repo.git_dir() / "hybrid-stack-state.json").unlink(missing_ok=True)
    port_root = state.get("port_root")
    if port_root:  # a refresh killed while its finish installed it: the port back as it was
        from hybrid_stack.port import PREVIOUS_PORT_REF, restore

        restore(Path(port_root), state_dir(stack) / "port")
    shutil.rmtree(state_dir(stack))
    if port_root:
        shutil.rmtree(stack.root)  # the staged copy, given up
        print(
            f"rebase: aborted; {port_root} is as it was; {state['work']} holds the series "
            f"copy on vLLM {state['old_version']} (the port's previous commits are at "
            f"{PREVIOUS_PORT_REF}): hybrid-stack --root {port_root} apply rebuilds the port there"
        )
        return 0
    print(
        f"rebase: aborted; pin, patches/, overlay/ and {state['work']} are back on vLLM "
        f"{state['old_version']} at {state['old_head'][:12]}"
    )
    return 0


def run(args: argparse.Namespace) -> int:
    if args.abort:
        return abort(args)
    if args.cont:
        return cont(args)
    if not args.version:
        raise StackError("name the target release (hybrid-stack rebase 0.32.0), or --continue")
    return start(args)


def add_parser(sub) -> None:
    p = sub.add_parser("rebase", help="replay the series onto another vLLM release")
    p.add_argument("version", nargs="?", help="target release (a git ref with --source git)")
    p.add_argument("--work", type=Path, default=None, help="work tree (default work/vllm)")
    p.add_argument("--source", choices=("sdist", "git"), default="sdist")
    p.add_argument("--report", type=Path, default=None, help="markdown report path")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="replay in a throwaway clone past conflicts and only write the report "
        "(default results/rebase-<version>.md)",
    )
    p.add_argument(
        "--notes",
        type=Path,
        default=None,
        help="markdown file for the report's Notes section (why entries need work, as "
        "found by hand)",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--continue", dest="cont", action="store_true", help="resume after resolving")
    g.add_argument("--abort", action="store_true", help="restore the state before the rebase")
    p.set_defaults(func=run)
