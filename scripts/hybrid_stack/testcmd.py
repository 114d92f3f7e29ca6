# SPDX-License-Identifier: Apache-2.0
"""`hybrid-stack test`: run pytest on the patched tree inside the build's venv.

``hybrid-stack test [PYTEST ARGS...]`` runs one pytest with those arguments.
With no arguments it runs the stack's CPU suite: the upstream files listed in
``ci/cpu-suite.toml`` plus every ``cpu_tests`` item of the series' carried
entries, one pytest process per suite (tests leak environment variables such
as ``VLLM_SSM_CONV_STATE_LAYOUT`` across files), and prints a summary table.
Any failure, error, or a suite that collects nothing (pytest exit 5) or passes
nothing makes the exit status non-zero. Suites run ``--jobs`` at a time
(default: 2, or 1 on a one-core machine), each its own process with its own
vLLM cache folder, longest first by the previous run's times
(``work/test-logs/summary.json``); the summary lists them in plan order.

Every run is offline: the project's Hugging Face fixture cache (see
``hfcache``) with ``HF_HUB_OFFLINE=1``. Tests that cannot run on CPU even so
are deselected through the ONE list ``[[deselect]]`` in ``ci/cpu-suite.toml``,
each with its reason, and the summary prints that list. Tests that skip
themselves (GPU-only) are reported as skipped, never as passed.

Interpreter suites (``interpret = true``; entries' items under
``tests/kernels/`` or prefixed ``interpret:``) run Triton kernels on CPU with
``TRITON_INTERPRET=1``, ``CUDA_VISIBLE_DEVICES=""``,
``VLLM_TRITON_FORCE_FIRST_CONFIG=1`` and the shipped plugin
``hybridstack_triton_interp``, which makes vLLM treat the CPU as CUDA-alike.
An item prefixed ``native:`` runs without the interpreter even under
``tests/kernels/``: for CPU tests of Triton's own objects (JITFunction,
specialization, launch path), which the interpreter replaces.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shlex
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from hybrid_stack import hfcache
from hybrid_stack.errors import StackError
from hybrid_stack.proc import tee
from hybrid_stack.stack import Stack, load_stack
from hybrid_stack.tomlfile import load as load_toml
from hybrid_stack.venvs import (  # noqa: F401 - PLUGIN_DIR, test_env: old home
    PLUGIN_DIR,
    check_venv,
    test_env,
    venv_and_tree,
)

# old names (kernel-stats imported them from here)
_check_venv = check_venv

PLUGIN = "hybridstack_triton_interp"
DEFAULT_CONFIG = Path("ci") / "cpu-suite.toml"
INTERPRET_PREFIX = "interpret:"
NATIVE_PREFIX = "native:"
INTERPRET_DIRS = ("tests/kernels/",)
COUNT_KEYS = ("passed", "failed", "errors", "skipped", "deselected", "xfailed", "xpassed")
SUITE_KEYS = {"name", "path", "args", "interpret", "timeout", "why"}
DESELECT_KEYS = {"test", "reason"}
TOP_KEYS = {"defaults", "suite", "deselect"}
# how the per-suite progress line names a mode (plain CPU suites: nothing)
MODE_NOTES = {"interp": " [triton interpreter]", "native": " [native triton]"}


def suite_mode(interpret: bool, native: bool) -> str:
    """A suite's mode: "interp" (the Triton interpreter), "native" (the real
    Triton on the CPU) or "cpu"."""
    return "interp" if interpret else "native" if native else "cpu"


# --------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Deselect:
    test: str
    reason: str

    @property
    def file(self) -> str:
        return self.test.split("::", 1)[0]


@dataclass
class Suite:
    name: str
    targets: list[str]
    args: list[str] = field(default_factory=list)
    interpret: bool = False
    timeout: int = 600
    origin: str = "upstream"
    native: bool = False

    @property
    def mode(self) -> str:
        return suite_mode(self.interpret, self.native)

    @property
    def files(self) -> set[str]:
        return {t.split("::", 1)[0] for t in self.targets}


@dataclass
class Config:
    suites: list[Suite]
    deselects: list[Deselect]
    timeout: int = 600


def _where(path: Path, what: str) -> str:
    return f"{path.name}: {what}"


def load_config(path: Path) -> Config:
    """Parse ci/cpu-suite.toml (suites, defaults, the deselect list)."""
    data = load_toml(path, missing="restore it from git (it lists the CPU suite)")
    unknown = set(data) - TOP_KEYS
    if unknown:
        raise StackError(_where(path, f"unknown top-level key(s) {sorted(unknown)}"))
    defaults = data.get("defaults", {})
    timeout = int(defaults.get("timeout", 600))
    suites: list[Suite] = []
    for i, raw in enumerate(data.get("suite", [])):
        where = _where(path, f"suite #{i + 1}")
        if not isinstance(raw, dict) or "path" not in raw:
            raise StackError(
                f"{where} needs a 'path' (a test file of the tree, or a list of "
                "pytest ids of one file)"
            )
        bad = set(raw) - SUITE_KEYS
        if bad:
            raise StackError(f"{where} has unknown key(s) {sorted(bad)}")
        args = raw.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise StackError(f"{where}: args must be a list of strings")
        targets = raw["path"] if isinstance(raw["path"], list) else [raw["path"]]
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise StackError(f"{where}: path must be a string or a list of strings")
        suites.append(
            Suite(
                name=str(raw.get("name") or Path(targets[0].split("::")[0]).stem),
                targets=list(targets),
                args=list(args),
                interpret=bool(raw.get("interpret", False)),
                timeout=int(raw.get("timeout", timeout)),
            )
        )
    deselects: list[Deselect] = []
    seen: set[str] = set()
    for i, raw in enumerate(data.get("deselect", [])):
        where = _where(path, f"deselect #{i + 1}")
        if not isinstance(raw, dict) or set(raw) != DESELECT_KEYS:
            raise StackError(f"{where} must have exactly the keys test and reason")
        test, reason = str(raw["test"]).strip(), str(raw["reason"]).strip()
        if "::" not in test or not reason:
            raise StackError(f"{where}: test must be a pytest id 'file::name' and reason non-empty")
        if test in seen:
            raise StackError(f"{where}: {test} is listed twice")
        seen.add(test)
        deselects.append(Deselect(test, reason))
    names = [s.name for s in suites]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise StackError(_where(path, f"suite name(s) used twice: {sorted(dup)}"))
    return Config(suites, deselects, timeout)


def entry_suites(stack: Stack, timeout: int) -> list[Suite]:
    """One suite per test file named by the carried entries' cpu_tests.

    An item is a pytest id or path relative to the tree, optionally followed by
    pytest arguments (``tests/x.py -k small``); items under tests/kernels/ or
    prefixed ``interpret:`` run under the Triton interpreter, unless prefixed
    ``native:``. Plain items of the same entry, file and mode share one process.
    """
    suites: list[Suite] = []
    for e in stack.carried:
        grouped: dict[tuple[str, bool], Suite] = {}
        for item in e.cpu_tests:
            text = item.strip()
            interpret = text.startswith(INTERPRET_PREFIX)
            native = text.startswith(NATIVE_PREFIX)
            if interpret or native:
                text = text.split(":", 1)[1].strip()
            try:
                target, *args = shlex.split(text)
            except ValueError as err:
                raise StackError(
                    f"entry '{e.name}': cpu_tests item {item!r} does not parse "
                    f"({err}); fix it in patches/series.toml"
                ) from None
            interpret = interpret or (not native and target.startswith(INTERPRET_DIRS))
            file = target.split("::", 1)[0]
            stem = Path(file).stem
            if args:
                suites.append(
                    Suite(
                        f"{e.name}:{stem}#{len(suites) + 1}",
                        [target],
                        args,
                        interpret,
                        timeout,
                        origin=f"entry {e.name}",
                        native=native,
                    )
                )
                continue
            key = (file, interpret, native)
            if key in grouped:
                if target not in grouped[key].targets:
                    grouped[key].targets.append(target)
            else:
                mode = suite_mode(interpret, native)
                grouped[key] = Suite(
                    f"{e.name}:{stem}" + ("" if mode == "cpu" else f"[{mode}]"),
                    [target],
                    [],
                    interpret,
                    timeout,
                    origin=f"entry {e.name}",
                    native=native,
                )
                suites.append(grouped[key])
    return suites


def plan(stack: Stack, config: Config) -> list[Suite]:
    return [*config.suites, *entry_suites(stack, config.timeout)]


# -------------------------------------------------------------- the environment


def pytest_argv(
    py: Path,
    suite: Suite,
    deselects: list[Deselect],
    *,
    all_deselects: bool = False,
) -> list[str]:
    """pytest's command line; deselects apply to the suite's files (or all)."""
    argv = [str(py), "-m", "pytest", "-p", "no:cacheprovider", "-rfE"]
    if suite.interpret:
        argv += ["-p", PLUGIN]
    argv += [f"--timeout={suite.timeout}"]
    for d in deselects:
        if all_deselects or d.file in suite.files:
            argv += ["--deselect", d.test]
    return [*argv, *suite.args, *suite.targets]


# ---------------------------------------------------------------- the results


_COUNT_RE = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)\b")
_FINAL_RE = re.compile(r"\bin \d+(?:\.\d+)?s\b")
_FAILURE_RE = re.compile(r"^(FAILED|ERROR) \S+\.py\b")


def parse_summary(output: str) -> dict[str, int]:
    """Counts from pytest's final line ('== 3 passed, 1 skipped in 2.1s ==')."""
    counts = dict.fromkeys(COUNT_KEYS, 0)
    for line in reversed(output.splitlines()):
        if not _FINAL_RE.search(line):
            continue
        if "no tests ran" in line or _COUNT_RE.search(line):
            for n, key in _COUNT_RE.findall(line):
                key = "errors" if key.startswith("error") else key
                counts[key] += int(n)
            break
    return counts


