# SPDX-License-Identifier: Apache-2.0
"""`hybrid-stack build`: install the patched tree, Python-only, into a venv.

Two profiles:

lean (default; CI and laptops)
    torch CPU, vLLM's ``requirements/common.txt`` under a constraint pinning that
    torch, the test tools (triton, numba, pytest and plugins) and the build tools,
    then the tree editable with ``VLLM_TARGET_DEVICE=empty --no-build-isolation
    --no-deps``: no compiled extensions.
full
    the pinned release's wheel with all its dependencies (torch CUDA), then the
    tree editable through vLLM's own precompiled mechanism
    (``VLLM_PRECOMPILED_WHEEL_LOCATION`` = the sha256-verified wheel), so the
    release's compiled extensions are reused.

Dependencies are installed once: ``<venv>/hybrid-stack-build.json`` records a
stamp (hash of the profile, the requirement files and the pins). Re-running
build after a patch change only redoes the editable install (seconds), and
skips even that when the tree's commit is unchanged. The installed version is
``<pin version>+hybridstack.<tree commit>`` (``.dirty`` if the tree has
uncommitted edits).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hybrid_stack.errors import StackError
from hybrid_stack.proc import crash_point, die_with_parent, tee, write_atomic
from hybrid_stack.stack import Stack, load_stack
from hybrid_stack.venvs import (  # noqa: F401 - read_stamp, tree_version, default_venv: old home
    STAMP_NAME,
    default_venv,
    read_stamp,
    tree_version,
    venv_and_tree,
)

PROFILES = ("lean", "full")
LOG_NAME = "hybrid-stack-build.log"
# in the venv while build creates it: a later build finding it starts afresh
CREATING = ".hybrid-stack-creating"
STAMP_FORMAT = 1

# The lean profile's torch: the CPU build of the newest torch this project's
# machines carry (vLLM 0.33.0 itself pins 2.14.0; the pure-Python code paths
# tested on CPU work with 2.13), and the torchvision released with it
# (transformers' Qwen2-VL/Qwen3.5 processors import it). pip finds the CPU
# wheel through its configuration (find-links, or an extra index: PyTorch's
# CPU wheel index, see --torch-index).
LEAN_TORCH = ("torch==2.13.0+cpu", "torchvision==0.28.0")
# Test tools of the lean profile (pinned: the versions the CPU suite is measured
# with). triton runs kernels in interpreter mode; numba is a vLLM CPU dependency.
TEST_TOOLS = (
    "triton==3.8.0",
    "numba==0.65.0",
    "pytest==9.2.0",
    "pytest-asyncio==1.5.0",
    "pytest-timeout==2.4.0",
    "tblib==3.2.2",
    # vLLM's own test pin (requirements/test/cpu.txt); property-based tests use it
    "hypothesis==6.131.0",
)
# What vLLM's setup.py needs for a --no-build-isolation install (its
# build-system.requires less torch, cmake and ninja, which only the compiled
# profiles use).
BUILD_TOOLS = (
    "setuptools>=77.0.3,<81.0.0",
    "setuptools-scm>=8.0",
    "setuptools-rust>=1.9.0",
    "packaging>=24.2",
    "wheel",
    "jinja2",
)


# Disk a dependency install needs, in GB: the venv it leaves (measured: lean
# 2.8-2.9 GB, full 9.4 GB with CUDA torch) and pip's downloads in the temporary
# directory while it installs; summed where both are on one file system.
# Checked before pip starts, so a full disk is one clear error instead of an
# OSError half-way through the install.
DISK_NEEDED_GB = {"lean": {"venv": 4.0, "tmp": 1.0}, "full": {"venv": 11.0, "tmp": 3.0}}


# Lean profile: a startup hook that lets the CUDA-built torchvision import on
# the CPU torch (see the module's docstring).
SITE_HOOK = Path(__file__).parent / "data" / "lean_site" / "hybridstack_torchvision_cpu.py"
SITE_HOOK_PTH = "hybridstack-torchvision-cpu.pth"


@dataclass(frozen=True)
class Step:
    """One pip (or other) command of the build, with a name for progress and errors."""

    name: str
    argv: list[str]
    env: dict[str, str] | None = None


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "build",
        help="install the patched tree (Python-only, editable) into a venv",
        description=(
            "Create or reuse a venv and install the pinned vLLM's dependencies and "
            "the patched tree as an editable, Python-only install."
        ),
    )
    p.add_argument(
        "--profile",
        choices=PROFILES,
        default="lean",
        help="lean: torch CPU, no compiled extensions (default); full: the pinned "
        "wheel's dependencies and compiled extensions (torch CUDA, ~9.4 GB)",
    )
    p.add_argument("--venv", type=Path, default=None, help="the venv (default: work/venv)")
    p.add_argument(
        "--tree",
        type=Path,
        default=None,
        help="the applied tree to install (default: work/vllm)",
    )
    p.add_argument(
        "--python",
        default=sys.executable,
        help="interpreter that creates a new venv (default: the one running this)",
    )
    p.add_argument(
        "--wheel",
        type=Path,
        default=None,
        help="full profile: use this wheel instead of the verified one from fetch",
    )
    p.add_argument(
        "--torch-index",
        default=os.environ.get("HYBRID_STACK_TORCH_INDEX", ""),
        metavar="URL",
        help="lean profile: extra index for the CPU torch wheel, e.g. PyTorch's "
        "CPU wheel index (default: $HYBRID_STACK_TORCH_INDEX, else pip's own "
        "configuration)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="reinstall the dependencies even if the stamp says they are current",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="show pip's whole output")
    p.set_defaults(func=run)


# --------------------------------------------------------------------------- paths


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def resolve_paths(stack: Stack, args: argparse.Namespace) -> tuple[Path, Path]:
    return venv_and_tree(stack, args.venv, args.tree)


# --------------------------------------------------------------------------- stamp


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def dependency_key(
    stack: Stack,
    profile: str,
    tree: Path,
    python_version: str,
    *,
    torch_index: str = "",
) -> str:
    """The stamp of what the dependency steps install; equal stamp = skip them."""
    parts: dict[str, object] = {
        "format": STAMP_FORMAT,
        "profile": profile,
        "python": python_version,
        "build_tools": list(BUILD_TOOLS),
        "test_tools": list(TEST_TOOLS),
    }
    if profile == "lean":
        common = tree / "requirements" / "common.txt"
        if not common.is_file():
            raise StackError(
                f"{common} is missing: run 'hybrid-stack apply' to create the tree (or pass --tree)"
            )
        parts["torch"] = list(LEAN_TORCH)
        parts["torch_index"] = torch_index
        parts["common.txt"] = _sha256_file(common)
    else:
        if stack.pin.wheel is None:
            raise StackError(
                "patches/pin.toml has no upstream.wheel: add the release wheel's file "
                "name and sha256, or use --profile lean"
            )
        parts["wheel"] = stack.pin.wheel.sha256
    blob = json.dumps(parts, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


def write_stamp(venv: Path, data: dict) -> None:
    write_atomic(venv / STAMP_NAME, json.dumps(data, indent=2, sort_keys=True) + "\n")


# ------------------------------------------------------------------------- version


# -------------------------------------------------------------------------- steps


def dependency_steps(
    stack: Stack,
    profile: str,
    py: Path,
    tree: Path,
    venv: Path,
    *,
    wheel: Path | None = None,
    torch_index: str = "",
) -> list[Step]:
    pip = [str(py), "-m", "pip", "install", "--progress-bar", "off"]
    if profile == "lean":
        constraints = venv / "hybrid-stack-constraints.txt"
        constraints.write_text(
            "# written by hybrid-stack build: keep the lean profile's CPU torch\n"
            + "".join(f"{r}\n" for r in LEAN_TORCH)
        )
        index = ["--extra-index-url", torch_index] if torch_index else []
        return [
            Step("torch (CPU) + torchvision", [*pip, *index, *LEAN_TORCH]),
            Step(
                "vLLM requirements/common.txt + test and build tools",
                [
                    *pip,
                    *index,
                    "-c",
                    str(constraints),
                    "-r",
                    str(tree / "requirements" / "common.txt"),
                    *TEST_TOOLS,
                    *BUILD_TOOLS,
                ],
            ),
        ]
    assert wheel is not None
    return [
        Step(
            "the pinned wheel with all its dependencies (torch CUDA)",
            [*pip, str(wheel)],
        ),
        Step(
            "test and build tools",
            [*pip, *(t for t in TEST_TOOLS if "triton" not in t), *BUILD_TOOLS],
        ),
    ]


def editable_step(profile: str, py: Path, tree: Path, version: str, wheel: Path | None) -> Step:
    env = {
        # vLLM's setup.py: exact version, no +empty/+precompiled suffix.
        "VLLM_VERSION_OVERRIDE": version,
        "VLLM_TARGET_DEVICE": "empty" if profile == "lean" else "cuda",
    }
    if profile == "full":
        assert wheel is not None
        env["VLLM_PRECOMPILED_WHEEL_LOCATION"] = str(wheel)
    return Step(
        "the patched tree (editable"
        + (", no compiled extensions)" if profile == "lean" else ", precompiled)"),
        [
            str(py),
            "-m",
            "pip",
            "install",
            "--progress-bar",
            "off",
            "--no-build-isolation",
            "--no-deps",
            "-e",
            str(tree),
        ],
        env,
    )


_PIP_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"No matching distribution found for ([^\s;]+)"),
        "check that pip reaches an index carrying it ('pip config list'); for the "
        "CPU torch pass --torch-index <PyTorch's CPU wheel index URL>",
    ),
    (
        re.compile(r"Failed to build ([^\s;]+)"),
        "it has no wheel for this Python/platform: install its system build "
        "dependencies, or use a Python for which a wheel exists (--python)",
    ),
    (
        re.compile(r"Cannot install ([^\s;]+)"),
        "the pins conflict: see the resolver's explanation in the log",
    ),
    (
        re.compile(r"ModuleNotFoundError: No module named '([^']+)'"),
        "a build tool is missing from the venv: rerun with --force",
    ),
)
_LAST_PKG = re.compile(r"^\s*(?:Collecting|Processing|Building wheel for) (\S+)")


def diagnose(step: Step, output: str) -> tuple[str, str]:
    """(package, fix) for a failed step, from pip's output."""
    for pattern, fix in _PIP_PATTERNS:
        m = pattern.search(output)
        if m:
            return m.group(1), fix
    last = ""
    for line in output.splitlines():
        m = _LAST_PKG.match(line)
        if m:
            last = m.group(1)
    return (
        last or step.name,
        "see the log's last lines; fix the cause and rerun 'hybrid-stack build'",
    )


