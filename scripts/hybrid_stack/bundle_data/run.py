# SPDX-License-Identifier: Apache-2.0
"""Run the hybrid-stack GPU bundle: kernel tests and benchmarks, offline.

Unpack the bundle on a machine with a CUDA GPU, torch and triton, then:

    python run.py --list                      # selections and benchmarks
    python run.py quick                       # the few-minute kernel test selection
    python run.py full --bench all --out res  # every bundled test, all benchmarks
    python run.py <entry-name> tests/kernels/mamba/test_x.py::test_y -n 4
    python run.py <entry-name> --shard 1/2    # half its tests (then --shard 2/2)
    python run.py --e2e all --out res         # the engine end to end (e2e/harness.py)
    python run.py --e2e tiny-qwen3.5 --e2e-arg=--suite=identity
    eval "$(python run.py --env)"             # the same imports for your own scripts,
    ncu ... python3 my_probe.py               # profilers, notebooks (no CUDA check)
    python run.py --triton T --stage          # keep the Triton parts carried so far
    python run.py --triton T quick            # ... then run under that Triton release
    python run.py --flashinfer F --stage      # keep the FlashInfer parts carried so far
    python run.py --flashinfer F --e2e qwen3.5-9b-like --e2e-arg=--gdn-prefill-backend=flashinfer

The runner installs the bundled wheels into a private folder (no network, no
root; ``--site``), puts that folder, the bundled ``src/`` (the patched vLLM
sources, stubs for compiled extensions and a vllm dist-info) and the bundle root
on the import path, runs pytest (with pytest-xdist workers sharing the one GPU
when xdist is there) and the chosen benchmarks, writes JSON and logs to
``--out``, and prints a summary table last. It uses the standard library only.

``--triton DIR`` runs everything under another Triton release than the
machine's: DIR holds the ``triton-pack.json`` and parts that ``hybrid-stack
bundle --triton VERSION`` wrote. Parts may arrive over several calls of one
machine: each part found is checked against its sha256 and kept in
``--triton-stash``; once all are there, the archive's sha256 is checked and it
is unpacked into a folder that goes first on the import path.

``--flashinfer DIR`` puts FlashInfer and the CuTe DSL its GDN prefill needs on
the import path (vLLM's default GDN prefill on Hopper; the engine takes it with
``--e2e-arg=--gdn-prefill-backend=flashinfer`` or ``auto``): DIR holds the
``flashinfer-pack.json`` and parts that ``hybrid-stack bundle --flashinfer``
wrote, staged over calls in ``--flashinfer-stash`` as the Triton parts are
(``--stage`` keeps both); once all are there, each wheel is cut from the
joined parts, checked against its sha256 and unpacked into a private folder.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import io
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _load_plugin(name: str) -> Any:
    """A pytest plugin module next to this file (stdlib only at import)."""
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


hybrid_stack_shard = _load_plugin("hybrid_stack_shard")
MANIFEST = HERE / "manifest.json"
EXIT_NO_CUDA = 3
EXIT_USAGE = 2


class RunError(Exception):
    """A one-line user error."""


def load_manifest() -> dict[str, Any]:
    try:
        return json.loads(MANIFEST.read_text())
    except FileNotFoundError:
        raise RunError(f"{MANIFEST} is missing: run.py must sit in an unpacked bundle") from None


def resolve(manifest: dict[str, Any], names: list[str]) -> list[tuple[str, list[str]]]:
    """Selection names / bundled test paths -> [(label, pytest ids)]: a step per
    selection name, and one step, where the first of them stands, for all the
    test paths (one pytest run: a run per id would pay pytest's and the
    workers' start-up, and each id's Triton compiles, once per id)."""
    sels = manifest["selections"]
    out: list[tuple[str, list[str]]] = []
    ids: list[str] = []
    for name in names:
        if name in sels:
            out.append((name, list(sels[name])))
        elif (HERE / name.split("::")[0]).is_file():
            if not ids:
                out.append(("", ids))
            ids.append(name)
        else:
            raise RunError(
                f"unknown selection '{name}': use one of {', '.join(sels)} or a test "
                "path inside the bundle (python run.py --list)"
            )
    label = ids[0] if len(ids) == 1 else f"{ids[0] if ids else ''} and {len(ids) - 1} more"
    return [(name or label, sel) for name, sel in out]


def check_python(manifest: dict[str, Any]) -> None:
    want = manifest["python"]
    have = f"{sys.version_info.major}.{sys.version_info.minor}"
    if have != want:
        raise RunError(
            f"this bundle's wheels are for Python {want}, this is Python {have}: "
            f"run it with python{want}, or rebuild it with "
            f"'hybrid-stack bundle --python-version {have}'"
        )


def cuda_facts() -> dict[str, Any]:
    """torch / triton / GPU facts; raises RunError when no CUDA device is visible."""
    try:
        import torch
    except ImportError as e:
        raise RunError(f"no CUDA device usable: torch does not import ({e})") from None
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise RunError(
            "no CUDA device is visible (torch "
            f"{torch.__version__}, CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!s}): this bundle only "
            "runs GPU kernel tests and benchmarks; run it on a machine with a GPU"
        )
    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
    }
    try:
        import triton

        facts["triton"] = triton.__version__
    except ImportError:
        facts["triton"] = None
    smi = shutil.which("nvidia-smi")
    if smi:
        q = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        )
        facts["driver"] = q.stdout.strip().splitlines()[0] if q.stdout.strip() else None
    return facts


def unpack_wheel(whl: Path, site: Path) -> None:
    """Unpack one wheel into ``site`` (what pip --target does, offline)."""
    with zipfile.ZipFile(whl) as zf:
        for info in zf.infolist():
            parts = info.filename.split("/")
            # <name>.data/{purelib,platlib}/... goes to the root; scripts,
            # headers and data are not needed to import.
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            target = site.joinpath(*parts)
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                target.chmod(mode | 0o600)


def install_wheels(manifest: dict[str, Any], site: Path) -> list[str]:
    """Unpack the bundled wheels into ``site`` (what pip --target does, offline)."""
    site.mkdir(parents=True, exist_ok=True)
    stamp = site / ".hybrid-stack-installed"
    wheels = sorted(manifest["wheels"])
    if stamp.is_file() and stamp.read_text().split() == wheels:
        return wheels
    for name in wheels:
        unpack_wheel(HERE / "wheels" / name, site)
    stamp.write_text("\n".join(wheels) + "\n")
    return wheels


TRITON_INDEX = "triton-pack.json"
TRITON_FORMAT = "hybrid-stack-triton-pack/1"
TRITON_STAMP = ".hybrid-stack-triton"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


FI_INDEX = "flashinfer-pack.json"
FI_FORMAT = "hybrid-stack-flashinfer-pack/1"
FI_STAMP = ".hybrid-stack-flashinfer"


def stage_pack(
    folder: Path, stash: Path, index_name: str, fmt: str, flag: str
) -> tuple[dict[str, Any], list[str]]:
    """Keep the parts of the pack (``index_name``, format ``fmt``) found in
    ``folder`` in ``stash``, each checked against its sha256; returns the pack
    and the parts still missing. ``flag``: the bundle option that wrote it."""
    index = folder / index_name
    try:
        pack = json.loads(index.read_text())
    except (OSError, ValueError) as e:
        raise RunError(
            f"no readable {index_name} in {folder} ({e}): pass the folder "
            f"'hybrid-stack bundle {flag}' wrote"
        ) from None
    if pack.get("format") != fmt:
        raise RunError(f"{index} is not a {fmt} pack: rebuild it with this bundle")
    stash.mkdir(parents=True, exist_ok=True)
    missing = []
    for part in pack["parts"]:
        kept = stash / part["sha256"]
        if kept.is_file() and sha256_of(kept) == part["sha256"]:
            continue
        src = folder / part["name"]
        if not src.is_file():
            missing.append(part["name"])
            continue
        got = sha256_of(src)
        if got != part["sha256"]:
            raise RunError(
                f"{src}: sha256 {got[:16]}... is not the pack's {part['sha256'][:16]}...: "
                "damaged or from another pack; carry it again"
            )
        tmp = kept.with_name(f"{kept.name}.tmp{os.getpid()}")
        shutil.copyfile(src, tmp)
        tmp.replace(kept)
    return pack, missing


def stage_triton(folder: Path, stash: Path) -> tuple[dict[str, Any], list[str]]:
    """The Triton pack's parts in ``folder``, staged (stage_pack)."""
    return stage_pack(folder, stash, TRITON_INDEX, TRITON_FORMAT, "--triton VERSION")