@dataclass
class Result:
    suite: Suite
    rc: int
    counts: dict[str, int]
    seconds: float
    log: Path | None = None
    failures: list[str] = field(default_factory=list)

    @property
    def problem(self) -> str:
        """Why this suite fails the run ('' if it does not)."""
        c = self.counts
        if self.rc == 5:
            return "no tests collected (pytest exit 5)"
        if c["failed"] or c["errors"]:
            return f"{c['failed']} failed, {c['errors']} errors"
        if self.rc != 0:
            return f"pytest exit {self.rc}"
        if c["passed"] == 0:
            return "nothing passed (all skipped/deselected)"
        return ""


def run_suite(
    suite: Suite,
    py: Path,
    tree: Path,
    env: dict[str, str],
    deselects: list[Deselect],
    log_dir: Path,
    *,
    verbose: bool = False,
) -> Result:
    argv = pytest_argv(py, suite, deselects)
    log = log_dir / (re.sub(r"[^A-Za-z0-9_.-]+", "_", suite.name) + ".log")
    t0 = time.monotonic()
    with log.open("w") as logf:
        logf.write(f"$ cd {tree} && {shlex.join(argv)}\n")
        logf.flush()
        rc, lines = tee(
            argv,
            cwd=tree,
            env=env,
            log=logf,
            echo=lambda line: "    " + line.rstrip() if verbose else None,
        )
    output = "".join(lines)
    failures = [ln.strip() for ln in lines if _FAILURE_RE.match(ln)]
    return Result(suite, rc, parse_summary(output), time.monotonic() - t0, log, failures)


