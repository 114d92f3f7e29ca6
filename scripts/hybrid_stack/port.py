# SPDX-License-Identifier: Apache-2.0
"""`hybrid-stack port VERSION`: make (or refresh) the port patches/ports/<VERSION>/.

A port is the series moved onto another vLLM release, kept beside the main
series as a stack root of its own (its patches/, overlay/ and a `ci` link). It
is made from the main series as committed: this verb copies patches/ (without
ports/) and overlay/ into the port folder, applies that copy on the main pin
in the port's work tree, and rebases it onto VERSION (`hybrid-stack --root
<port> rebase VERSION`). Conflicts are resolved as in any rebase, then
`hybrid-stack --root <port> rebase --continue`.

The copy is a stack root of its own in the port's (ignored) work dir,
<port>/work/refresh, and the rebase runs on it (its state in
<port>/work/refresh/work/rebase): the committed port stays as it is while the
refresh is stopped, and after an --abort or a failure. Only the rebase's last
step installs the refreshed patches/, overlay/ and record into the port.

When the rebase finishes, the port records where it came from in
`<port>/ported-from.toml`: the repository commit, the main pin's version, a
sha256 digest of the source files (patches/ without ports/, and overlay/) and
a digest per entry. A port lags the main series by nature; `hybrid-stack
status` says by which entries (new, changed, removed), and the round-trip test
compares a port with the state it records, not with today's series.

`--record COMMIT` writes the record for a port made before this verb existed:
the series at COMMIT must be the one the port keeps (same series.toml and
entry descriptions).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
from dataclasses import astuple, dataclass
from pathlib import Path

from hybrid_stack import tomlfile
from hybrid_stack.errors import StackError, first_few
from hybrid_stack.gitops import Repo
from hybrid_stack.stack import Stack, load_pin, load_stack

RECORD = "ported-from.toml"
PREVIOUS_PORT_REF = "refs/hybrid-stack/previous-port"
# what a refresh replaces in the port (its `ci` link and work/ stay)
PORT_FILES = ("patches", "overlay", RECORD)
Files = dict[str, bytes]


# -- the source state -----------------------------------------------------------
def _source_path(rel: str) -> bool:
    return (rel.startswith("patches/") and not rel.startswith("patches/ports/")) or (
        rel.startswith("overlay/")
    )


def disk_files(root: Path) -> Files:
    """The series' files on disk: patches/ (without ports/) and overlay/."""
    out: Files = {}
    for sub in ("patches", "overlay"):
        d = root / sub
        if not d.is_dir():
            continue
        for dirpath, dirnames, names in os.walk(d):
            dirnames[:] = [n for n in dirnames if not (sub == "patches" and n == "ports")]
            for n in names:
                f = Path(dirpath) / n
                rel = f.relative_to(root).as_posix()
                if _source_path(rel) and f.is_file():
                    out[rel] = f.read_bytes()
    return dict(sorted(out.items()))


def git_files(root: Path, commit: str) -> Files:
    """The same files as committed at `commit` of the repository holding root."""
    repo = Repo(root)
    if not repo.ok("cat-file", "-e", f"{commit}^{{commit}}"):
        raise StackError(
            f"commit {commit[:12]} is not in {root}'s history (a shallow clone? "
            "git fetch --unshallow)"
        )
    # paths relative to root (ls-tree's default), as on disk
    out = repo.run("ls-tree", "-r", "-z", "--name-only", commit, "--", "patches", "overlay")
    files: Files = {}
    for rel in (p for p in out.split("\0") if p):
        if _source_path(rel):
            blob = repo.blob(commit, rel)
            if blob:
                files[rel] = blob[1]
    return dict(sorted(files.items()))


def digest(files: Files) -> str:
    """sha256 over every file's path and content sha256, sorted by path."""
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(f"{rel}\0{hashlib.sha256(files[rel]).hexdigest()}\n".encode())
    return h.hexdigest()


def materialize(files: Files, dest: Path) -> Path:
    for rel, data in files.items():
        p = dest / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return dest