_ECHO = re.compile(
    r"^(Collecting|Installing collected|Successfully installed|Building|"
    r"Obtaining|ERROR|error:)"
)


def run_step(step: Step, i: int, n: int, log: Path, *, verbose: bool) -> float:
    """Run one step, teeing pip's output into the log; raise StackError on failure."""
    print(f"[{i}/{n}] {step.name} ...", flush=True)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("PIP_REQUIRE_VIRTUALENV", None)
    if step.env:
        env.update(step.env)

    def shown(line: str) -> str | None:
        if verbose:
            return "    " + line.rstrip()
        return "    " + line.rstrip()[:110] if _ECHO.match(line) else None

    t0 = time.monotonic()
    with log.open("a") as logf:
        logf.write(f"\n### {step.name}\n$ {' '.join(step.argv)}\n")
        logf.flush()
        # cwd: never the tree root, whose vllm/ would shadow the install
        rc, lines = tee(step.argv, cwd=log.parent, env=env, log=logf, echo=shown)
    dt = time.monotonic() - t0
    if rc != 0:
        output = "".join(lines)
        pkg, fix = diagnose(step, output)
        tail = "".join(lines[-15:])
        print(tail, file=sys.stderr, end="")
        raise StackError(f"step '{step.name}' failed (exit {rc}) at {pkg}: {fix} (full log: {log})")
    print(f"      done in {dt:.0f} s", flush=True)
    return dt