def format_table(results: list[Result]) -> str:
    head = ("suite", "mode", "passed", "failed", "skipped", "desel.", "time", "status")
    rows = [head]
    for r in results:
        c = r.counts
        rows.append(
            (
                r.suite.name,
                r.suite.mode,
                str(c["passed"] + c["xpassed"]),
                str(c["failed"] + c["errors"]),
                str(c["skipped"] + c["xfailed"]),
                str(c["deselected"]),
                f"{r.seconds:.0f}s",
                "FAIL: " + r.problem if r.problem else "ok",
            )
        )
    tot = {k: sum(r.counts[k] for r in results) for k in COUNT_KEYS}
    rows.append(
        (
            "total",
            "",
            str(tot["passed"] + tot["xpassed"]),
            str(tot["failed"] + tot["errors"]),
            str(tot["skipped"] + tot["xfailed"]),
            str(tot["deselected"]),
            f"{sum(r.seconds for r in results):.0f}s",
            "FAIL" if any(r.problem for r in results) else "ok",
        )
    )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    right = {2, 3, 4, 5, 6}

    def fmt(row: tuple[str, ...]) -> str:
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
        ]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(rows[0]), rule, *map(fmt, rows[1:-1]), rule, fmt(rows[-1])])


def format_deselects(deselects: list[Deselect], suites: list[Suite]) -> str:
    files = set().union(*(s.files for s in suites)) if suites else set()
    used = [d for d in deselects if d.file in files]
    if not used:
        return "deselected (ci/cpu-suite.toml): none"
    lines = [f"deselected (ci/cpu-suite.toml, {len(used)} entries):"]
    lines += [f"  {d.test}\n      {d.reason}" for d in used]
    return "\n".join(lines)


