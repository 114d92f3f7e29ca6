# SPDX-License-Identifier: Apache-2.0
"""The stack's data model: the pin (upstream base) and the series (ordered entries).

Files (relative to the stack root):
  patches/pin.toml     the upstream base: version, sdist/wheel file names + sha256,
                       optional git and local-directory sources
  patches/series.toml  the ordered entries ([[entry]] tables)
  patches/<name>.patch git format-patch output, one per carried entry that edits
                       upstream files
  overlay/<tree path>  whole files owned by an entry, laid out at their vLLM path
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from hybrid_stack import tomlfile
from hybrid_stack.errors import StackError

STATUSES = ("carried", "upstreamed", "dropped")
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9.-]*$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
ENTRY_KEYS = {
    "name",
    "subject",
    "status",
    "upstream_pr",
    "upstreamed_in",
    "purpose",
    "description",
    "patch",
    "overlay",
    "cpu_tests",
    "gpu_tests",
    "kernel_cases",
    "benches",
}
TRAILER_ENTRY = "Stack-Entry"


@dataclass(frozen=True)
class Artifact:
    filename: str
    sha256: str


@dataclass(frozen=True)
class Pin:
    project: str
    version: str
    sdist: Artifact
    wheel: Artifact | None = None
    git_url: str = ""
    git_ref: str = ""
    local_path: str = ""

    @property
    def tag(self) -> str:
        return f"v{self.version}"

    @property
    def sdist_root(self) -> str:
        """Top-level folder inside the sdist tarball."""
        return f"{self.project}-{self.version}"


@dataclass(frozen=True)
class Entry:
    name: str
    subject: str
    status: str
    purpose: str
    description: str = ""
    upstream_pr: str = ""
    upstreamed_in: str = ""
    patch: str = ""
    overlay: tuple[str, ...] = ()
    cpu_tests: tuple[str, ...] = ()
    gpu_tests: tuple[str, ...] = ()
    # a Python file of the stack (stack-relative) with the entry's cases for
    # `hybrid-stack kernel-stats` (see kstats_probe)
    kernel_cases: str = ""
    # the GPU bundle's benchmarks that measure the entry (scripts/hybrid_stack/bench/<name>.py)
    benches: tuple[str, ...] = ()

    @property
    def carried(self) -> bool:
        return self.status == "carried"

    def commit_message(self) -> str:
        """The canonical commit message: subject, body, then trailers.

        It is the single source of the message: apply writes it into the
        entry's commit and export writes it into the patch file.
        """
        lines = [self.subject.strip(), ""]
        body = "\n".join(line.rstrip() for line in self.description.strip().splitlines())
        if body:
            lines += [body, ""]
        lines += [
            f"{TRAILER_ENTRY}: {self.name}",
            f"Upstream-PR: {self.upstream_pr or 'none'}",
        ]
        return "\n".join(lines) + "\n"


@dataclass
class Stack:
    root: Path
    pin: Pin
    entries: list[Entry] = field(default_factory=list)

    @property
    def patches_dir(self) -> Path:
        return self.root / "patches"

    @property
    def overlay_dir(self) -> Path:
        return self.root / "overlay"

    @property
    def default_work(self) -> Path:
        return self.root / "work" / "vllm"

    @property
    def carried(self) -> list[Entry]:
        return [e for e in self.entries if e.carried]

    def entry(self, name: str) -> Entry:
        for e in self.entries:
            if e.name == name:
                return e
        names = ", ".join(e.name for e in self.entries) or "(none)"
        raise StackError(f"no entry named '{name}' in the series (entries: {names})")

    def owned_overlay(self) -> dict[str, str]:
        """overlay path -> owning entry name, for carried entries."""
        return {p: e.name for e in self.carried for p in e.overlay}


def cache_dir() -> Path:
    """Where downloads and base trees are cached (outside the repository)."""
    env = os.environ.get("HYBRID_STACK_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "hybrid-stack"


def find_root(start: Path | None = None) -> Path:
    """The stack root: the nearest folder upwards holding patches/series.toml."""
    env = os.environ.get("HYBRID_STACK_ROOT")
    if env:
        return Path(env).resolve()
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / "patches" / "series.toml").is_file():
            return d
    raise StackError(
        f"no patches/series.toml in {here} or above: run inside a vllm-hybrid-stack "
        "checkout or pass --root"
    )


def _load_toml(path: Path) -> dict:
    return tomlfile.load(path)


def _artifact(where: str, data: object) -> Artifact:
    if not isinstance(data, dict) or set(data) != {"filename", "sha256"}:
        raise StackError(f"{where} must have exactly the keys filename and sha256")
    sha = str(data["sha256"]).lower()
    if not SHA256_RE.match(sha):
        raise StackError(f"{where}.sha256 is not a 64-digit hex sha256: {sha!r}")
    return Artifact(str(data["filename"]), sha)


def load_pin(path: Path) -> Pin:
    data = _load_toml(path)
    up = data.get("upstream")
    if not isinstance(up, dict):
        raise StackError(f"{path}: missing [upstream] table")
    for key in ("project", "version", "sdist"):
        if key not in up:
            raise StackError(f"{path}: [upstream] needs '{key}'")
    git = up.get("git", {})
    local = up.get("local", {})
    return Pin(
        project=str(up["project"]),
        version=str(up["version"]),
        sdist=_artifact(f"{path.name}: upstream.sdist", up["sdist"]),
        wheel=_artifact(f"{path.name}: upstream.wheel", up["wheel"]) if "wheel" in up else None,
        git_url=str(git.get("url", "")),
        git_ref=str(git.get("ref", "")),
        local_path=str(local.get("path", "")),
    )


def _str_list(where: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise StackError(f"{where} must be a list of strings")
    return tuple(value)


def parse_entry(path: Path, i: int, raw: object) -> Entry:
    where = f"{path.name}: entry #{i + 1}"
    if not isinstance(raw, dict):
        raise StackError(f"{where} is not a table")
    unknown = set(raw) - ENTRY_KEYS
    if unknown:
        raise StackError(
            f"{where} has unknown key(s) {sorted(unknown)}; allowed: {sorted(ENTRY_KEYS)}"
        )
    for key in ("name", "subject", "status", "purpose"):
        if not str(raw.get(key, "")).strip():
            raise StackError(f"{where} needs a non-empty '{key}'")
    name = raw["name"]
    where = f"{path.name}: entry '{name}'"
    if not NAME_RE.match(name):
        raise StackError(f"{where}: name must be lower-case kebab (a-z, 0-9, '-', '.')")
    status = raw["status"]
    if status not in STATUSES:
        raise StackError(f"{where}: unknown status '{status}' (use one of {', '.join(STATUSES)})")
    if status == "upstreamed" and not raw.get("upstreamed_in"):
        raise StackError(f"{where}: status 'upstreamed' needs upstreamed_in = <release>")
    patch = str(raw.get("patch", ""))
    if patch and (Path(patch).name != patch or not patch.endswith(".patch")):
        raise StackError(f"{where}: patch must be a file name in patches/ ending .patch")
    overlay = _str_list(f"{where}: overlay", raw.get("overlay", []))
    for p in overlay:
        pp = Path(p)
        if pp.is_absolute() or ".." in pp.parts or p != pp.as_posix():
            raise StackError(f"{where}: overlay path {p!r} must be relative, no '..'")
    kernel_cases = str(raw.get("kernel_cases", ""))
    kc = Path(kernel_cases)
    if kernel_cases and (kc.is_absolute() or ".." in kc.parts or kc.suffix != ".py"):
        raise StackError(f"{where}: kernel_cases must be a relative path to a .py file")
    if status == "carried" and not patch and not overlay:
        raise StackError(f"{where}: a carried entry needs a patch or overlay files")
    return Entry(
        name=name,
        subject=raw["subject"],
        status=status,
        purpose=raw["purpose"],
        description=str(raw.get("description", "")),
        upstream_pr=str(raw.get("upstream_pr", "")),
        upstreamed_in=str(raw.get("upstreamed_in", "")),
        patch=patch,
        overlay=overlay,
        cpu_tests=_str_list(f"{where}: cpu_tests", raw.get("cpu_tests", [])),
        gpu_tests=_str_list(f"{where}: gpu_tests", raw.get("gpu_tests", [])),
        kernel_cases=kernel_cases,
        benches=_str_list(f"{where}: benches", raw.get("benches", [])),
    )


def description_path(series: Path, name: str) -> Path:
    """patches/<name>.md: an entry's description (its commit message body and PR
    body), kept beside its patch so series.toml holds metadata only."""
    return series.parent / f"{name}.md"


def with_description(series: Path, entry: Entry) -> Entry:
    md = description_path(series, entry.name)
    if not md.is_file():
        return entry
    if entry.description:
        raise StackError(
            f"{series.name}: entry '{entry.name}' has a description both in the series "
            f"and in {md.name}: keep one (the .md file)"
        )
    return replace(entry, description=md.read_text())


def load_series(path: Path) -> list[Entry]:
    data = _load_toml(path)
    unknown = set(data) - {"entry"}
    if unknown:
        raise StackError(f"{path}: unknown top-level key(s) {sorted(unknown)}")
    entries = [
        with_description(path, parse_entry(path, i, raw))
        for i, raw in enumerate(data.get("entry", []))
    ]
    seen: dict[str, str] = {}
    for e in entries:
        if e.name in seen:
            raise StackError(f"{path.name}: entry name '{e.name}' is used twice")
        seen[e.name] = e.name
    owners: dict[str, str] = {}
    patches: dict[str, str] = {}
    for e in entries:
        if e.patch:
            if e.patch in patches:
                raise StackError(
                    f"{path.name}: patch {e.patch} is named by both "
                    f"'{patches[e.patch]}' and '{e.name}'"
                )
            patches[e.patch] = e.name
        if not e.carried:
            continue
        for p in e.overlay:
            if p in owners:
                raise StackError(
                    f"{path.name}: overlay file {p} is owned by both '{owners[p]}' and '{e.name}'"
                )
            owners[p] = e.name
    return entries


def unowned_overlay(stack: Stack) -> list[str]:
    """Files under overlay/ (stack-relative) that no carried entry owns."""
    owned = {f"overlay/{p}" for e in stack.carried for p in e.overlay}
    if not stack.overlay_dir.is_dir():
        return []
    return sorted(
        rel
        for f in stack.overlay_dir.rglob("*")
        if f.is_file() and (rel := f.relative_to(stack.root).as_posix()) not in owned
    )


def load_stack(root: Path | None = None, *, check_files: bool = True) -> Stack:
    root = (root or find_root()).resolve()
    stack = Stack(
        root=root,
        pin=load_pin(root / "patches" / "pin.toml"),
        entries=load_series(root / "patches" / "series.toml"),
    )
    if check_files:
        for e in stack.carried:
            if e.patch and not (stack.patches_dir / e.patch).is_file():
                raise StackError(
                    f"entry '{e.name}' names patches/{e.patch}, which does not exist "
                    "(run 'hybrid-stack export' from a work tree, or fix series.toml)"
                )
            if e.kernel_cases and not (root / e.kernel_cases).is_file():
                raise StackError(
                    f"entry '{e.name}' names kernel_cases {e.kernel_cases}, which does not "
                    "exist (add the file or drop the key)"
                )
            for p in e.overlay:
                if not (stack.overlay_dir / p).is_file():
                    raise StackError(
                        f"entry '{e.name}' owns overlay/{p}, which does not exist "
                        "(add the file or remove it from the entry's overlay list)"
                    )
    return stack