def site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        raise StackError(f"{venv} has no lib/python3*/site-packages: delete it and rebuild")
    return found[-1]


def install_site_hook(venv: Path, profile: str) -> None:
    """Install (lean) or remove (full) the torchvision startup hook; idempotent."""
    sp = site_packages(venv)
    module, pth = sp / SITE_HOOK.name, sp / SITE_HOOK_PTH
    if profile != "lean":
        module.unlink(missing_ok=True)
        pth.unlink(missing_ok=True)
        return
    text = SITE_HOOK.read_text()
    if not module.is_file() or module.read_text() != text:
        module.write_text(text)
    line = f"import {SITE_HOOK.stem}\n"
    if not pth.is_file() or pth.read_text() != line:
        pth.write_text(line)


def verify_import(py: Path, tree: Path, version: str, cwd: Path) -> tuple[str, str]:
    """Import vllm in the venv from outside the tree; check it is the tree's."""
    code = "import json, vllm; print(json.dumps([vllm.__file__, vllm.__version__]))"
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([str(py), "-c", code], capture_output=True, text=True, cwd=cwd, env=env)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise StackError(
            f"'import vllm' fails in the venv: {last}; rerun 'hybrid-stack build --force'"
        )
    file, got = json.loads(proc.stdout.strip().splitlines()[-1])
    pkg = (tree / "vllm").resolve()
    if not Path(file).resolve().is_relative_to(pkg):
        raise StackError(
            f"the venv imports vllm from {file}, not from the tree {tree}: rerun "
            "'hybrid-stack build --force'"
        )
    if got != version:
        raise StackError(
            f"the venv's vllm reports version {got}, expected {version}: rerun "
            "'hybrid-stack build' (it rewrites vllm/_version.py)"
        )
    return file, got


