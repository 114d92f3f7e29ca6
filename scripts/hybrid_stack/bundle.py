# SPDX-License-Identifier: Apache-2.0
"""`hybrid-stack bundle`: pack the GPU kernel tests and benchmarks for an offline GPU.

GPU machines often have torch and triton but neither vLLM's compiled extensions
nor a network. The bundle is one tarball holding:

  run.py                the runner (stdlib only; see bundle_data/run.py)
  hybrid_stack_shard.py its pytest plugin for run.py --shard I/N
  hybrid_stack_failnow.py  its pytest plugin printing each failure when it happens
  manifest.json         selections (quick, full, one per series entry), benches,
                        wheels, the vLLM version and where the bundle came from
  src/vllm/             the applied tree's Python sources (no compiled modules),
                        plus stubs/shims so it imports without them (STUBS, SHIMS)
  src/vllm-<v>.dist-info  so importlib.metadata.version("vllm") works
  tests/                upstream mamba/fla kernel tests, test_mamba_utils.py, every
                        series entry's gpu_tests, the helpers they import, and a
                        small conftest.py replacing upstream's engine-wide one
  bench/                the stack's benchmarks (hybrid_stack/bench)
  wheels/               the pure-Python deps a torch+triton image lacks (DEPS)

Wheels are fetched with `pip download` from pip's configured index for the target
Python and platform and cached under the stack cache dir; `--wheel-dir` takes
them from a folder instead (offline, tests).
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import re
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from hybrid_stack import fipack, tritonpack
from hybrid_stack import stack as stack_mod
from hybrid_stack.errors import StackError
from hybrid_stack.gitops import Repo

DEFAULT_NAME = "hybrid-stack-bundle"
DEFAULT_MAX_MIB = 60.0
DEFAULT_PYTHON = "3.12"
DEFAULT_PLATFORM = "manylinux_2_31_x86_64"
# --flashinfer without a version: the one requirements/cuda.txt pins
PINNED = "pinned"
DATA_DIR = Path(__file__).parent / "bundle_data"
BENCH_DIR = Path(__file__).parent / "bench"
# Benchmarks of upstream kernels the stack carries nothing for (yet); the
# entries name their own (`benches` in series.toml).
BASE_BENCHES = ("gdn_prefill",)


def benches(stack: stack_mod.Stack) -> list[str]:
    """The bundle's benchmarks: the base ones and every entry's, in that order."""
    names = [*BASE_BENCHES, *(b for e in stack.entries for b in e.benches)]
    missing = sorted(b for b in names if not (BENCH_DIR / f"{b}.py").is_file())
    if missing:
        raise StackError(
            f"no benchmark script {', '.join(missing)} in {BENCH_DIR}: fix the entries' "
            "benches in series.toml"
        )
    return list(dict.fromkeys(names))


# Pure-Python (or self-contained binary) deps that vLLM 0.33.0 imports and a plain
# torch+triton GPU image lacks, pinned to a set known to work together (pydantic
# pins pydantic-core exactly, httpx2 pins httpcore2). pytest-xdist and execnet are
# on the GPU image already (device KINDS.md), so they are not carried.
DEPS: dict[str, str] = {
    "pydantic": "2.14.4",
    "pydantic-core": "2.50.5",
    "annotated-types": "0.8.0",
    "typing-inspection": "0.4.5",
    "typing-extensions": "4.16.0",
    "pyzmq": "27.3.0",
    "msgspec": "0.22.0",
    "cbor2": "6.3.0",
    "cachetools": "8.0.2",
    "pybase64": "1.5.1",
    "openai": "3.57.0",
    "openai-harmony": "0.0.8",
    "httpx2": "2.16.2",
    "httpcore2": "2.16.2",
    "truststore": "0.10.5",
    "jiter": "0.19.0",
    "distro": "1.9.0",
    "sniffio": "1.3.1",
    "anyio": "4.16.0",
    "h11": "0.16.0",
    "idna": "3.20",
    "fastapi": "0.136.3",  # vLLM 0.33.0 needs fastapi < 0.137 (later ones import opentelemetry)
    "starlette": "1.10.0",
    "partial-json-parser": "0.2.1.1.post7",
    "xgrammar": "0.2.8",
    "apache-tvm-ffi": "0.1.15.post2",
    "llguidance": "1.7.6",
    # imported when the engine starts (the end-to-end harness, e2e/)
    "compressed-tensors": "0.17.0",
    "loguru": "0.7.3",
    "depyf": "0.20.0",
    "astor": "0.8.1",
    "dill": "0.4.1",
    "blake3": "1.0.11",
    "orjson": "3.13.0",
    "setproctitle": "1.3.8",
    "lark": "1.2.2",
    "ijson": "3.6.0",
    "python-json-logger": "4.2.0",
}

# Upstream tests bundled from the applied tree (directories are taken whole).
TEST_DIRS = ("tests/kernels/mamba", "tests/kernels/fla")
TEST_FILES = ("tests/v1/worker/test_mamba_utils.py",)
# The `quick` selection: "is the bundle sane on this GPU" in about a minute (241
# tests in 54 s with -n 12 on the H200: the mamba state copy kernels and Model
# Runner V2's mamba utilities). Carried entries' gpu_tests are selections of their
# own (hundreds of tests each; shard them with --shard).
QUICK = (
    "tests/kernels/mamba/test_memcpy_u64_tiled.py",
    "tests/kernels/mamba/test_precopy_mamba_align.py",
    "tests/v1/worker/test_mamba_utils.py",
)
# The upstream kernel files measured at 462 passed in 5 min 19 s (-n 8, H200).
MAMBA_KERNELS = (
    "tests/kernels/mamba/test_memcpy_u64_tiled.py",
    "tests/kernels/mamba/test_precopy_mamba_align.py",
    "tests/kernels/mamba/test_mamba_ssm_ssd.py",
    "tests/kernels/mamba/test_causal_conv1d.py",
)

# Compiled extension modules vLLM imports unconditionally: bundle path -> stub file.
STUBS = {"vllm/_C_stable_libtorch.py": "stubs/_C_stable_libtorch.py"}

# Source rewrites in the bundled copy (never in the tree): path, pattern, new text.
FA_RAISE = re.compile(
    r"^if not \(FA2_AVAILABLE or FA3_AVAILABLE\):\n    raise ImportError\(\n"
    r"(?:        .*\n)+?    \)\n",
    re.MULTILINE,
)
FA_SHIM = (
    "# hybrid-stack bundle: the compiled FA2/FA3 extensions are absent. Upstream\n"
    "# raises ImportError here; the bundle lets the package import (FA2_AVAILABLE\n"
    "# and FA3_AVAILABLE stay False) and every kernel call raises when made.\n"
    "HYBRID_STACK_STUB = not (FA2_AVAILABLE or FA3_AVAILABLE)\n"
)
SHIMS = (("vllm/vllm_flash_attn/__init__.py", FA_RAISE, FA_SHIM),)

# The end-to-end harness (bundle_data/e2e): harness, compiled-op shims, model
# configs and the tiny-model GPU selection, which runs in one process (engines
# take most of the GPU's memory, one at a time).
E2E_DIR = DATA_DIR / "e2e"
E2E_SELECTIONS = {"e2e-tiny": ["e2e/test_e2e_tiny.py"]}
CSRC_BINDINGS = "csrc/torch_bindings.cpp"
LIBRARY_BLOCK = re.compile(r"STABLE_TORCH_LIBRARY(?:_FRAGMENT)?\(\s*(\w+)\s*,\s*(\w+)\s*\)\s*\{")
C_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')
HASATTR_OP = re.compile(r'hasattr\(\s*torch\.ops\.(\w+)\s*,\s*"(\w+)"\s*\)')

# tool caches a working copy accumulates (never bundle content)
SKIP_DIRS = {"__pycache__", ".git", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".hypothesis"}
SKIP_SUFFIXES = (".so", ".pyc", ".pyo", ".pyd", ".o", ".a")
TESTS_IMPORT = re.compile(r"^\s*(?:from|import)\s+(tests(?:\.\w+)+)", re.MULTILINE)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bundle",
        help="pack kernel tests + benchmarks + deps for an offline GPU machine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--work", type=Path, help="applied tree (default: work/vllm)")
    p.add_argument(
        "--out",
        type=Path,
        help="output folder (default: work/bundle), or the tarball's path when it "
        "ends in .tar.gz / .tgz (the listing is written beside it)",
    )
    p.add_argument("--name", default=DEFAULT_NAME, help="tarball / top folder name")
    p.add_argument(
        "--python-version",
        default=DEFAULT_PYTHON,
        help=f"target CPython X.Y for the wheels (default {DEFAULT_PYTHON})",
    )
    p.add_argument(
        "--platform",
        default=DEFAULT_PLATFORM,
        help="target platform; manylinux_2_N_<arch> accepts every manylinux tag up "
        f"to glibc 2.N (default {DEFAULT_PLATFORM})",
    )
    p.add_argument(
        "--wheel-dir",
        type=Path,
        help="take the wheels from this folder instead of pip download (offline)",
    )
    p.add_argument(
        "--max-size-mib",
        type=float,
        default=DEFAULT_MAX_MIB,
        help=f"fail when the tarball is larger (default {DEFAULT_MAX_MIB:g})",
    )
    p.add_argument(
        "--triton",
        metavar="VERSION",
        help="also pack this Triton release for the bundle's Python, in parts small "
        "enough to carry, into triton-VERSION/ beside the tarball (run.py --triton; "
        "see hybrid_stack/tritonpack.py)",
    )
    p.add_argument(
        "--flashinfer",
        nargs="?",
        const=PINNED,
        metavar="VERSION",
        help="also pack FlashInfer (default: the version the tree's requirements/cuda.txt "
        "pins) and the CuTe DSL its GDN prefill needs, in parts, into "
        "flashinfer-VERSION/ beside the tarball (run.py --flashinfer; see "
        "hybrid_stack/fipack.py)",
    )
    p.add_argument(
        "--triton-part-mib",
        type=float,
        default=tritonpack.DEFAULT_PART_MIB,
        help=f"largest Triton or FlashInfer part in MiB (default {tritonpack.DEFAULT_PART_MIB:g})",
    )
    p.set_defaults(func=run)


# ---------------------------------------------------------------------------
# wheels


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


@dataclass(frozen=True)
class Wheel:
    path: Path
    name: str  # normalized
    version: str
    pytags: tuple[str, ...]
    abitags: tuple[str, ...]
    plattags: tuple[str, ...]

    @classmethod
    def parse(cls, path: Path) -> Wheel | None:
        parts = path.name[: -len(".whl")].split("-")
        if len(parts) not in (5, 6):
            return None
        name, version = parts[0], parts[1]
        py, abi, plat = parts[-3:]
        return cls(
            path,
            norm(name),
            version,
            tuple(py.split(".")),
            tuple(abi.split(".")),
            tuple(plat.split(".")),
        )

    def fits(self, python: str, platforms: set[str]) -> bool:
        major, minor = (int(x) for x in python.split(".")[:2])
        cp = f"cp{major}{minor}"
        py_ok = any(
            t in (f"py{major}", f"py{major}{minor}", cp)
            or (t.startswith("cp3") and "abi3" in self.abitags and int(t[3:]) <= minor)
            for t in self.pytags
        )
        plat_ok = "any" in self.plattags or bool(platforms & set(self.plattags))
        return py_ok and plat_ok


def platform_tags(platform: str) -> list[str]:
    """Every tag a `manylinux_2_N_<arch>` target accepts (pip matches tags exactly)."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not m:
        return [platform]
    glibc, arch = int(m.group(1)), m.group(2)
    tags = [f"manylinux_2_{n}_{arch}" for n in range(glibc, 4, -1)]
    for legacy, n in (("manylinux2014", 17), ("manylinux2010", 12), ("manylinux1", 5)):
        if glibc >= n:
            tags.append(f"{legacy}_{arch}")
    return tags


