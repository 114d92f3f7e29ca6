# SPDX-License-Identifier: Apache-2.0
"""What apply, export and check share about a work tree and the stack's files.

- the work tree's record, ``.git/hybrid-stack-state.json``: the head apply
  left, each applied entry's fingerprint and commit, and ``synced``, the
  digests of patches/ and overlay/ as apply or export last left them equal
  to the tree;
- the in-flight marker, ``.git/hybrid-stack-applying``: written before apply
  moves anything and removed when it is done, so a run killed half-way is
  recognised, and undone, by the next one;
- patches/ and overlay/ as they are on disk, their digests, and the
  entry of each work-tree commit (its ``Stack-Entry:`` trailer).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from hybrid_stack.errors import StackError
from hybrid_stack.gitops import Repo
from hybrid_stack.proc import write_atomic
from hybrid_stack.stack import TRAILER_ENTRY, Entry, Stack

STATE = "hybrid-stack-state.json"
MARKER = "hybrid-stack-applying"
LOCK = "hybrid-stack.lock"
TRAILER_RE = re.compile(rf"^{TRAILER_ENTRY}:\s*(\S+)\s*$", re.MULTILINE)

Files = dict[str, bytes | tuple[str, bytes]]


# -- the work tree's record ------------------------------------------------------
def read_state(repo: Repo) -> dict:
    try:
        return json.loads((repo.git_dir() / STATE).read_text())
    except (OSError, ValueError):
        return {}


def write_state(repo: Repo, state: dict) -> None:
    write_atomic(repo.git_dir() / STATE, json.dumps(state, indent=1) + "\n")


def read_marker(repo: Repo) -> dict | None:
    """The in-flight marker of an apply that did not finish, or None."""
    path = repo.git_dir() / MARKER
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    return data if isinstance(data, dict) else {}


def write_marker(repo: Repo, data: dict) -> None:
    write_atomic(repo.git_dir() / MARKER, json.dumps(data) + "\n")


def clear_marker(repo: Repo) -> None:
    (repo.git_dir() / MARKER).unlink(missing_ok=True)


# -- patches/ and overlay/ -------------------------------------------------------
def current_files(stack: Stack) -> Files:
    """What patches/*.patch of carried entries and overlay/ hold now on disk."""
    files: Files = {}
    for e in stack.carried:
        if e.patch and (stack.patches_dir / e.patch).is_file():
            files[f"patches/{e.patch}"] = (stack.patches_dir / e.patch).read_bytes()
    if stack.overlay_dir.is_dir():
        for dirpath, _, names in os.walk(stack.overlay_dir):
            for n in names:
                f = Path(dirpath) / n
                rel = f.relative_to(stack.root).as_posix()
                mode = "100755" if os.access(f, os.X_OK) else "100644"
                files[rel] = (mode, f.read_bytes())
    return files


def orphan_patches(stack: Stack) -> list[str]:
    """patches/*.patch named by no entry of the series."""
    named = {e.patch for e in stack.entries if e.patch}
    return sorted(
        f"patches/{p.name}" for p in stack.patches_dir.glob("*.patch") if p.name not in named
    )


def files_digest(files: Files) -> dict[str, str]:
    """sha256 of each file's content, by path. Recorded in the work tree's
    state as "synced" when apply or export leaves patches/ and overlay/
    equal to the work tree, so export can tell later hand edits."""
    return {
        rel: hashlib.sha256(c[1] if isinstance(c, tuple) else c).hexdigest()
        for rel, c in files.items()
    }


def edited_since_sync(synced: dict[str, str] | None, now: Files) -> list[str]:
    """Files of patches/ and overlay/ (holding `now`, current_files) changed on
    disk since apply or export last left them as recorded in ``synced``
    (export would overwrite them)."""
    if synced is None:  # a work tree from before the record, or not by apply
        return []
    digest = files_digest(now)
    return sorted(rel for rel in set(digest) | set(synced) if digest.get(rel) != synced.get(rel))


# -- the work tree's commits -----------------------------------------------------
def commit_entries(stack: Stack, repo: Repo, base: str) -> list[tuple[str, str]]:
    """[(commit, entry name)] from base to HEAD, each validated against the series."""
    known = {e.name: e for e in stack.entries}
    out = []
    for c in repo.commits(base):
        msg = repo.message(c)
        names = TRAILER_RE.findall(msg)
        subject = msg.splitlines()[0] if msg else ""
        if len(names) != 1:
            raise StackError(
                f"commit {c[:12]} ('{subject}') has {len(names)} '{TRAILER_ENTRY}:' "
                f"trailers: give it exactly one (git commit --amend --trailer "
                f"'{TRAILER_ENTRY}: <name>') and an entry in series.toml"
            )
        name = names[0]
        if name not in known:
            raise StackError(
                f"commit {c[:12]} ('{subject}') names entry '{name}', which is not in "
                "series.toml: add the entry there first"
            )
        if not known[name].carried:
            raise StackError(
                f"commit {c[:12]} is entry '{name}', whose status is "
                f"'{known[name].status}': set status = \"carried\" or drop the commit"
            )
        out.append((c, name))
    return out


# -- what a work tree exports ---------------------------------------------------
def entry_files(
    stack: Stack, repo: Repo, commit: str, entry: Entry
) -> tuple[bytes | None, dict[str, tuple[str, bytes]]]:
    """(patch bytes or None, {overlay path: (mode, bytes)}) for one entry commit."""
    parent = repo.rev(f"{commit}~1")
    overlay: dict[str, tuple[str, bytes]] = {}
    for p in entry.overlay:
        got = repo.blob(commit, p)
        if got is None:
            raise StackError(
                f"entry '{entry.name}' owns overlay file {p}, but its commit "
                f"{commit[:12]} has no such file: add it or drop it from the entry"
            )
        overlay[p] = got
    tree = repo.tree_without(commit, parent, list(entry.overlay))
    if tree == repo.run("rev-parse", f"{parent}^{{tree}}"):
        if entry.patch:
            raise StackError(
                f"entry '{entry.name}' changes only its overlay files, but names "
                f'patch {entry.patch}: set patch = "" in series.toml'
            )
        return None, overlay
    if not entry.patch:
        changed = repo.run("diff", "--name-only", f"{parent}^{{tree}}", tree).split()
        raise StackError(
            f"entry '{entry.name}' edits upstream files ({', '.join(changed[:4])}) "
            f'but names no patch: set patch = "{entry.name}.patch" in series.toml'
        )
    normalized = repo.commit_tree(tree, parent, entry.commit_message())
    return repo.format_patch(normalized), overlay


def export_files(stack: Stack, work: Path) -> Files:
    """Everything export would write, as {stack-relative path: content}."""
    repo = Repo(work)
    if not repo.is_repo() or not repo.has_ref(stack.pin.tag):
        raise StackError(f"{work} is not a work tree on {stack.pin.tag}: run apply first")
    dirty = repo.dirty()
    if dirty:
        raise StackError(
            f"{work} has uncommitted changes ({', '.join(dirty[:3])}): commit them into "
            "their entry's commit first (git commit --amend, or git rebase -i)"
        )
    base = repo.rev(stack.pin.tag)
    pairs = commit_entries(stack, repo, base)
    got = [name for _, name in pairs]
    want = [e.name for e in stack.carried]
    if got != want:
        missing = [n for n in want if n not in got]
        extra = [n for n in got if n not in want]
        detail = f"missing {missing}" if missing else f"unexpected {extra}" if extra else "order"
        raise StackError(
            f"the commits in {work} ({got}) do not match the carried entries in "
            f"series.toml ({want}): {detail}; run apply, or fix the series"
        )
    files: Files = {}
    for commit, name in pairs:
        entry = stack.entry(name)
        patch, overlay = entry_files(stack, repo, commit, entry)
        if patch is not None:
            files[f"patches/{entry.patch}"] = patch
        for p, blob in overlay.items():
            files[f"overlay/{p}"] = blob
    return files


def write_files(
    stack: Stack,
    files: Files,
    now: Files,
) -> list[str]:
    """Make patches/ and overlay/ (holding `now`, current_files) equal to
    `files`; return the paths changed."""
    changed = []
    for rel, content in files.items():
        if now.get(rel) == content:
            continue
        path = stack.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, tuple):
            mode, data = content
            path.write_bytes(data)
            os.chmod(path, 0o755 if mode == "100755" else 0o644)
        else:
            path.write_bytes(content)
        changed.append(rel)
    stale = [rel for rel in now if rel not in files] + orphan_patches(stack)
    for rel in sorted(set(stale)):
        (stack.root / rel).unlink()
        changed.append(f"{rel} (removed)")
        d = (stack.root / rel).parent
        while d != stack.overlay_dir and d.is_dir() and not any(d.iterdir()):
            d.rmdir()
            d = d.parent
    return changed