def stage_flashinfer(folder: Path, stash: Path) -> tuple[dict[str, Any], list[str]]:
    """The FlashInfer pack's parts in ``folder``, staged (stage_pack)."""
    return stage_pack(folder, stash, FI_INDEX, FI_FORMAT, "--flashinfer")


class _Parts(io.RawIOBase):
    """The stashed parts, read as one file."""

    def __init__(self, paths: list[Path]) -> None:
        self._paths = list(paths)
        self._file: Any = None

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        while self._file is not None or self._paths:
            if self._file is None:
                self._file = self._paths.pop(0).open("rb")
            n = self._file.readinto(buf)
            if n:
                return n
            self._file.close()
            self._file = None
        return 0

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        super().close()


def install_triton(pack: dict[str, Any], stash: Path, site: Path) -> Path:
    """Unpack the complete, verified pack beside ``site``; returns its folder."""
    check_pack_python(pack, "Triton", f"--triton {pack['triton']}")
    target = site.parent / f"{site.name}-triton-{pack['triton']}"
    sha = pack["archive"]["sha256"]
    stamp = target / TRITON_STAMP
    if stamp.is_file() and stamp.read_text().strip() == sha:
        return target
    paths = [stash / p["sha256"] for p in pack["parts"]]
    h = hashlib.sha256()
    with io.BufferedReader(_Parts(paths)) as f:
        while block := f.read(1 << 20):
            h.update(block)
    if h.hexdigest() != sha:
        raise RunError(
            f"the Triton parts join to sha256 {h.hexdigest()[:16]}..., not the pack's "
            f"{sha[:16]}...: the parts are from different packs; carry them again"
        )
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with io.BufferedReader(_Parts(paths)) as f, tarfile.open(fileobj=f, mode="r|xz") as tar:
        tar.extractall(tmp, filter="data")
    (tmp / TRITON_STAMP).write_text(sha + "\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.replace(target)
    return target


def check_pack_python(pack: dict[str, Any], what: str, flag: str) -> None:
    want = f"{sys.version_info.major}.{sys.version_info.minor}"
    if pack["python"] != want:
        raise RunError(
            f"the {what} pack is for Python {pack['python']}, this is Python {want}: "
            f"rebuild it with 'hybrid-stack bundle --python-version {want} {flag}'"
        )


def install_flashinfer(pack: dict[str, Any], stash: Path, site: Path) -> list[Path]:
    """Cut the wheels out of the complete staged parts, check each against its
    sha256, unpack them into a folder beside ``site``; returns the folders to
    put on the import path (that folder and the ones its .pth files name)."""
    check_pack_python(pack, "FlashInfer", f"--flashinfer {pack['flashinfer']}")
    target = site.parent / f"{site.name}-flashinfer-{pack['flashinfer']}"
    paths = [target, *(target / p for p in pack["import_paths"])]
    digest = hashlib.sha256(" ".join(w["sha256"] for w in pack["wheels"]).encode()).hexdigest()
    stamp = target / FI_STAMP
    if stamp.is_file() and stamp.read_text().strip() == digest:
        return paths
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    wheels = tmp / ".wheels"
    wheels.mkdir(parents=True)
    parts = [stash / p["sha256"] for p in pack["parts"]]
    try:
        with io.BufferedReader(_Parts(parts)) as f:
            for w in pack["wheels"]:
                dest, h, left = wheels / w["name"], hashlib.sha256(), w["size"]
                with open(dest, "wb") as out:
                    while left and (block := f.read(min(left, 1 << 20))):
                        h.update(block)
                        out.write(block)
                        left -= len(block)
                if left or h.hexdigest() != w["sha256"]:
                    raise RunError(
                        f"{w['name']} cut from the FlashInfer parts has sha256 "
                        f"{h.hexdigest()[:16]}..., not the pack's {w['sha256'][:16]}...: the "
                        "parts are from different packs; carry them again"
                    )
            if f.read(1):
                raise RunError("the FlashInfer parts hold more than the pack's wheels: rebuild it")
        for w in pack["wheels"]:
            unpack_wheel(wheels / w["name"], tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(wheels)
    (tmp / FI_STAMP).write_text(digest + "\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.replace(target)
    return paths


def child_env(
    site: Path, triton: Path | None = None, flashinfer: list[Path] | None = None
) -> dict[str, str]:
    env = dict(os.environ)
    # FlashInfer after the bundle's wheels (it needs their apache-tvm-ffi) and
    # before the vLLM sources; a packed Triton before everything.
    paths = [str(site), *(str(p) for p in flashinfer or ()), str(HERE / "src"), str(HERE)]
    if triton is not None:
        paths.insert(0, str(triton))
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def shell_exports(env: dict[str, str]) -> str:
    """``export`` lines (POSIX shell) for what ``child_env`` adds to os.environ."""
    return "\n".join(
        f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items()) if os.environ.get(k) != v
    )


def probe_vllm(env: dict[str, str]) -> dict[str, Any]:
    code = (
        "import json, importlib.metadata as m, triton, vllm, vllm.vllm_flash_attn as fa;"
        "print(json.dumps({'vllm': m.version('vllm'), 'vllm_path': vllm.__file__,"
        "'fa2': fa.flash_attn_interface.FA2_AVAILABLE, 'triton': triton.__version__,"
        "'triton_path': triton.__file__}))"
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=HERE,
        capture_output=True,
        text=True,
        check=False,
    )
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["?"])[-1]
        raise RunError(f"the bundled vLLM does not import: {tail}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def probe_flashinfer(env: dict[str, str], paths: list[Path]) -> dict[str, Any]:
    """The FlashInfer the children import: version and path (it must be the
    packed one); importing it also imports the CuTe DSL."""
    code = (
        "import json, importlib.metadata as m, flashinfer, cutlass;"
        "print(json.dumps({'flashinfer': m.version('flashinfer-python'),"
        "'flashinfer_path': flashinfer.__file__, 'cutlass_dsl': cutlass.__file__}))"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=HERE, capture_output=True, text=True, check=False
    )
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["?"])[-1]
        raise RunError(f"the packed FlashInfer does not import: {tail}")
    got = json.loads(p.stdout.strip().splitlines()[-1])
    if not got["flashinfer_path"].startswith(str(paths[0])):
        raise RunError(
            f"FlashInfer {got['flashinfer']} ({got['flashinfer_path']}) imports ahead of "
            f"the packed one in {paths[0]}: unset what puts it first"
        )
    return got


def tee(cmd: list[str], env: dict[str, str], log: Path, timeout: float | None) -> int:
    """Run cmd, streaming its output to the console and to log; kill it after timeout s."""
    with open(log, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        p = subprocess.Popen(
            cmd,
            env=env,
            cwd=HERE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        assert p.stdout is not None
        watchdog = threading.Timer(timeout, p.kill) if timeout else None
        if watchdog:
            watchdog.start()
        try:
            for line in p.stdout:
                sys.stdout.write(line)
                f.write(line)
            rc = p.wait()
        finally:
            if watchdog:
                watchdog.cancel()
        if timeout and rc < 0:
            note = f"\n[run.py] stopped (signal {-rc}); --timeout is {timeout:.0f} s\n"
            sys.stdout.write(note)
            f.write(note)
        return rc


def parse_junit(path: Path) -> dict[str, Any]:
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failed: list[str] = []
    skips: dict[str, int] = {}
    if not path.is_file():
        return {**counts, "failed_ids": failed, "skip_reasons": skips}
    for case in ET.parse(path).getroot().iter("testcase"):
        cid = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag: child for child in case}
        if "failure" in kinds:
            counts["failed"] += 1
            failed.append(cid)
        elif "error" in kinds:
            counts["errors"] += 1
            failed.append(cid)
        elif "skipped" in kinds:
            counts["skipped"] += 1
            reason = (kinds["skipped"].get("message") or "").strip()[:120]
            skips[reason] = skips.get(reason, 0) + 1
        else:
            counts["passed"] += 1
    return {**counts, "failed_ids": failed, "skip_reasons": skips}


LOG_RESULT = re.compile(
    r"(?:\[gw\d+\] \[ *\d+%\] (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+::\S+))"
    r"|(?:^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b)"
)
LOG_KIND = {"PASSED": "passed", "XFAIL": "passed", "XPASS": "passed", "FAILED": "failed"}
LOG_KIND |= {"ERROR": "errors", "SKIPPED": "skipped"}


def parse_log(path: Path) -> dict[str, Any]:
    """Counts from pytest -v's per-test lines (with or without xdist), for a
    run stopped before it wrote its junit report: each test's last status."""
    last: dict[str, str] = {}
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            m = LOG_RESULT.search(line)
            if m:
                status, tid = (m[1], m[2]) if m[1] else (m[4], m[3])
                last[tid] = status
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for status in last.values():
        counts[LOG_KIND[status]] += 1
    failed = [t for t, st in last.items() if st in ("FAILED", "ERROR")]
    return {**counts, "failed_ids": failed, "skip_reasons": {}, "finished": len(last)}


def worker_threads(env: dict[str, str], workers: int, cores: int | None = None) -> dict[str, str]:
    """Env for ``workers`` pytest-xdist processes sharing ``cores`` CPU cores.

    torch runs CPU ops on as many OpenMP threads as there are cores, so
    several workers at that count oversubscribe the cores, and spinning
    OpenMP threads then stall the kernel tests' CPU references (float64
    recurrences, a few small ops per token). Each worker gets its share of
    the cores unless the caller set OMP_NUM_THREADS."""
    if "OMP_NUM_THREADS" in env:
        return env
    cores = cores or len(os.sched_getaffinity(0))
    return dict(env, OMP_NUM_THREADS=str(max(1, cores // workers)))


def have_xdist(env: dict[str, str]) -> bool:
    p = subprocess.run(
        [sys.executable, "-c", "import xdist"], env=env, capture_output=True, check=False
    )
    return p.returncode == 0


def run_tests(
    label: str, ids: list[str], args: argparse.Namespace, env: dict[str, str]
) -> dict[str, Any]:
    shard = getattr(args, "shard", None)
    if shard:
        label = f"{label} [shard {shard}]"
        env = dict(env, **{hybrid_stack_shard.ENV: shard})
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)[:80]
    junit = args.out / f"junit-{safe}.xml"
    log = args.out / f"pytest-{safe}.log"
    res: dict[str, Any] = {"selection": label, "tests": ids, "log": str(log)}
    if not ids:
        res.update(rc=None, note="no tests in this selection", seconds=0.0)
        return res
    # -v: a line per finished test, so a run stopped by --timeout still tells
    # what finished (parse_log); -q's progress dots have no newline to stream
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-rfEs"]
    cmd += ["-p", "hybrid_stack_failnow"]
    cmd.append("--continue-on-collection-errors")
    cmd += [f"--junitxml={junit}", "-o", "junit_family=xunit2"]
    if shard:
        cmd += ["-p", "hybrid_stack_shard"]
    workers = 1 if label in getattr(args, "serial", ()) else args.workers
    if workers > 1 and have_xdist(env):
        cmd += ["-n", str(workers)]
        env = worker_threads(env, workers)
    elif workers > 1:
        res["note"] = "pytest-xdist not importable: ran in one process"
    if args.k:
        cmd += ["-k", args.k]
    cmd += args.pytest_arg + ids
    print(f"\n=== pytest: {label} ({len(ids)} id(s)) ===", flush=True)
    start = time.monotonic()
    rc = tee(cmd, env, log, args.timeout)
    res["seconds"] = round(time.monotonic() - start, 1)
    res["rc"] = rc
    if junit.is_file():
        res.update(parse_junit(junit))
    else:  # stopped before pytest wrote its report
        res.update(parse_log(log))
        stopped = (
            f"no junit report (rc {rc}): counts are the {res['finished']} test(s) "
            "the log shows finished"
        )
        res["note"] = "; ".join(n for n in (res.get("note"), stopped) if n)
    return res


def run_bench(
    name: str, args: argparse.Namespace, env: dict[str, str], command: str
) -> dict[str, Any]:
    script = HERE / "bench" / f"{name}.py"
    log = args.out / f"bench-{name}.log"
    cmd = [sys.executable, str(script), "--out", str(args.out)]
    if args.bench_quick:
        cmd.append("--quick")
    cmd += args.bench_arg
    benv = dict(env, HYBRID_STACK_BENCH_COMMAND=command)
    print(f"\n=== benchmark: {name} ===", flush=True)
    start = time.monotonic()
    rc = tee(cmd, benv, log, args.timeout)
    res: dict[str, Any] = {
        "bench": name,
        "rc": rc,
        "seconds": round(time.monotonic() - start, 1),
        "log": str(log),
    }
    # <name>-<gpu>.json, or <name>_<mode>-<gpu>.json (ssd_prefill's A/B mode)
    found = sorted(args.out.glob(f"{name}-*.json")) or sorted(args.out.glob(f"{name}_*-*.json"))
    if found:
        data = json.loads(found[-1].read_text())
        res["json"] = str(found[-1])
        res["rows"] = len(data.get("rows", []))
        ratios = [r["ratio"] for r in data.get("rows", []) if r.get("ratio") == r.get("ratio")]
        res["min_ratio"] = min(ratios) if ratios else None
    return res


def run_e2e(
    models: list[str], args: argparse.Namespace, env: dict[str, str], command: str
) -> dict[str, Any]:
    """e2e/harness.py once per model (a process each, so one model's failure
    leaves the others' results), then its --merge into e2e-<gpu>.json / .md."""
    harness = HERE / "e2e" / "harness.py"
    eenv = dict(env, HYBRID_STACK_BENCH_COMMAND=command)
    res: dict[str, Any] = {"models": [], "rc": 0}
    for model in models:
        cmd = [sys.executable, str(harness), "--model", model, "--out", str(args.out)]
        cmd += args.e2e_arg
        print(f"\n=== end to end: {model} ===", flush=True)
        start = time.monotonic()
        rc = tee(cmd, eenv, args.out / f"e2e-{model}.log", args.timeout)
        res["models"].append(
            {"model": model, "rc": rc, "seconds": round(time.monotonic() - start, 1)}
        )
        res["rc"] = res["rc"] or rc
    # A named plan (--e2e-arg=--plan=allmode) names the result too.
    plans = [a for a in args.e2e_arg if a.startswith("--plan=")]
    merge = [sys.executable, str(harness), "--merge", "--out", str(args.out), *plans]
    res["merge_rc"] = tee(merge, eenv, args.out / "e2e-merge.log", args.timeout)
    found = sorted(args.out.glob("e2e-*.json"))
    found = [f for f in found if "-part-" not in f.name]
    if found:
        res["json"] = str(found[-1])
    return res


def print_summary(summary: dict[str, Any]) -> None:
    env = summary["env"]
    print("\n" + "=" * 78)
    print(
        f"hybrid-stack bundle {summary['bundle']['name']} (vLLM "
        f"{env.get('vllm')}) on {', '.join(env.get('gpus', []))}: torch "
        f"{env.get('torch')}, triton {env.get('triton')}, CUDA {env.get('cuda')}, "
        f"driver {env.get('driver')}, Python {env.get('python')}"
        + (
            f", FlashInfer {env['flashinfer']} ({env['flashinfer_path']})"
            if env.get("flashinfer")
            else ""
        )
    )
    if summary["tests"]:
        head = ("selection", "passed", "failed", "errors", "skipped", "seconds", "rc")
        rows = [
            (
                t["selection"][:40],
                *(str(t.get(k, "-")) for k in ("passed", "failed", "errors", "skipped")),
                str(t.get("seconds", "-")),
                str(t.get("rc", "-")),
            )
            for t in summary["tests"]
        ]
        w = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        print("  ".join(h.ljust(w[i]) for i, h in enumerate(head)))
        for r in rows:
            print("  ".join(c.ljust(w[i]) for i, c in enumerate(r)))
        for t in summary["tests"]:
            for reason, n in t.get("skip_reasons", {}).items():
                print(f"  skipped {n:4d} x [{t['selection']}] {reason}")
            for fid in t.get("failed_ids", [])[:10]:
                print(f"  FAILED [{t['selection']}] {fid}")
            if t.get("note"):
                print(f"  note [{t['selection']}]: {t['note']}")
    for b in summary["benches"]:
        print(
            f"bench {b['bench']:<14} rc {b['rc']}  {b['seconds']:7.1f} s  rows "
            f"{b.get('rows', '-')}  {b.get('json', 'no JSON written')}"
        )
    e2e = summary.get("e2e")
    if e2e:
        for m in e2e["models"]:
            print(f"e2e {m['model']:<20} rc {m['rc']}  {m['seconds']:7.1f} s")
        print(f"e2e merge rc {e2e['merge_rc']}  {e2e.get('json', 'no JSON written')}")
    print(f"overall: {'OK' if summary['ok'] else 'FAILED'}; details in {summary['out']}")


def shard_arg(value: str) -> str:
    try:
        hybrid_stack_shard.parse(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run the hybrid-stack GPU bundle's kernel tests and benchmarks."
    )
    parser.add_argument(
        "selections",
        nargs="*",
        help="selection names (quick, full, an entry name) or bundled test ids; "
        "default: quick unless only --bench is given",
    )
    parser.add_argument("--bench", action="append", default=[], help="benchmark name or 'all'")
    parser.add_argument("--bench-quick", action="store_true", help="benchmarks' smoke mode")
    parser.add_argument(
        "--bench-arg",
        action="append",
        default=[],
        help="extra benchmark argument, e.g. --bench-arg=--cases=mamba2-2.7b:16k:1 "
        "or --bench-arg=--variant=NAME=PATH (ssd_prefill's A/B mode)",
    )
    parser.add_argument(
        "--e2e",
        action="append",
        default=[],
        help="serve a model end to end through the engine ('all' or a name from --list)",
    )
    parser.add_argument(
        "--e2e-arg",
        action="append",
        default=[],
        help="extra e2e/harness.py argument, e.g. --e2e-arg=--suite=identity",
    )
    parser.add_argument("--out", type=Path, default=Path("bundle-results"))
    parser.add_argument("-n", "--workers", type=int, default=8, help="pytest-xdist workers")
    parser.add_argument("-k", help="pytest -k expression")
    parser.add_argument("--pytest-arg", action="append", default=[], help="extra pytest argument")
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds per step; a test step stopped by it still reports the tests "
        "that finished (use it rather than an outer timeout, which loses them)",
    )
    parser.add_argument(
        "--shard",
        type=shard_arg,
        default=None,
        help="I/N: run the I-th of N interleaved parts of each selection's tests "
        "(collection order), to split a selection over calls with a time limit",
    )
    parser.add_argument("--site", type=Path, default=HERE / ".site", help="private install folder")
    parser.add_argument(
        "--triton",
        type=Path,
        metavar="DIR",
        help="run under the Triton release packed in DIR (hybrid-stack bundle --triton)",
    )
    parser.add_argument(
        "--triton-stash",
        type=Path,
        default=Path.home() / ".cache" / "hybrid-stack-triton",
        help="where Triton parts are kept between calls (default: %(default)s)",
    )
    parser.add_argument(
        "--flashinfer",
        type=Path,
        metavar="DIR",
        help="put the FlashInfer packed in DIR on the import path (hybrid-stack bundle "
        "--flashinfer); the engine uses it with --e2e-arg=--gdn-prefill-backend=flashinfer",
    )
    parser.add_argument(
        "--flashinfer-stash",
        type=Path,
        default=Path.home() / ".cache" / "hybrid-stack-flashinfer",
        help="where FlashInfer parts are kept between calls (default: %(default)s)",
    )
    parser.add_argument(
        "--stage",
        action="store_true",
        help="with --triton / --flashinfer: keep the parts found, say which are missing, "
        "run nothing",
    )
    parser.add_argument("--list", action="store_true", help="list selections, benchmarks")
    parser.add_argument(
        "--env",
        action="store_true",
        help="install the wheels, print the shell exports that put the bundle on the "
        "import path (for your own scripts and profilers), and exit",
    )
    args = parser.parse_args(argv)
    command = shlex.join(["python", "run.py", *(sys.argv[1:] if argv is None else argv)])
    try:
        triton, flashinfer, staged = None, None, []
        triton_pack: dict[str, Any] = {}
        packs = (
            ("Triton", "triton", args.triton, args.triton_stash, stage_triton),
            ("FlashInfer", "flashinfer", args.flashinfer, args.flashinfer_stash, stage_flashinfer),
        )
        for what, key, folder, stash_arg, stage in packs:
            if folder is None:
                continue
            stash = stash_arg.resolve()
            pack, missing = stage(folder.resolve(), stash)
            have = len(pack["parts"]) - len(missing)
            staged.append((what, key, pack, missing, have, stash))
        if args.stage:
            if not staged:
                raise RunError(
                    "--stage keeps pack parts: it needs --triton DIR or --flashinfer DIR"
                )
            for what, key, pack, missing, have, stash in staged:
                print(
                    f"{what} {pack[key]}: {have} of {len(pack['parts'])} part(s) kept "
                    f"in {stash}" + (f"; still missing: {', '.join(missing)}" if missing else "")
                )
            return 0
        for what, key, pack, missing, have, stash in staged:
            if missing:
                raise RunError(
                    f"{what} {pack[key]}: missing part(s) {', '.join(missing)} (the "
                    f"{have} found are kept in {stash} for the next call of this machine)"
                )
            if key == "triton":
                triton = install_triton(pack, stash, args.site.resolve())
                triton_pack = pack
            else:
                flashinfer = install_flashinfer(pack, stash, args.site.resolve())
        manifest = load_manifest()
        if args.env:
            check_python(manifest)
            site = args.site.resolve()
            install_wheels(manifest, site)
            env = child_env(site, triton, flashinfer)
            if flashinfer is not None:
                fi = probe_flashinfer(env, flashinfer)
                print(f"# FlashInfer {fi['flashinfer']} at {fi['flashinfer_path']}")
            print(shell_exports(env))
            return 0
        if args.list:
            for name, ids in manifest["selections"].items():
                print(f"{name}: {len(ids)} test id(s)")
                for i in ids:
                    print(f"    {i}")
            print("benchmarks: " + ", ".join(manifest["benches"]))
            print("end-to-end models: " + ", ".join(manifest["e2e_models"]))
            return 0
        benches = manifest["benches"] if "all" in args.bench else args.bench
        for b in benches:
            if b not in manifest["benches"]:
                raise RunError(
                    f"unknown benchmark '{b}': use one of {', '.join(manifest['benches'])} or all"
                )
        e2e = manifest["e2e_models"] if "all" in args.e2e else args.e2e
        for m in e2e:
            if m not in manifest["e2e_models"]:
                raise RunError(
                    f"unknown end-to-end model '{m}': use one of "
                    f"{', '.join(manifest['e2e_models'])} or all"
                )
        args.serial = set(manifest["serial_selections"])
        names = args.selections or ([] if benches or e2e else ["quick"])
        selected = resolve(manifest, names)
        facts = cuda_facts()
        check_python(manifest)
        args.out = args.out.resolve()
        args.out.mkdir(parents=True, exist_ok=True)
        install_wheels(manifest, args.site.resolve())
        env = child_env(args.site.resolve(), triton, flashinfer)
        facts.update(probe_vllm(env))
        if triton is not None and facts["triton"] != triton_pack["triton"]:
            raise RunError(
                f"Triton {facts['triton']} ({facts['triton_path']}) imports ahead of the "
                f"packed {triton_pack['triton']} in {triton}: unset what puts it first"
            )
        if flashinfer is not None:
            facts.update(probe_flashinfer(env, flashinfer))
    except RunError as e:
        print(f"run.py: error: {e}", file=sys.stderr)
        return EXIT_NO_CUDA if "no CUDA device" in str(e) else EXIT_USAGE
    print(f"environment: {json.dumps(facts)}", flush=True)
    summary: dict[str, Any] = {
        "bundle": {k: manifest[k] for k in ("name", "vllm_version", "created", "stack")},
        "command": command,
        "env": facts,
        "out": str(args.out),
        "tests": [],
        "benches": [],
    }
    for label, ids in selected:
        summary["tests"].append(run_tests(label, ids, args, env))
    for b in benches:
        summary["benches"].append(run_bench(b, args, env, command))
    if e2e:
        summary["e2e"] = run_e2e(e2e, args, env, command)
    summary["ok"] = (
        all(t.get("rc") in (0, None) for t in summary["tests"])
        and all(b["rc"] == 0 for b in summary["benches"])
        and (not e2e or (summary["e2e"]["rc"] == 0 and summary["e2e"]["merge_rc"] == 0))
    )
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print_summary(summary)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