def pick_wheels(folder: Path, python: str, platforms: set[str]) -> dict[str, Wheel]:
    found: dict[str, Wheel] = {}
    if not folder.is_dir():
        return found
    for path in sorted(folder.glob("*.whl")):
        w = Wheel.parse(path)
        if w is None or w.name not in {norm(n) for n in DEPS}:
            continue
        want = DEPS[next(n for n in DEPS if norm(n) == w.name)]
        if w.version == want and w.fits(python, platforms):
            found[w.name] = w
    return found


def pip_download(dest: Path, names: list[str], python: str, tags: list[str]) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", python, "--implementation", "cp", "-d", str(dest)]
    for t in tags:
        cmd += ["--platform", t]
    cmd += [f"{n}=={DEPS[n]}" for n in names]
    print(f"bundle: pip download {len(names)} wheel(s) into {dest}", flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise StackError(
            f"pip download failed for {', '.join(names)}: {last} (check the network "
            "and pip's index, or pass --wheel-dir with the wheels already downloaded)"
        )


def collect_wheels(python: str, platform: str, wheel_dir: Path | None) -> list[Wheel]:
    if not re.fullmatch(r"3\.\d+", python):
        raise StackError(f"--python-version must look like 3.12, not {python!r}")
    tags = platform_tags(platform)
    plats = set(tags)
    if wheel_dir is not None:
        folder = wheel_dir
    else:
        folder = stack_mod.cache_dir() / "wheels" / f"cp{python.replace('.', '')}-{platform}"
    found = pick_wheels(folder, python, plats)
    missing = [n for n in DEPS if norm(n) not in found]
    if missing and wheel_dir is None:
        pip_download(folder, missing, python, tags)
        found = pick_wheels(folder, python, plats)
        missing = [n for n in DEPS if norm(n) not in found]
    if missing:
        listed = ", ".join(f"{n}=={DEPS[n]}" for n in missing)
        raise StackError(
            f"no wheel for Python {python} / {platform} in {folder} for: {listed} "
            "(download them there, or drop --wheel-dir to let pip fetch them)"
        )
    wheels = [found[norm(n)] for n in DEPS]
    check_pins(wheels)
    return wheels


def requires_dist(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as zf:
        meta = next((n for n in zf.namelist() if n.endswith(".dist-info/METADATA")), None)
        if meta is None:
            return []
        text = zf.read(meta).decode("utf-8", "replace")
    return [
        line.split(":", 1)[1].strip()
        for line in text.splitlines()
        if line.startswith("Requires-Dist:")
    ]


def check_pins(wheels: list[Wheel]) -> None:
    """Exact (==) requirements between bundled wheels must hold (pydantic-core)."""
    have = {w.name: w.version for w in wheels}
    for w in wheels:
        for req in requires_dist(w.path):
            spec, _, marker = req.partition(";")
            if "extra" in marker:
                continue
            m = re.fullmatch(r"\s*([A-Za-z0-9._-]+)\s*\(?\s*==\s*([^,\s)]+)\s*\)?\s*", spec)
            if m and norm(m.group(1)) in have and have[norm(m.group(1))] != m.group(2):
                raise StackError(
                    f"{w.path.name} needs {m.group(1)}=={m.group(2)} but the bundle "
                    f"pins {have[norm(m.group(1))]}: fix DEPS in hybrid_stack/bundle.py"
                )


# ---------------------------------------------------------------------------
# contents


@dataclass
class Plan:
    """Files of the bundle: archive path -> source path or bytes."""

    files: dict[str, Path | bytes] = field(default_factory=dict)

    def add(self, arc: str, src: Path | bytes) -> None:
        self.files[arc] = src

    def size(self, arc: str) -> int:
        src = self.files[arc]
        return len(src) if isinstance(src, bytes) else src.stat().st_size


def walk(root: Path) -> list[Path]:
    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts):
            continue
        if p.is_file() and not p.name.endswith(SKIP_SUFFIXES):
            out.append(p)
    return out


def add_sources(plan: Plan, tree: Path, version: str) -> list[str]:
    pkg = tree / "vllm"
    if not (pkg / "__init__.py").is_file():
        raise StackError(
            f"{tree} has no vllm/__init__.py: run 'hybrid-stack apply' first, or pass "
            "--work with an applied tree"
        )
    for p in walk(pkg):
        plan.add(f"src/{p.relative_to(tree).as_posix()}", p)
    for arc, stub in STUBS.items():
        plan.add(f"src/{arc}", DATA_DIR / stub)
    shims = [*(f"src/{a}" for a in STUBS)]
    for rel, pattern, new in SHIMS:
        arc = f"src/{rel}"
        src = plan.files.get(arc)
        if not isinstance(src, Path):
            raise StackError(f"{tree / rel} is missing: the bundle's shim cannot apply")
        text, n = pattern.subn(new, src.read_text())
        if n != 1:
            raise StackError(
                f"the bundle's shim for {rel} no longer matches the tree (found {n} "
                "times): update SHIMS in hybrid_stack/bundle.py"
            )
        plan.add(arc, text.encode())
        shims.append(arc)
    dist = f"src/vllm-{version}.dist-info"
    plan.add(
        f"{dist}/METADATA",
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: vLLM Python sources packed by hybrid-stack bundle (no compiled "
        "extensions)\n".encode(),
    )
    plan.add(f"{dist}/INSTALLER", b"hybrid-stack-bundle\n")
    plan.add(f"{dist}/top_level.txt", b"vllm\n")
    return shims


def test_file(tree: Path, test_id: str, owner: str) -> str:
    rel = test_id.split("::")[0]
    if not (tree / rel).is_file():
        raise StackError(
            f"{owner} names {test_id}, but {tree / rel} does not exist (fix the "
            "series' gpu_tests or re-apply the stack)"
        )
    return rel


def add_tests(plan: Plan, tree: Path, stack: stack_mod.Stack) -> dict[str, list[str]]:
    wanted: list[str] = []
    for d in TEST_DIRS:
        if (tree / d).is_dir():
            wanted += [p.relative_to(tree).as_posix() for p in walk(tree / d)]
    for f in TEST_FILES:
        wanted.append(test_file(tree, f, "the bundle's TEST_FILES"))
    entry_tests: dict[str, list[str]] = {}
    for e in stack.entries:
        entry_tests[e.name] = list(e.gpu_tests)
        for t in e.gpu_tests:
            wanted.append(test_file(tree, t, f"entry '{e.name}' gpu_tests"))
    # helpers imported as tests.x.y, transitively; package __init__ chains
    todo, seen = list(dict.fromkeys(wanted)), set()
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        if rel.endswith(".py"):
            for mod in TESTS_IMPORT.findall((tree / rel).read_text(errors="replace")):
                base = mod.replace(".", "/")
                for cand in (f"{base}.py", f"{base}/__init__.py"):
                    if (tree / cand).is_file():
                        todo.append(cand)
        parent = Path(rel).parent
        while parent.parts:
            for name in ("__init__.py", "conftest.py"):
                cand = (parent / name).as_posix()
                if cand != "tests/conftest.py" and (tree / cand).is_file():
                    todo.append(cand)
            parent = parent.parent
    for rel in sorted(seen):
        plan.add(rel, tree / rel)
    plan.add("tests/conftest.py", DATA_DIR / "conftest.py")

    def tests_in(files: list[str]) -> list[str]:
        return sorted({f for f in files if Path(f).name.startswith("test_")})

    carried = [t for e in stack.carried for t in e.gpu_tests]
    full = tests_in([f for f in seen if f.endswith(".py")]) + carried
    selections = {
        "quick": [t for t in QUICK if t in seen],
        "mamba-kernels": [t for t in MAMBA_KERNELS if t in seen],
        "full": sorted(set(full)),
    }
    for name, ids in entry_tests.items():
        if name in selections:
            raise StackError(f"entry name '{name}' clashes with a bundle selection")
        selections[name] = ids
    return selections


def op_schemas(text: str) -> dict[str, dict[str, str]]:
    """namespace -> {op -> schema} of the ``<lib>.def("...")`` calls in a csrc
    bindings file (adjacent string literals joined, as C++ does)."""
    out: dict[str, dict[str, str]] = {}
    heads = list(LIBRARY_BLOCK.finditer(text))
    for i, head in enumerate(heads):
        ns, var = head.group(1), head.group(2)
        body = text[head.end() : heads[i + 1].start() if i + 1 < len(heads) else len(text)]
        for d in re.finditer(rf"\b{var}\.def\(\s*((?:{C_STRING.pattern}\s*)+)", body):
            schema = "".join(C_STRING.findall(d.group(1)))
            out.setdefault(ns, {})[schema.split("(", 1)[0].strip()] = schema
    return out


def shim_names(path: Path) -> list[str]:
    """The op names of compiled_ops.py's IMPLEMENTED and LOOKUP_ONLY tables."""
    names: list[str] = []
    for node in ast.parse(path.read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id in ("IMPLEMENTED", "LOOKUP_ONLY"):
            assert isinstance(node.value, ast.Dict)
            names += [k.value for k in node.value.keys if isinstance(k, ast.Constant)]
    return names


def e2e_op_schemas(tree: Path) -> bytes:
    """op_schemas.json for the harness: the tree's ``_C`` schemas, after checking
    that every shimmed op exists there and none is one vLLM probes with
    ``hasattr`` (defining it would switch vLLM onto its compiled path)."""
    bindings = tree / CSRC_BINDINGS
    if not bindings.is_file():
        raise StackError(f"{bindings} is missing: the e2e harness takes op schemas from it")
    schemas = op_schemas(bindings.read_text())
    names = shim_names(E2E_DIR / "compiled_ops.py")
    missing = [n for n in names if n not in schemas.get("_C", {})]
    if missing:
        raise StackError(
            f"e2e/compiled_ops.py shims {', '.join(missing)}, which {CSRC_BINDINGS} does "
            "not define in _C: drop them from compiled_ops.py"
        )
    probed = {
        (ns, op)
        for p in walk(tree / "vllm")
        if p.suffix == ".py"
        for ns, op in HASATTR_OP.findall(p.read_text(errors="replace"))
    }
    clash = sorted(n for n in names if ("_C", n) in probed)
    if clash:
        raise StackError(
            f"e2e/compiled_ops.py defines {', '.join(clash)}, which vLLM probes with "
            "hasattr(torch.ops._C, ...) to pick its compiled path: drop them"
        )
    return (json.dumps(schemas, indent=1, sort_keys=True) + "\n").encode()


def add_e2e(plan: Plan, tree: Path) -> list[str]:
    """The harness files; returns the model names."""
    for p in walk(E2E_DIR):
        plan.add(f"e2e/{p.relative_to(E2E_DIR).as_posix()}", p)
    plan.add("e2e/op_schemas.json", e2e_op_schemas(tree))
    return sorted(p.parent.name for p in (E2E_DIR / "models").glob("*/config.json"))


def git_head(path: Path) -> str:
    """HEAD of the repository at ``path``, or "" where there is none."""
    return Repo(path).run("rev-parse", "HEAD", check=False) if path.is_dir() else ""


def build_plan(
    stack: stack_mod.Stack, tree: Path, wheels: list[Wheel], name: str
) -> tuple[Plan, dict]:
    plan = Plan()
    shims = add_sources(plan, tree, stack.pin.version)
    selections = add_tests(plan, tree, stack)
    e2e_models = add_e2e(plan, tree)
    for name, ids in E2E_SELECTIONS.items():
        selections[name] = ids
    names = benches(stack)
    for b in ("__init__", "common", *names):
        plan.add(f"bench/{b}.py", BENCH_DIR / f"{b}.py")
    for w in wheels:
        plan.add(f"wheels/{w.path.name}", w.path)
    plan.add("run.py", DATA_DIR / "run.py")
    plan.add("hybrid_stack_shard.py", DATA_DIR / "hybrid_stack_shard.py")
    plan.add("hybrid_stack_failnow.py", DATA_DIR / "hybrid_stack_failnow.py")
    plan.add("pytest.ini", b"[pytest]\n# rootdir of the hybrid-stack GPU bundle\n")
    manifest = {
        "name": name,
        "vllm_version": stack.pin.version,
        "python": wheels_python(wheels),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "stack": {"root": git_head(stack.root), "tree": git_head(tree)},
        "selections": selections,
        "benches": names,
        "e2e_models": e2e_models,
        "serial_selections": sorted(E2E_SELECTIONS),
        "wheels": [w.path.name for w in wheels],
        "stubs": shims,
    }
    plan.add("manifest.json", (json.dumps(manifest, indent=1) + "\n").encode())
    return plan, manifest


def wheels_python(wheels: list[Wheel]) -> str:
    for w in wheels:
        for t in w.pytags:
            if t.startswith("cp3") and "abi3" not in w.abitags:
                return f"3.{t[3:]}"
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def write_tar(plan: Plan, path: Path, top: str) -> None:
    tmp = path.with_suffix(".tmp")
    try:
        _write_tar(plan, tmp, top)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(path)


def _write_tar(plan: Plan, tmp: Path, top: str) -> None:
    with tarfile.open(tmp, "w:gz", compresslevel=6) as tar:
        for arc in sorted(plan.files):
            src = plan.files[arc]
            data = src if isinstance(src, bytes) else src.read_bytes()
            info = tarfile.TarInfo(f"{top}/{arc}")
            info.size = len(data)
            info.mode = 0o755 if arc == "run.py" else 0o644
            info.mtime = int(time.time())
            tar.addfile(info, io.BytesIO(data))


def output_paths(out: Path, name: str) -> tuple[Path, Path]:
    """(tarball, listing) for ``--out``: a folder, or the tarball itself."""
    for suffix in (".tar.gz", ".tgz"):
        if out.name.endswith(suffix) and len(out.name) > len(suffix):
            stem = out.name[: -len(suffix)]
            return out, out.with_name(f"{stem}.listing.txt")
    return out / f"{name}.tar.gz", out / f"{name}.listing.txt"


def section(arc: str) -> str:
    head = arc.split("/", 1)[0]
    return "vllm sources" if head == "src" else head if "/" in arc else "runner"


def run(args: argparse.Namespace) -> int:
    stack = stack_mod.load_stack(args.root)
    tree = (args.work or stack.default_work).resolve()
    out = (args.out or stack.root / "work" / "bundle").resolve()
    if not tree.is_dir():
        raise StackError(f"no applied tree at {tree}: run 'hybrid-stack apply' first")
    if "/" in args.name or not args.name:
        raise StackError(f"--name must be a plain file name, not {args.name!r}")
    wheels = collect_wheels(args.python_version, args.platform, args.wheel_dir)
    plan, manifest = build_plan(stack, tree, wheels, args.name)
    tarball, listing = output_paths(out, args.name)
    try:
        tarball.parent.mkdir(parents=True, exist_ok=True)
        write_tar(plan, tarball, args.name)
    except OSError as e:
        raise StackError(
            f"cannot write the bundle to {tarball}: {e.strerror or e}: pass --out a "
            "writable folder or .tar.gz path"
        ) from None
    size = tarball.stat().st_size
    sections: dict[str, list[int]] = {}
    for arc in plan.files:
        s = sections.setdefault(section(arc), [0, 0])
        s[0] += 1
        s[1] += plan.size(arc)
    lines = [
        f"# {tarball.name}: {size / 2**20:.1f} MiB compressed, {len(plan.files)} files",
        f"# vLLM {manifest['vllm_version']} from {tree}; wheels for Python "
        f"{manifest['python']} / {args.platform}",
        *(f"# {k}: {n} files, {b / 2**20:.1f} MiB" for k, (n, b) in sorted(sections.items())),
        *(f"# selection {k}: {len(v)} test id(s)" for k, v in manifest["selections"].items()),
        *(f"{plan.size(a):>10}  {a}" for a in sorted(plan.files)),
    ]
    listing.write_text("\n".join(lines) + "\n")
    if size > args.max_size_mib * 2**20:
        tarball.unlink()
        raise StackError(
            f"the bundle is {size / 2**20:.1f} MiB, over the {args.max_size_mib:g} MiB "
            f"limit (--max-size-mib); see {listing} for what is in it"
        )
    print("\n".join(lines[: 2 + len(sections) + len(manifest["selections"])]))
    print(f"bundle: wrote {tarball} ({size / 2**20:.1f} MiB) and {listing}")
    print(
        f"on the GPU machine: tar xzf {tarball.name} && cd {args.name} && "
        "python3 run.py quick --bench all --out results"
    )
    if args.triton:
        write_triton(args, tarball.parent, manifest["python"])
    if args.flashinfer:
        write_flashinfer(args, tarball.parent, manifest["python"], tree)
    return 0


def write_triton(args: argparse.Namespace, folder: Path, python: str) -> None:
    wheel = tritonpack.fetch_wheel(args.triton, python, platform_tags(args.platform))
    out = folder / f"triton-{args.triton}"
    pack = tritonpack.write_pack(wheel, out, args.triton_part_mib)
    sizes = ", ".join(f"{p['size'] / 2**20:.1f}" for p in pack["parts"])
    print(
        f"bundle: Triton {args.triton} for Python {pack['python']} in {out}: "
        f"{len(pack['parts'])} part(s) of {sizes} MiB (from {pack['wheel']['name']}, "
        f"{len(pack['dropped'])} profiling files left out, debug info stripped from "
        f"{len(pack['debug_stripped'])} libraries)"
    )
    print(
        f"on the GPU machine: python3 run.py --triton DIR ... with DIR holding "
        f"{tritonpack.INDEX_NAME} and the parts; parts can arrive over several calls "
        "(run.py --triton DIR --stage keeps them until all are there)"
    )


def write_flashinfer(args: argparse.Namespace, folder: Path, python: str, tree: Path) -> None:
    version = fipack.pinned_version(tree) if args.flashinfer == PINNED else args.flashinfer
    wheels = fipack.fetch_wheels(version, python, platform_tags(args.platform))
    out = folder / f"flashinfer-{version}"
    pack = fipack.write_pack(version, wheels, out, python, args.triton_part_mib)
    total = sum(p["size"] for p in pack["parts"])
    sizes = ", ".join(f"{p['size'] / 2**20:.1f}" for p in pack["parts"])
    print(
        f"bundle: FlashInfer {version} for Python {python} in {out}: {len(pack['wheels'])} "
        f"wheel(s), {total / 2**20:.1f} MiB in {len(pack['parts'])} part(s) of {sizes} MiB"
    )
    print(
        f"on the GPU machine: python3 run.py --flashinfer DIR --stage per call with DIR "
        f"holding {fipack.INDEX_NAME} and the parts carried, then python3 run.py "
        "--flashinfer DIR ... --e2e-arg=--gdn-prefill-backend=flashinfer"
    )