def existing_ancestor(path: Path) -> Path:
    """path, or its nearest parent that exists (what a new venv will sit on)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_disk(profile: str, venv: Path) -> None:
    """Refuse a dependency install that would run out of disk (venv or pip's temp)."""
    need = DISK_NEEDED_GB[profile]
    places = (
        (venv, "the venv", need["venv"]),
        (Path(tempfile.gettempdir()), "pip's temporary directory", need["tmp"]),
    )
    # file system -> (a path on it, the places it holds)
    by_fs: dict[int, tuple[Path, list[tuple[Path, str, float]]]] = {}
    for path, what, gb in places:
        probe = existing_ancestor(path)
        by_fs.setdefault(os.stat(probe).st_dev, (probe, []))[1].append((path, what, gb))
    short = []
    for probe, group in by_fs.values():
        want = sum(gb for _, _, gb in group)
        free = shutil.disk_usage(probe).free / 1e9
        if free < want:
            where = " and ".join(f"{what} {path}" for path, what, _ in group)
            short.append(f"{where}: {free:.1f} GB free, about {want:.0f} GB needed")
    if short:
        raise StackError(
            f"not enough disk for the {profile} profile's dependencies: {'; '.join(short)}; "
            "free space (or point TMPDIR / --venv elsewhere) and rerun 'hybrid-stack build'"
        )


def dir_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
    return total


def python_version(py: Path) -> str:
    proc = subprocess.run(
        [str(py), "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise StackError(f"{py} does not run: delete the venv and rerun build")
    return proc.stdout.strip()


def resolve_wheel(stack: Stack, wheel: Path | None) -> Path:
    if wheel is not None:
        if not wheel.is_file():
            raise StackError(f"--wheel {wheel} does not exist")
        return wheel.absolute()
    from hybrid_stack.downloads import fetch_artifact

    return Path(fetch_artifact(stack, "wheel")).absolute()


# ---------------------------------------------------------------------------- run


def build(
    stack: Stack,
    *,
    profile: str,
    venv: Path,
    tree: Path,
    python: str = sys.executable,
    wheel: Path | None = None,
    torch_index: str = "",
    force: bool = False,
    verbose: bool = False,
) -> dict:
    """Build (or bring up to date) the venv; return the new stamp."""
    if not (tree / "vllm").is_dir() or not (tree / "setup.py").is_file():
        raise StackError(
            f"{tree} is not a vLLM tree: run 'hybrid-stack apply' first (or pass --tree)"
        )
    t_start = time.monotonic()
    py = venv_python(venv)
    creating = venv / CREATING
    if creating.exists():  # a build killed while it created the venv
        print(f"removing the half-made venv {venv}", flush=True)
        shutil.rmtree(venv)
    if not py.exists():
        print(f"creating venv {venv} ({python})", flush=True)
        venv.mkdir(parents=True, exist_ok=True)
        creating.write_text("hybrid-stack build is creating this venv\n")
        proc = subprocess.run(
            [python, "-m", "venv", str(venv)],
            capture_output=True,
            text=True,
            preexec_fn=die_with_parent,
        )
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["?"])[-1]
            raise StackError(
                f"could not create the venv {venv}: {last} (install python3-venv or pass --python)"
            )
        crash_point("venv")
        creating.unlink()
    log = venv / LOG_NAME
    stamp = read_stamp(venv)
    key = dependency_key(stack, profile, tree, python_version(py), torch_index=torch_index)
    version = tree_version(stack, tree)
    deps_current = not force and stamp.get("deps") == key
    wheel_path = resolve_wheel(stack, wheel) if profile == "full" else None

    dep_steps: list[Step] = []
    if deps_current:
        print(f"dependencies: up to date ({profile} profile, stamp {key[:12]})")
    else:
        check_disk(profile, venv)
        dep_steps = dependency_steps(
            stack, profile, py, tree, venv, wheel=wheel_path, torch_index=torch_index
        )
    editable = stamp.get("editable", {})
    editable_current = (
        deps_current and editable.get("tree") == str(tree) and editable.get("version") == version
    )
    verified: tuple[str, str] | None = None
    if editable_current:
        try:
            verified = verify_import(py, tree, version, venv)
        except StackError:
            editable_current = False
    steps = dep_steps if not editable_current else []
    if editable_current:
        print(f"editable install: up to date ({version})")
    else:
        steps = [*dep_steps, editable_step(profile, py, tree, version, wheel_path)]

    new_stamp = {
        "format": STAMP_FORMAT,
        "profile": profile,
        "deps": key,
        "deps_installed": stamp.get("deps_installed") if deps_current else None,
        "editable": editable if editable_current else {},
        "step_seconds": stamp.get("step_seconds", {}) if deps_current else {},
    }
    if steps:  # the log keeps the last build that ran something
        log.write_text(f"# hybrid-stack build --profile {profile} ({time.ctime()})\n")
    if dep_steps and stamp:
        # a dependency install that fails half-way must not look current later
        write_stamp(venv, {**stamp, "deps": None, "editable": {}})
    for i, step in enumerate(steps, 1):
        dt = run_step(step, i, len(steps), log, verbose=verbose)
        new_stamp["step_seconds"][step.name] = round(dt, 1)
        if dep_steps and step is dep_steps[-1]:
            # the dependencies are in: a later failure does not redo them
            new_stamp["deps_installed"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            write_stamp(venv, new_stamp)
    install_site_hook(venv, profile)
    file, got = verified if verified and not steps else verify_import(py, tree, version, venv)
    new_stamp["editable"] = {"tree": str(tree), "version": version}
    write_stamp(venv, new_stamp)
    total = time.monotonic() - t_start
    size = dir_size(venv) / 1e9
    print(
        f"built {venv} ({profile}): vllm {got} from {Path(file).parent} "
        f"in {total:.0f} s, venv {size:.1f} GB"
    )
    return new_stamp


def run(args: argparse.Namespace) -> int:
    stack = load_stack(args.root)
    venv, tree = resolve_paths(stack, args)
    build(
        stack,
        profile=args.profile,
        venv=venv,
        tree=tree,
        python=args.python,
        wheel=args.wheel,
        torch_index=args.torch_index,
        force=args.force,
        verbose=args.verbose,
    )
    return 0