# ------------------------------------------------------------------------ verb


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "test",
        help="run the CPU suite (or pytest with your arguments) on the patched tree",
        description=(
            "Without PYTEST ARGS: run the stack's CPU suite (ci/cpu-suite.toml plus "
            "the carried entries' cpu_tests), one pytest per suite, and print a "
            "summary. With them: run one pytest in the tree with those arguments. "
            "Put '--' before pytest options: hybrid-stack test -- -k foo tests/x.py"
        ),
    )
    p.add_argument("--venv", type=Path, default=None, help="default: work/venv")
    p.add_argument("--tree", type=Path, default=None, help="default: work/vllm")
    p.add_argument("--config", type=Path, default=None, help="default: ci/cpu-suite.toml")
    p.add_argument(
        "--suite",
        action="append",
        default=[],
        metavar="NAME",
        help="run only this suite of the plan (repeatable; see --list)",
    )
    p.add_argument("--list", action="store_true", help="print the plan and exit")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--interpret",
        action="store_true",
        help="with PYTEST ARGS: run under the Triton interpreter (kernel tests)",
    )
    mode.add_argument(
        "--native",
        action="store_true",
        help="with PYTEST ARGS: keep the real Triton on the CPU (launch-path tests)",
    )
    p.add_argument(
        "-j",
        "--jobs",
        type=int,
        default=None,
        metavar="N",
        help="suites run at a time (default: 2, 1 on a one-core machine)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="stream pytest's output")
    p.add_argument(
        "pytest_args",
        nargs=argparse.REMAINDER,
        metavar="PYTEST ARGS",
        help="arguments for one pytest run in the tree",
    )
    p.set_defaults(func=run)


def _paths(stack: Stack, args: argparse.Namespace) -> tuple[Path, Path, Path]:
    venv, tree = venv_and_tree(stack, args.venv, args.tree)
    config = (args.config or stack.root / DEFAULT_CONFIG).absolute()
    return venv, tree, config


_print_lock = threading.Lock()


def default_jobs() -> int:
    return max(1, min(2, os.cpu_count() or 1))


def previous_seconds(summary: Path) -> dict[str, float]:
    """Suite name -> seconds, from the previous run's summary.json ({} if none)."""
    try:
        data = json.loads(summary.read_text())
        return {str(r["suite"]): float(r["seconds"]) for r in data}
    except (OSError, ValueError, TypeError, KeyError):
        return {}


def schedule(suites: list[Suite], seconds: dict[str, float]) -> list[Suite]:
    """Longest first (by the previous run's times; a suite without one first
    of all): with a fixed number of workers, the run ends soonest."""
    return sorted(suites, key=lambda s: -seconds.get(s.name, float("inf")))


def run_plan(
    suites: list[Suite],
    jobs: int,
    seconds: dict[str, float],
    run_one: Callable[[Suite, int], Result],
    on_done: Callable[[Result, int], None],
) -> list[Result]:
    """Run every suite, `jobs` at a time, each in the first free slot (0 ..
    jobs-1); call on_done as each ends; return the results in plan order."""
    slots: queue.Queue[int] = queue.Queue()
    for i in range(jobs):
        slots.put(i)

    def one(s: Suite) -> Result:
        slot = slots.get()
        with _print_lock:
            print(f"      started {s.name}{MODE_NOTES.get(s.mode, '')}", flush=True)
        try:
            return run_one(s, slot)
        finally:
            slots.put(slot)

    done: dict[str, Result] = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(one, s) for s in schedule(suites, seconds)]
        for fut in as_completed(futures):
            r = fut.result()
            done[r.suite.name] = r
            on_done(r, len(done))
    return [done[s.name] for s in suites]


def suite_env(s: Suite, hf_home: Path, vllm_cache: Path, slot: int, jobs: int) -> dict[str, str]:
    env = test_env(dict(os.environ), hf_home, interpret=s.interpret, native=s.native)
    if jobs > 1:  # suites running side by side do not share vLLM's cache folder
        env["VLLM_CACHE_ROOT"] = str(vllm_cache / f"slot{slot}")
    return env