def entry_digests(files: Files) -> list[tuple[str, str]]:
    """(name, digest) per entry in series order: its series fields and description,
    its patch, its notes and its overlay files."""
    with tempfile.TemporaryDirectory(prefix="hybrid-stack-port-") as tmp:
        stack = load_stack(materialize(files, Path(tmp)), check_files=False)
        out = []
        for e in stack.entries:
            h = hashlib.sha256(repr(astuple(e)).encode())
            paths = [f"patches/{e.patch}"] if e.patch else []
            paths += [f"patches/{e.name}.notes.md"] + [f"overlay/{p}" for p in e.overlay]
            for rel in paths:
                h.update(f"\0{rel}\0".encode() + files.get(rel, b"\0absent"))
            out.append((e.name, h.hexdigest()))
        return out


def pin_version(files: Files) -> str:
    with tempfile.TemporaryDirectory(prefix="hybrid-stack-port-") as tmp:
        return load_pin(
            materialize({"patches/pin.toml": files["patches/pin.toml"]}, Path(tmp))
            / "patches"
            / "pin.toml"
        ).version


# -- the record -----------------------------------------------------------------
@dataclass(frozen=True)
class Record:
    commit: str
    version: str  # the main pin's release the port was made from
    digest: str
    files: int
    entries: tuple[tuple[str, str], ...]


def make_record(commit: str, files: Files) -> Record:
    return Record(
        commit=commit,
        version=pin_version(files),
        digest=digest(files),
        files=len(files),
        entries=tuple(entry_digests(files)),
    )


def record_text(r: Record) -> str:
    lines = [
        "# Written by `hybrid-stack port`: the main series this port was made from.",
        "# commit: the repository commit; digest: sha256 over patches/ (without ports/) and",
        "# overlay/ at that commit (hybrid_stack.port.digest); one digest per entry.",
        "[source]",
        f'commit = "{r.commit}"',
        f'version = "{r.version}"',
        f'digest = "{r.digest}"',
        f"files = {r.files}",
    ]
    for name, d in r.entries:
        lines += ["", "[[source.entry]]", f'name = "{name}"', f'digest = "{d}"']
    return "\n".join(lines) + "\n"


def load_record(port_root: Path) -> Record | None:
    path = port_root / RECORD
    if not path.is_file():
        return None
    src = tomlfile.load(path).get("source")
    try:
        return Record(
            commit=str(src["commit"]),
            version=str(src["version"]),
            digest=str(src["digest"]),
            files=int(src["files"]),
            entries=tuple((str(e["name"]), str(e["digest"])) for e in src.get("entry", [])),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise StackError(
            f"{path}: malformed record ({e}): make it again with hybrid-stack port"
        ) from None


def write_record(port_root: Path, r: Record) -> None:
    from hybrid_stack.rebase import _write_atomic

    _write_atomic(port_root / RECORD, record_text(r).encode())


# -- staleness --------------------------------------------------------------------
@dataclass(frozen=True)
class Lag:
    current: bool  # the main series is byte for byte the recorded source
    added: tuple[str, ...]
    changed: tuple[str, ...]
    removed: tuple[str, ...]
    reordered: bool
    pin_moved: str  # the main pin's version if it moved since, else ""
    other: bool  # files outside any entry changed (pin comments, ...)

    @property
    def behind(self) -> int:
        return len(self.added) + len(self.changed) + len(self.removed)

    def text(self) -> str:
        if self.current:
            return "current (the main series is the one it was made from)"
        parts = []
        if self.added:
            parts.append("new " + ", ".join(self.added))
        if self.changed:
            parts.append("changed " + ", ".join(self.changed))
        if self.removed:
            parts.append("removed " + ", ".join(self.removed))
        if self.reordered:
            parts.append("entries reordered")
        if self.pin_moved:
            parts.append(f"main pin moved to {self.pin_moved}")
        if self.other and not parts:
            parts.append("other files of patches/ changed")
        n = self.behind
        return f"{n} entr{'y' if n == 1 else 'ies'} behind the series: " + "; ".join(parts)


def lag(record: Record, files: Files) -> Lag:
    """How the main series (files) has moved on since the recorded source."""
    if digest(files) == record.digest:
        return Lag(True, (), (), (), False, "", False)
    now = entry_digests(files)
    was = dict(record.entries)
    cur = dict(now)
    added = tuple(n for n, _ in now if n not in was)
    removed = tuple(n for n, _ in record.entries if n not in cur)
    changed = tuple(n for n, d in now if n in was and was[n] != d)
    common_now = [n for n, _ in now if n in was]
    common_was = [n for n, _ in record.entries if n in cur]
    version = pin_version(files)
    return Lag(
        current=False,
        added=added,
        changed=changed,
        removed=removed,
        reordered=common_now != common_was,
        pin_moved=version if version != record.version else "",
        other=True,
    )


def ports(main_root: Path) -> list[Path]:
    d = main_root / "patches" / "ports"
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if (p / "patches" / "pin.toml").is_file())


