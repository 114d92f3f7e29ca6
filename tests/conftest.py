# SPDX-License-Identifier: Apache-2.0
"""A synthetic tiny upstream (sdist on a file:// index) and stack repository."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import tarfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from hybrid_stack.cli import main

CORE_V1 = "".join(f"def f{i}(x):\n    return x + {i}\n\n\n" for i in range(20))


def make_sdist(dest: Path, version: str, core: str = CORE_V1) -> tuple[str, str]:
    """A tiny `vllm-<version>.tar.gz`; returns (filename, sha256)."""
    root = f"vllm-{version}"
    files = {
        "PKG-INFO": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n",
        ".gitignore": "/vllm/_version.py\n*.egg-info/\nhidden_*.py\n",
        "vllm/__init__.py": "# SPDX-License-Identifier: Apache-2.0\n",
        "vllm/core.py": core,
        "vllm/hidden_kernel.py": "# shipped in the sdist but ignored by .gitignore\n",
        "vllm/_version.py": f"__version__ = '{version}'\n",
        "vllm.egg-info/PKG-INFO": "Name: vllm\n",
        "tools/run.sh": "#!/bin/sh\necho run\n",
    }
    name = f"{root}.tar.gz"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for rel, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"{root}/{rel}")
            info.size = len(data)
            info.mode = 0o755 if rel.endswith(".sh") else 0o644
            info.mtime = 1_700_000_000
            tf.addfile(info, io.BytesIO(data))
    (dest / name).write_bytes(buf.getvalue())
    return name, hashlib.sha256(buf.getvalue()).hexdigest()


def write_index(index: Path, dist: Path) -> None:
    page = index / "vllm"
    page.mkdir(parents=True, exist_ok=True)
    links = []
    for f in sorted(dist.glob("*.tar.gz")):
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        links.append(f'<a href="{f.as_uri()}#sha256={sha}">{f.name}</a>')
    (page / "index.html").write_text("<html><body>" + "\n".join(links) + "</body></html>")


def git(cwd: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": "dev",
        "GIT_AUTHOR_EMAIL": "dev@example.invalid",
        "GIT_COMMITTER_NAME": "dev",
        "GIT_COMMITTER_EMAIL": "dev@example.invalid",
    }
    return subprocess.run(
        ["git", "-c", "safe.directory=*", *args],
        cwd=cwd,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


@dataclass
class Toy:
    root: Path  # the stack repository
    dist: Path
    index: Path
    sha: str
    filename: str

    @property
    def work(self) -> Path:
        return self.root / "work" / "vllm"

    def cli(self, *args: str) -> int:
        return main(["--root", str(self.root), *args])

    def set_pin(self, filename: str, sha: str, version: str = "0.0.1") -> None:
        (self.root / "patches" / "pin.toml").write_text(
            textwrap.dedent(
                f"""\
                [upstream]
                project = "vllm"
                version = "{version}"
                sdist = {{ filename = "{filename}", sha256 = "{sha}" }}
                """
            )
        )

    def set_series(self, text: str) -> None:
        (self.root / "patches" / "series.toml").write_text(textwrap.dedent(text))

    def entry_toml(
        self,
        name: str,
        patch: str = "",
        overlay: tuple[str, ...] = (),
        status: str = "carried",
        extra: str = "",
    ) -> str:
        ov = ", ".join(f'"{p}"' for p in overlay)
        return (
            textwrap.dedent(
                f"""
            [[entry]]
            name = "{name}"
            subject = "[Test] {name}"
            status = "{status}"
            purpose = "test entry {name}"
            description = \"\"\"Why: testing {name}.\"\"\"
            patch = "{patch}"
            overlay = [{ov}]
            """
            )
            + extra
        )

    def commit_in_work(self, name: str, edits: dict[str, str]) -> None:
        for rel, text in edits.items():
            p = self.work / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        git(self.work, "add", "--all")
        git(self.work, "commit", "-q", "-m", f"wip {name}\n\nStack-Entry: {name}")

    def snapshot(self) -> dict[str, bytes]:
        out = {}
        for sub in ("patches", "overlay"):
            for f in sorted((self.root / sub).rglob("*")):
                if f.is_file():
                    out[f.relative_to(self.root).as_posix()] = f.read_bytes()
        return out


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Toy:
    dist = tmp_path / "dist"
    index = tmp_path / "index"
    root = tmp_path / "stack"
    for d in (dist, index, root / "patches", root / "overlay"):
        d.mkdir(parents=True)
    filename, sha = make_sdist(dist, "0.0.1")
    write_index(index, dist)
    monkeypatch.setenv("HYBRID_STACK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", index.as_uri())
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.delenv("HYBRID_STACK_ROOT", raising=False)
    t = Toy(root=root, dist=dist, index=index, sha=sha, filename=filename)
    t.set_pin(filename, sha)
    t.set_series("")
    return t


def add_entry(
    toy: Toy, name: str, edits: dict[str, str], overlay: tuple[str, ...] = (), patch: bool = True
) -> None:
    """Make an entry the way a developer does: commit in work/vllm, list it, export."""
    series = (toy.root / "patches" / "series.toml").read_text()
    toy.set_series(series + toy.entry_toml(name, f"{name}.patch" if patch else "", overlay))
    toy.commit_in_work(name, edits)
    assert toy.cli("export") == 0