def report(r: Result, done: int, total: int, deselects: list[Deselect], jobs: int) -> None:
    """The progress lines of one finished suite."""
    s, c = r.suite, r.counts
    lines = [
        f"[{done}/{total}] {s.name}{MODE_NOTES.get(s.mode, '')}: "
        f"{c['passed']} passed, {c['failed'] + c['errors']} failed, "
        f"{c['skipped']} skipped, {c['deselected']} deselected in "
        f"{r.seconds:.0f} s" + (f"  FAIL: {r.problem}" if r.problem else "")
    ]
    listed = [d.test for d in deselects if d.file in s.files]
    if listed and c["deselected"] == 0 and r.rc in (0, 1):
        lines.append(
            f"      warning: the deselect list names {len(listed)} test(s) of this "
            "suite but pytest deselected none: stale ids? fix ci/cpu-suite.toml"
        )
    lines += [f"        {line}" for line in r.failures[:20]]
    if len(r.failures) > 20:
        lines.append(f"        ... {len(r.failures) - 20} more in {r.log}")
    if r.problem:
        lines.append(f"      log: {r.log}")
    with _print_lock:
        print("\n".join(lines), flush=True)


def run(args: argparse.Namespace) -> int:
    stack = load_stack(args.root)
    venv, tree, config_path = _paths(stack, args)
    config = load_config(config_path)
    pytest_args = list(args.pytest_args)
    if pytest_args[:1] == ["--"]:
        pytest_args = pytest_args[1:]
    suites = plan(stack, config)

    if args.list:
        for s in suites:
            mode = s.mode
            extra = f"  {shlex.join(s.args)}" if s.args else ""
            print(f"{s.name:40} {mode:6} {s.origin:24} {' '.join(s.targets)}{extra}")
        print(format_deselects(config.deselects, suites))
        return 0

    py = check_venv(stack, venv, tree)
    hf_home = stack.root / "work" / "hf-home"
    hfcache.materialize(hf_home)
    log_dir = stack.root / "work" / "test-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()

    if pytest_args:
        if args.suite:
            raise StackError("--suite selects from the plan: drop it or the pytest args")
        one = Suite("pytest", [], pytest_args, args.interpret, config.timeout, native=args.native)
        argv = pytest_argv(py, one, config.deselects, all_deselects=True)
        env = test_env(dict(os.environ), hf_home, interpret=args.interpret, native=args.native)
        print(f"$ cd {tree} && {shlex.join(argv)}", flush=True)
        return subprocess.run(argv, cwd=tree, env=env).returncode

    if args.suite:
        known = {s.name for s in suites}
        missing = sorted(set(args.suite) - known)
        if missing:
            raise StackError(
                f"no suite named {', '.join(missing)} (see 'hybrid-stack test --list')"
            )
        suites = [s for s in suites if s.name in args.suite]
    for s in suites:
        for f in s.files:
            if not (tree / f).is_file():
                raise StackError(
                    f"suite {s.name} ({s.origin}) names {f}, which {tree} lacks: fix "
                    "ci/cpu-suite.toml or the entry's cpu_tests, or re-run apply"
                )

    jobs = args.jobs if args.jobs is not None else default_jobs()
    if jobs < 1:
        raise StackError(f"--jobs wants a number of suites at a time >= 1, not {jobs}")
    vllm_cache = hf_home.parent / "vllm-cache"
    results = run_plan(
        suites,
        jobs,
        previous_seconds(log_dir / "summary.json"),
        lambda s, slot: run_suite(
            s,
            py,
            tree,
            suite_env(s, hf_home, vllm_cache, slot, jobs),
            config.deselects,
            log_dir,
            verbose=args.verbose,
        ),
        lambda r, done: report(r, done, len(suites), config.deselects, jobs),
    )

    print()
    print(format_table(results))
    print()
    print(format_deselects(config.deselects, suites))
    (log_dir / "summary.json").write_text(
        json.dumps(
            [
                {
                    "suite": r.suite.name,
                    "origin": r.suite.origin,
                    "interpret": r.suite.interpret,
                    "native": r.suite.native,
                    "rc": r.rc,
                    "seconds": round(r.seconds, 1),
                    "problem": r.problem,
                    **r.counts,
                }
                for r in results
            ],
            indent=2,
        )
        + "\n"
    )
    failed = [r.suite.name for r in results if r.problem]
    if failed:
        print(f"\nFAILED suites: {', '.join(failed)} (logs in {log_dir})")
    # one plain closing line, the totals of every suite
    total = {k: sum(r.counts[k] for r in results) for k in ("passed", "failed", "errors")}
    skipped = sum(r.counts["skipped"] for r in results)
    print(f"{len(results)} suites, {jobs} at a time, in {time.monotonic() - t_start:.0f} s")
    print(
        f"cpu-suite: {total['passed']} passed, {total['failed'] + total['errors']} failed, "
        f"{skipped} skipped"
    )
    return 1 if failed else 0