def main_of(port_root: Path) -> Path | None:
    """The main stack root a port lives in (<main>/patches/ports/<version>)."""
    if port_root.parent.name == "ports" and port_root.parent.parent.name == "patches":
        main = port_root.parents[2]
        if (main / "patches" / "series.toml").is_file():
            return main
    return None


def lag_lines(main_root: Path) -> list[str]:
    """One line per port of main_root: what it was made from and how far behind."""
    files = None
    out = []
    for p in ports(main_root):
        shown = p.relative_to(main_root).as_posix()
        version = load_stack(p, check_files=False).pin.version
        r = load_record(p)
        if r is None:
            out.append(
                f"{shown} (vLLM {version}): no {RECORD}, so its source is unknown; make it "
                f"again with hybrid-stack port {version}"
            )
            continue
        files = files if files is not None else disk_files(main_root)
        lg = lag(r, files)
        line = f"{shown} (vLLM {version}): ported from {r.commit[:12]}, {lg.text()}"
        if not lg.current:
            line += f"; refresh: hybrid-stack port {version}"
        out.append(line)
    return out


# -- the refresh -------------------------------------------------------------------
def refresh_root(port_root: Path) -> Path:
    """Where `hybrid-stack port` stages a refresh of port_root (a stack root of its own)."""
    return port_root / "work" / "refresh"


def _put(src: Path, port_root: Path) -> None:
    """Replace port_root's PORT_FILES by src's (none where src has none)."""
    for name in PORT_FILES:
        dest, new = port_root / name, src / name
        if dest.is_dir():
            shutil.rmtree(dest)
        elif dest.exists():
            dest.unlink()
        if new.is_dir():
            shutil.copytree(new, dest)
        elif new.is_file():
            shutil.copy2(new, dest)


