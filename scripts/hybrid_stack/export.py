# SPDX-License-Identifier: Apache-2.0
"""`hybrid-stack export`: work tree commits -> patches/ and overlay/ (apply's inverse).

Each commit between the base tag and HEAD must carry a `Stack-Entry: <name>`
trailer naming a carried entry, in series order. For each entry:
- its overlay files are taken whole from the commit into overlay/<path>;
- its patch is `git format-patch` (fixed options, see gitops) of a commit with
  the same parent, the commit's tree minus the overlay files, and the entry's
  canonical message from series.toml (series.toml is the one source of
  messages: edit it, not the commit message).
Files in overlay/ owned by no carried entry, and patches/*.patch named by no
entry, are removed: after export, patches/ and overlay/ hold exactly the tree.
An unowned overlay file whose content the work tree does not hold (one that
never went through apply) stops export instead: removing it would lose it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
from pathlib import Path

from hybrid_stack.errors import StackError, first_few
from hybrid_stack.gitops import Repo
from hybrid_stack.stack import TRAILER_ENTRY, Entry, Stack, load_stack

TRAILER_RE = re.compile(rf"^{TRAILER_ENTRY}:\s*(\S+)\s*$", re.MULTILINE)


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


def export_files(stack: Stack, work: Path) -> dict[str, bytes | tuple[str, bytes]]:
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
    files: dict[str, bytes | tuple[str, bytes]] = {}
    for commit, name in pairs:
        entry = stack.entry(name)
        patch, overlay = entry_files(stack, repo, commit, entry)
        if patch is not None:
            files[f"patches/{entry.patch}"] = patch
        for p, blob in overlay.items():
            files[f"overlay/{p}"] = blob
    return files


def current_files(stack: Stack) -> dict[str, bytes | tuple[str, bytes]]:
    """What patches/*.patch of carried entries and overlay/ hold now on disk."""
    files: dict[str, bytes | tuple[str, bytes]] = {}
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
    named = {e.patch for e in stack.entries if e.patch}
    return sorted(
        f"patches/{p.name}" for p in stack.patches_dir.glob("*.patch") if p.name not in named
    )


def write_files(
    stack: Stack,
    files: dict[str, bytes | tuple[str, bytes]],
    now: dict[str, bytes | tuple[str, bytes]],
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


def unkept_overlay(
    repo: Repo,
    files: dict[str, bytes | tuple[str, bytes]],
    now: dict[str, bytes | tuple[str, bytes]],
) -> list[str]:
    """Files of overlay/ (in `now`, current_files) that export would delete
    (no carried entry owns them) and whose content the work tree's HEAD does
    not hold either."""
    unkept = []
    for rel, content in now.items():
        if not rel.startswith("overlay/") or rel in files:
            continue
        got = repo.blob("HEAD", rel.removeprefix("overlay/"))
        data = content[1] if isinstance(content, tuple) else content
        if got is None or got[1] != data:
            unkept.append(rel)
    return sorted(unkept)


def files_digest(files: dict[str, bytes | tuple[str, bytes]]) -> dict[str, str]:
    """sha256 of each file's content, by path. Recorded in the work tree's
    state as "synced" when apply or export leaves patches/ and overlay/
    equal to the work tree, so export can tell later hand edits."""
    return {
        rel: hashlib.sha256(c[1] if isinstance(c, tuple) else c).hexdigest()
        for rel, c in files.items()
    }


def edited_since_sync(
    synced: dict[str, str] | None, now: dict[str, bytes | tuple[str, bytes]]
) -> list[str]:
    """Files of patches/ and overlay/ (holding `now`, current_files) changed on
    disk since apply or export last left them as recorded in ``synced``
    (export would overwrite them)."""
    if synced is None:  # a work tree from before the record, or not by apply
        return []
    digest = files_digest(now)
    return sorted(rel for rel in set(digest) | set(synced) if digest.get(rel) != synced.get(rel))


def run(args: argparse.Namespace) -> int:
    from hybrid_stack.apply import _read_state, _write_state

    stack = load_stack(args.root, check_files=False)
    work = (args.work or stack.default_work).resolve()
    files = export_files(stack, work)
    repo = Repo(work)
    state = _read_state(repo)
    now = current_files(stack)  # read once: the checks below and write_files
    edited = [] if args.force else edited_since_sync(state.get("synced"), now)
    if edited:
        raise StackError(
            f"{len(edited)} file(s) of patches/ or overlay/ changed since the last apply "
            f"or export ({first_few(edited)}); export would overwrite them with {work}'s version. "
            "Run apply to take them into the work tree first, or export --force to "
            "drop them"
        )
    unkept = [] if args.force else unkept_overlay(repo, files, now)
    if unkept:
        raise StackError(
            f"export would delete {first_few(unkept)}: no carried entry owns it and {work}'s HEAD "
            "does not hold it; add it to an entry's overlay list in patches/series.toml "
            "and run apply, or remove it (export --force deletes it)"
        )
    changed = write_files(stack, files, now)
    if state:
        # write_files left patches/ and overlay/ equal to files
        state["synced"] = files_digest(files)
        _write_state(repo, state)
    for rel in changed:
        print(f"export: wrote {rel}")
    print(f"export: {len(changed)} file(s) changed" if changed else "export: up to date")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="regenerate patches/ and overlay/ from the work tree")
    p.add_argument("--work", type=Path, default=None, help="work tree (default work/vllm)")
    p.add_argument(
        "--force",
        action="store_true",
        help="overwrite patches/ and overlay/ files edited since the last apply / export "
        "and delete overlay files no entry owns",
    )
    p.set_defaults(func=run)
