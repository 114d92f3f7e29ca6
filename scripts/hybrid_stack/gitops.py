# SPDX-License-Identifier: Apache-2.0
"""All git plumbing of the stack, in one place.

Every call runs with the user's and the system's git config switched off and a
fixed identity and date, so the same inputs always give the same commits and
byte-identical patch files, whoever runs the tool.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import git  # gitpython
from git.exc import GitCommandError

from hybrid_stack.errors import StackError
from hybrid_stack.proc import die_with_parent

IDENTITY = {
    "GIT_AUTHOR_NAME": "vllm-hybrid-stack",
    "GIT_AUTHOR_EMAIL": "stack@vllm-hybrid-stack.invalid",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+0000",
    "GIT_COMMITTER_NAME": "vllm-hybrid-stack",
    "GIT_COMMITTER_EMAIL": "stack@vllm-hybrid-stack.invalid",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+0000",
}
ISOLATION = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_TERMINAL_PROMPT": "0",
    # read-only commands (status) take no lock: a tool killed during one
    # leaves no index.lock behind
    "GIT_OPTIONAL_LOCKS": "0",
    "LC_ALL": "C",
}
# Options for every exported patch: no hashes, no stat, no signature, stable
# rename detection and diff algorithm, whatever the user's config says.
FORMAT_PATCH_OPTS = (
    "--stdout",
    "--keep-subject",
    "--no-stat",
    "--zero-commit",
    "--full-index",
    "--no-signature",
    "--binary",
    "--find-renames=50%",
    "--diff-algorithm=myers",
    "--unified=3",
    "--no-numbered",
    "--no-notes",
    "--encoding=UTF-8",
)
AM_OPTS = ("--3way", "--keep", "--keep-cr", "--quiet", "--no-gpg-sign")


class GitFailed(StackError):
    def __init__(self, args: tuple[str, ...], status: int, stderr: str):
        self.status = status
        self.stderr = stderr.strip()
        first = self.stderr.splitlines()[0] if self.stderr else f"exit {status}"
        super().__init__(f"git {' '.join(args[:2])} failed: {first}")


@dataclass
class Repo:
    """A git work tree driven with a fixed environment."""

    path: Path

    def _execute(self, args: tuple[str, ...], env: dict[str, str] | None = None, **kw):
        """git.Git.execute of `git ARGS` with the isolated config and fixed identity."""
        full_env = {**os.environ, **ISOLATION, **IDENTITY, **(env or {})}
        cmd = ["git", "-c", "safe.directory=*", "-c", "core.quotePath=false", *args]
        try:
            # die_with_parent: a killed tool leaves no git running on its own
            return git.Git(str(self.path)).execute(
                cmd, env=full_env, preexec_fn=die_with_parent, **kw
            )
        except GitCommandError as e:  # pragma: no cover - execute() failed to start
            raise StackError(f"could not run git: {e}") from None

    def run(
        self,
        *args: str,
        check: bool = True,
        env: dict[str, str] | None = None,
        strip: bool = True,
    ) -> str:
        status, out, err = self._execute(
            args,
            env,
            with_extended_output=True,
            with_exceptions=False,
            strip_newline_in_stdout=strip,
        )
        if check and status != 0:
            raise GitFailed(args, status, err)
        return out if check else (out if status == 0 else "")

    def status(self, *args: str) -> tuple[int, str, str]:
        """(exit status, stdout, stderr) of `git ARGS`, whatever the status."""
        return self._execute(args, with_extended_output=True, with_exceptions=False)

    def ok(self, *args: str) -> bool:
        status, _, _ = self._execute(args, with_extended_output=True, with_exceptions=False)
        return status == 0

    # -- queries ---------------------------------------------------------
    def is_repo(self) -> bool:
        return (self.path / ".git").exists() and self.ok("rev-parse", "--git-dir")

    def rev(self, ref: str) -> str:
        out = self.run("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", check=False)
        if not out:
            raise StackError(f"{self.path}: no commit '{ref}'")
        return out

    def has_ref(self, ref: str) -> bool:
        return self.ok("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")

    def dirty(self) -> list[str]:
        """Uncommitted changes: modified, staged and untracked (not ignored) paths."""
        out = self.run("status", "--porcelain=v1", "--untracked-files=all", strip=False)
        return [line[3:] for line in out.splitlines() if line.strip()]

    def untracked(self) -> list[str]:
        """Untracked, not ignored paths."""
        out = self.run("ls-files", "-z", "--others", "--exclude-standard")
        return [p for p in out.split("\0") if p]

    def operation_in_progress(self) -> str:
        gitdir = self.git_dir()
        for name, what in (
            ("rebase-apply", "git am/rebase"),
            ("rebase-merge", "git rebase"),
            ("MERGE_HEAD", "git merge"),
            ("CHERRY_PICK_HEAD", "git cherry-pick"),
        ):
            if (gitdir / name).exists():
                return what
        return ""

    def clear_stale_locks(self) -> list[str]:
        """Remove the lock files a killed git leaves (index.lock, HEAD.lock,
        refs/**.lock); only for a caller that knows no git runs in this tree."""
        gitdir = self.git_dir()
        found = [gitdir / "index.lock", gitdir / "HEAD.lock", gitdir / "ORIG_HEAD.lock"]
        found += [gitdir / "packed-refs.lock", *(gitdir / "refs").rglob("*.lock")]
        gone = []
        for f in found:
            if f.is_file():
                f.unlink()
                gone.append(f.relative_to(gitdir).as_posix())
        return gone

    def git_dir(self) -> Path:
        return Path(self.run("rev-parse", "--absolute-git-dir"))

    def message(self, commit: str) -> str:
        return self.run("log", "-1", "--format=%B", commit, strip=False)

    def commits(self, base: str, head: str = "HEAD") -> list[str]:
        if self.run("rev-list", "--merges", f"{base}..{head}"):
            raise StackError(
                f"{self.path}: merge commits between {base} and {head}; the stack "
                "must be a straight line of commits (rebase instead of merging)"
            )
        out = self.run("rev-list", "--reverse", f"{base}..{head}")
        return out.split() if out else []

    def blob(self, commit: str, path: str) -> tuple[str, bytes] | None:
        """(mode, bytes) of a file in a commit, or None if it is not there."""
        line = self.run("ls-tree", commit, "--", path)
        if not line:
            return None
        mode, kind, sha = line.split("\t", 1)[0].split()
        if kind != "blob":
            raise StackError(f"{path} is a {kind} in {commit[:12]}, not a file")
        data = self._execute(
            ("cat-file", "blob", sha), strip_newline_in_stdout=False, stdout_as_string=False
        )
        return mode, data

    # -- writes ----------------------------------------------------------
    def commit_message_file(self, message: str) -> str:
        fd, name = tempfile.mkstemp(prefix="hybrid-stack-msg-")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(message)
        return name

    def commit(self, message: str, *extra: str) -> str:
        msg = self.commit_message_file(message)
        try:
            self.run(
                "commit",
                "--quiet",
                "--no-verify",
                "--no-gpg-sign",
                "--cleanup=verbatim",
                "-F",
                msg,
                *extra,
            )
        finally:
            os.unlink(msg)
        return self.rev("HEAD")

    def commit_tree(self, tree: str, parent: str, message: str) -> str:
        msg = self.commit_message_file(message)
        try:
            return self.run("commit-tree", tree, "-p", parent, "-F", msg)
        finally:
            os.unlink(msg)

    def tree_without(self, commit: str, parent: str, paths: list[str]) -> str:
        """The tree of `commit` with `paths` put back as they are in `parent`."""
        fd, index = tempfile.mkstemp(prefix="hybrid-stack-index-")
        os.close(fd)
        os.unlink(index)
        env = {"GIT_INDEX_FILE": index}
        try:
            self.run("read-tree", commit, env=env)
            for p in paths:
                line = self.run("ls-tree", parent, "--", p)
                if line:
                    mode, _, sha = line.split("\t", 1)[0].split()
                    self.run("update-index", "--cacheinfo", f"{mode},{sha},{p}", env=env)
                else:
                    self.run("update-index", "--force-remove", "--", p, env=env)
            return self.run("write-tree", env=env)
        finally:
            if os.path.exists(index):
                os.unlink(index)

    def format_patch(self, commit: str) -> bytes:
        return self._execute(
            ("format-patch", *FORMAT_PATCH_OPTS, "-1", commit),
            strip_newline_in_stdout=False,
            stdout_as_string=False,
        )