def install(staged: Path, port_root: Path, kept: Path) -> None:
    """The rebase's last step for a refresh: the staged port replaces port_root's.
    The port as it was is kept first (once, renamed into place whole), so a finish
    killed halfway is redone by --continue or undone by --abort (restore)."""
    if not kept.is_dir():
        tmp = kept.with_name(kept.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        _put(port_root, tmp)
        os.replace(tmp, kept)
    _put(staged, port_root)
    main = main_of(port_root)
    ci = port_root / "ci"
    if main is not None and not ci.exists() and not ci.is_symlink():
        ci.symlink_to(os.path.relpath(main / "ci", port_root))


def restore(port_root: Path, kept: Path) -> None:
    """--abort of a refresh: the port back as it was, where install had begun."""
    if kept.is_dir():
        _put(kept, port_root)


# -- the verb ---------------------------------------------------------------------
def _committed_source(main: Stack) -> tuple[str, Files]:
    repo = Repo(main.root)
    if not repo.ok("rev-parse", "--git-dir"):
        raise StackError(f"{main.root} is not a git repository: a port records its commit")
    head = repo.rev("HEAD")
    files = disk_files(main.root)
    committed = git_files(main.root, head)
    if files != committed:
        diff = [p for p in sorted(set(files) | set(committed)) if files.get(p) != committed.get(p)]
        raise StackError(
            f"patches/ and overlay/ differ from HEAD ({first_few(diff)}): commit the series "
            "first, a port records the commit it was made from"
        )
    return head, files


def _check_same_series(port_root: Path, files: Files, commit: str) -> None:
    keep = [
        rel
        for rel in files
        if rel == "patches/series.toml"
        or (rel.endswith(".md") and rel.count("/") == 1 and not rel.endswith(".notes.md"))
    ]
    differ = [
        rel
        for rel in keep
        if not (port_root / rel).is_file() or (port_root / rel).read_bytes() != files[rel]
    ]
    if differ:
        raise StackError(
            f"the port's series is not the one at {commit[:12]} ({first_few(differ)}): "
            "record the commit the port was made from"
        )


def record_existing(main: Stack, port_root: Path, commit: str) -> int:
    repo = Repo(main.root)
    commit = repo.rev(commit)
    files = git_files(main.root, commit)
    _check_same_series(port_root, files, commit)
    r = make_record(commit, files)
    write_record(port_root, r)
    print(
        f"port: {port_root / RECORD}: made from {commit[:12]} (vLLM {r.version}, "
        f"{len(r.entries)} entries, digest {r.digest[:16]}...)"
    )
    return 0


def make_port(
    main: Stack, port_root: Path, version: str, report: Path | None, notes: Path | None
) -> int:
    from hybrid_stack import rebase
    from hybrid_stack.applier import apply

    commit, files = _committed_source(main)
    record = make_record(commit, files)
    staged = refresh_root(port_root)
    if any((r / "work" / "rebase" / "state.json").is_file() for r in (port_root, staged)):
        raise StackError(
            f"a rebase is in progress in {port_root}: hybrid-stack --root {port_root} rebase "
            "--continue (or --abort) first"
        )
    work = port_root / "work" / "vllm"
    if work.is_dir() and Repo(work).is_repo():
        wrepo = Repo(work)
        dirty = wrepo.dirty()
        if dirty:
            raise StackError(
                f"{work} has uncommitted changes ({first_few(dirty)}): commit or discard them first"
            )
        pin = port_root / "patches" / "pin.toml"
        tag = load_pin(pin).tag if pin.is_file() else ""
        # only a tree on the port's base holds the port's commits: after a refresh given
        # up it holds the series copy on the main pin, and the ref keeps the port's
        if tag and wrepo.ok("merge-base", "--is-ancestor", tag, "HEAD"):
            wrepo.run("update-ref", PREVIOUS_PORT_REF, "HEAD")
        if not wrepo.has_ref(main.pin.tag):  # made by the port's own apply: on its base only
            rebase._fetch_base(main, wrepo, main.pin, "sdist")
        if wrepo.has_ref(PREVIOUS_PORT_REF):
            print(
                f"port: the previous port's entry commits stay at {PREVIOUS_PORT_REF} in "
                f"{work} (resolutions to start from)"
            )
    # the copy is staged beside the port, which the rebase's finish replaces last:
    # stopped, aborted or failed, the committed port stays as it is
    if staged.exists():  # an earlier refresh given up
        shutil.rmtree(staged)
    materialize(files, staged)
    # the copy's series names files under ci/ (kernel_cases): the main root's, as a port's
    if (main.root / "ci").is_dir():
        (staged / "ci").symlink_to(os.path.relpath(main.root / "ci", staged))
    copy = load_stack(staged)
    print(
        f"port: {len(files)} files of the series at {commit[:12]} copied into {staged}; "
        f"applying on {copy.pin.tag}"
    )
    apply(copy, work)
    args = argparse.Namespace(
        root=staged,
        version=version,
        work=work,
        source="sdist",
        report=report,
        dry_run=False,
        notes=notes,
        port_source=record,
        port_root=port_root,
        run_by=f"hybrid-stack port {version}",
        shown_root=main.root,
    )
    return rebase.start(args)


def run(args: argparse.Namespace) -> int:
    main = load_stack(args.root)
    if main_of(main.root) is not None:
        raise StackError(f"{main.root} is itself a port: run port from the main stack root")
    port_root = main.root / "patches" / "ports" / args.version
    if args.record:
        if not (port_root / "patches" / "pin.toml").is_file():
            raise StackError(
                f"no port at {port_root}: make it with hybrid-stack port {args.version}"
            )
        return record_existing(main, port_root, args.record)
    if args.version == main.pin.version:
        raise StackError(
            f"the main series is on vLLM {args.version}: a port is for another release"
        )
    notes = args.notes
    if notes is None:  # the committed notes of earlier ports of this release carry over
        default = main.root / "results" / "rebase-notes" / f"{args.version}.md"
        notes = default if default.is_file() else None
    return make_port(main, port_root, args.version, args.report, notes)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "port", help="make or refresh patches/ports/<version>/ from the committed series"
    )
    p.add_argument("version", help="the release to port onto")
    p.add_argument("--report", type=Path, default=None, help="the rebase's markdown report")
    p.add_argument(
        "--notes",
        type=Path,
        default=None,
        help="markdown file for the report's Notes section (default "
        "results/rebase-notes/<version>.md, where it exists)",
    )
    p.add_argument(
        "--record",
        metavar="COMMIT",
        default=None,
        help="only write <port>/ported-from.toml for an existing port made from the series "
        "at COMMIT",
    )
    p.set_defaults(func=run)
