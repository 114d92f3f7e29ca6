# SPDX-License-Identifier: Apache-2.0
"""Tests of `hybrid-stack test`: the suite config and deselect list, the plan,
summary parsing, exit-5 handling, and the offline HF fixture cache.

pytest itself is faked: the venv's ``bin/python`` is a small script printing a
canned pytest summary per suite file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hybrid_stack import build, cli, hfcache, testcmd
from hybrid_stack.errors import StackError
from hybrid_stack.stack import load_stack

REPO = Path(__file__).resolve().parents[1]
SHA = "c" * 64
PIN = f"""\
[upstream]
project = "vllm"
version = "0.33.0"
sdist = {{ filename = "vllm-0.33.0.tar.gz", sha256 = "{SHA}" }}
"""
SERIES = """\
[[entry]]
name = "gdn-thing"
subject = "[Mamba] thing"
status = "carried"
purpose = "p"
overlay = ["tests/v1/test_thing.py"]
cpu_tests = [
    "tests/v1/test_thing.py::test_a",
    "tests/v1/test_thing.py::test_b",
    "tests/v1/test_thing.py -k small",
    "tests/kernels/mamba/test_kern.py::test_k",
    "interpret: tests/v1/test_thing.py::test_c",
    "native: tests/kernels/mamba/test_kern.py::test_launch",
    "tests/kernels/mamba/test_kern.py::test_k2",
]

[[entry]]
name = "old"
subject = "old"
status = "dropped"
purpose = "p"
cpu_tests = ["tests/never.py"]
"""
CONFIG = """\
[defaults]
timeout = 120

[[suite]]
path = "tests/a/test_one.py"

[[suite]]
name = "two-mamba"
path = "tests/a/test_two.py"
args = ["-k", "mamba"]

[[deselect]]
test = "tests/a/test_one.py::test_needs_gpu"
reason = "needs a GPU tokenizer"
"""

# The fake pytest: print the summary line that FAKE_PYTEST maps the suite's
# first target file to, exit with the mapped code; record the argv.
FAKE_PY = """#!{python}
import json, os, sys
table = json.loads(os.environ["FAKE_PYTEST"])
args = sys.argv[1:]
target = [a for a in args if a.startswith("tests/")][-1].split("::")[0]
line, rc = table[target]
with open(os.environ["FAKE_PYTEST_LOG"], "a") as f:
    f.write(json.dumps({{"argv": args, "cwd": os.getcwd(),
                        "interp": os.environ.get("TRITON_INTERPRET", ""),
                        "hf": os.environ.get("HF_HUB_OFFLINE", ""),
                        "cache": os.environ.get("VLLM_CACHE_ROOT", ""),
                        "layout": os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT", "")}}) + "\\n")
print("collected ...")
print(line)
sys.exit(rc)
"""


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "stack"
    (root / "patches").mkdir(parents=True)
    (root / "patches" / "pin.toml").write_text(PIN)
    (root / "patches" / "series.toml").write_text(SERIES)
    (root / "overlay" / "tests" / "v1").mkdir(parents=True)
    (root / "overlay" / "tests" / "v1" / "test_thing.py").write_text("")
    (root / "ci").mkdir()
    (root / "ci" / "cpu-suite.toml").write_text(CONFIG)
    tree = root / "work" / "vllm"
    for f in (
        "tests/conftest.py",
        "tests/a/test_one.py",
        "tests/a/test_two.py",
        "tests/v1/test_thing.py",
        "tests/kernels/mamba/test_kern.py",
    ):
        (tree / f).parent.mkdir(parents=True, exist_ok=True)
        (tree / f).write_text("")
    py = root / "work" / "venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text(FAKE_PY.format(python=sys.executable))
    py.chmod(0o755)
    stamp = {"editable": {"tree": str(tree), "version": "0.33.0+hybridstack.nogit"}}
    (root / "work" / "venv" / build.STAMP_NAME).write_text(json.dumps(stamp))
    return root


def run_cli(
    root: Path,
    monkeypatch: pytest.MonkeyPatch,
    table: dict[str, tuple[str, int]],
    *argv: str,
) -> tuple[int, list[dict]]:
    log = root / "calls.jsonl"
    monkeypatch.setenv("FAKE_PYTEST", json.dumps(table))
    monkeypatch.setenv("FAKE_PYTEST_LOG", str(log))
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "leaked")
    rc = cli.main(["--root", str(root), "test", *argv])
    calls = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    return rc, calls


GOOD = ("===== 5 passed, 2 skipped, 1 deselected, 3 warnings in 1.20s =====", 0)
ALL = {
    "tests/a/test_one.py": GOOD,
    "tests/a/test_two.py": ("===== 3 passed in 0.5s =====", 0),
    "tests/v1/test_thing.py": ("2 passed in 0.1s", 0),
    "tests/kernels/mamba/test_kern.py": ("1 passed in 9.0s", 0),
}


# ------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            "======= 213 passed, 3 skipped, 2 deselected, 14 warnings in 72.10s (0:01:12) =======",
            {"passed": 213, "skipped": 3, "deselected": 2},
        ),
        (
            "== 1 failed, 2 passed, 1 error, 1 xfailed in 3.2s ==",
            {"failed": 1, "passed": 2, "errors": 1, "xfailed": 1},
        ),
        ("4 failed, 2 errors in 0.5s", {"failed": 4, "errors": 2}),
        ("============ no tests ran in 0.01s ============", {}),
        ("===== 120 deselected in 0.30s =====", {"deselected": 120}),
    ],
)
def test_parse_summary(line: str, expected: dict[str, int]) -> None:
    output = f"collected 3 items\ntests/x.py ... [100%]\nFAILED x - 1 passed in\n{line}\n"
    counts = testcmd.parse_summary(output)
    assert counts == {**dict.fromkeys(testcmd.COUNT_KEYS, 0), **expected}


def test_parse_summary_without_summary_line() -> None:
    assert sum(testcmd.parse_summary("Traceback ...\nImportError: x\n").values()) == 0


def test_result_problem() -> None:
    suite = testcmd.Suite("s", ["tests/x.py"])

    def result(rc: int, **counts: int) -> testcmd.Result:
        return testcmd.Result(suite, rc, {**dict.fromkeys(testcmd.COUNT_KEYS, 0), **counts}, 1.0)

    assert result(0, passed=3, skipped=2).problem == ""
    assert "exit 5" in result(5).problem
    assert "failed" in result(1, passed=3, failed=1).problem
    assert "nothing passed" in result(0, skipped=4).problem
    assert "exit 2" in result(2).problem  # e.g. a collection error


# -------------------------------------------------------------------- config


def test_repository_config_parses() -> None:
    config = testcmd.load_config(REPO / "ci" / "cpu-suite.toml")
    names = [s.name for s in config.suites]
    assert "test_prefix_caching" in names and "test_config-mamba" in names
    assert any(s.interpret for s in config.suites)
    for d in config.deselects:
        assert "::" in d.test and d.reason
        assert any(d.file in s.files for s in config.suites), d.test


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('[[suite]]\nargs = ["-x"]\n', "needs a 'path'"),
        ('[[suite]]\npath = "t.py"\nwhen = 1\n', "unknown key"),
        ('[[deselect]]\ntest = "t.py::x"\n', "exactly the keys"),
        ('[[deselect]]\ntest = "t.py"\nreason = "r"\n', "pytest id"),
        ('[[deselect]]\ntest = "t.py::x"\nreason = ""\n', "non-empty"),
        (
            '[[deselect]]\ntest = "t.py::x"\nreason = "r"\n' * 2,
            "listed twice",
        ),
        ('[[suite]]\npath = "t.py"\n' * 2, "used twice"),
        ("[x]\n", "unknown top-level"),
        ("[[suite]\n", "not valid TOML"),
    ],
)
def test_config_errors(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "cpu-suite.toml"
    path.write_text(text)
    with pytest.raises(StackError, match=match):
        testcmd.load_config(path)


def test_plan_adds_carried_entries(root: Path) -> None:
    stack = load_stack(root)
    suites = testcmd.plan(stack, testcmd.load_config(root / "ci" / "cpu-suite.toml"))
    by_name = {s.name: s for s in suites}
    assert [s.name for s in suites][:2] == ["test_one", "two-mamba"]
    plain = by_name["gdn-thing:test_thing"]
    assert plain.targets == [
        "tests/v1/test_thing.py::test_a",
        "tests/v1/test_thing.py::test_b",
    ]
    assert not plain.interpret and plain.timeout == 120
    with_args = [s for s in suites if s.args == ["-k", "small"]]
    assert len(with_args) == 1 and with_args[0].origin == "entry gdn-thing"
    kernels = [s for s in suites if "test_kern.py::test_k" in s.targets[0]]
    assert kernels[0].interpret  # tests/kernels/ convention
    assert kernels[0].targets == [
        "tests/kernels/mamba/test_kern.py::test_k",
        "tests/kernels/mamba/test_kern.py::test_k2",
    ]
    native = [s for s in suites if "tests/kernels/mamba/test_kern.py::test_launch" in s.targets]
    assert len(native) == 1 and native[0].targets == [
        "tests/kernels/mamba/test_kern.py::test_launch"
    ]
    assert not native[0].interpret  # "native:" prefix wins over tests/kernels/
    assert native[0].native and native[0].mode == "native"
    assert native[0].name == "gdn-thing:test_kern[native]"
    explicit = [s for s in suites if s.targets == ["tests/v1/test_thing.py::test_c"]]
    assert explicit[0].interpret  # "interpret:" prefix
    assert not any("never" in t for s in suites for t in s.targets)  # dropped


def test_pytest_argv_and_env(tmp_path: Path) -> None:
    d = [
        testcmd.Deselect("tests/a.py::t1", "r"),
        testcmd.Deselect("tests/b.py::t2", "r"),
    ]
    suite = testcmd.Suite("a", ["tests/a.py"], ["-k", "x"], interpret=True)
    argv = testcmd.pytest_argv(Path("/v/bin/python"), suite, d)
    assert argv[:3] == ["/v/bin/python", "-m", "pytest"]
    assert argv[argv.index(testcmd.PLUGIN) - 1 :][:2] == ["-p", testcmd.PLUGIN]
    assert "tests/a.py::t1" in argv and "tests/b.py::t2" not in argv
    assert argv[-3:] == ["-k", "x", "tests/a.py"]
    base = {"PATH": "/bin", "VLLM_SSM_CONV_STATE_LAYOUT": "x", "PYTHONPATH": "/s"}
    env = testcmd.test_env(base, tmp_path, interpret=True)
    assert "VLLM_SSM_CONV_STATE_LAYOUT" not in env
    assert env["TRITON_INTERPRET"] == "1" and env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["PYTHONPATH"] == str(testcmd.PLUGIN_DIR)
    assert (testcmd.PLUGIN_DIR / f"{testcmd.PLUGIN}.py").is_file()
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HOME"] == str(tmp_path)
    env = testcmd.test_env(base, tmp_path, interpret=False)
    assert "TRITON_INTERPRET" not in env and "PYTHONPATH" not in env
    assert "CUDA_VISIBLE_DEVICES" not in env
    env = testcmd.test_env(base, tmp_path, interpret=False, native=True)
    assert "TRITON_INTERPRET" not in env and "PYTHONPATH" not in env
    assert env["CUDA_VISIBLE_DEVICES"] == ""  # vLLM keeps the real Triton
    assert env["VLLM_TARGET_DEVICE"] == "cpu"


# ----------------------------------------------------------------------- run


def test_default_run_one_process_per_suite(
    root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    rc, calls = run_cli(root, monkeypatch, ALL, "--jobs", "1")
    out = capsys.readouterr().out
    assert rc == 0, out
    assert len(calls) == 7  # 2 config suites + 5 from the carried entry
    assert all(c["cwd"] == str(root / "work" / "vllm") for c in calls)
    assert all(c["hf"] == "1" and c["layout"] == "" for c in calls)
    assert [bool(c["interp"]) for c in calls] == [False] * 4 + [True] * 2 + [False]
    first = calls[0]["argv"]
    assert "--deselect" in first and "tests/a/test_one.py::test_needs_gpu" in first
    assert "--timeout=120" in first
    assert "tests/a/test_one.py::test_needs_gpu" not in calls[1]["argv"]
    # the table, then the deselect list with its reason
    table = out[out.index("suite ") :]
    assert "test_one" in table and "total" in table
    assert "needs a GPU tokenizer" in out[out.index("deselected (") :]
    summary = json.loads((root / "work" / "test-logs" / "summary.json").read_text())
    assert summary[0]["passed"] == 5 and summary[0]["skipped"] == 2
    # the plain closing line holds every suite's totals
    passed = sum(s["passed"] for s in summary)
    skipped = sum(s["skipped"] for s in summary)
    assert (
        out.rstrip().splitlines()[-1] == f"cpu-suite: {passed} passed, 0 failed, {skipped} skipped"
    )
    assert (root / "work" / "hf-home" / "hub").is_dir()


def test_exit_5_and_failures_fail_the_run(
    root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    table = {
        **ALL,
        "tests/a/test_two.py": ("===== no tests ran in 0.01s =====", 5),
        "tests/v1/test_thing.py": (
            "FAILED tests/v1/test_thing.py::test_a - assert 0\n== 1 failed, 1 passed in 0.2s ==",
            1,
        ),
    }
    rc, calls = run_cli(root, monkeypatch, table)
    out = capsys.readouterr().out
    assert rc == 1
    assert len(calls) == 7  # keeps going after a failing suite
    assert "no tests collected (pytest exit 5)" in out
    assert "FAILED tests/v1/test_thing.py::test_a" in out
    assert "FAILED suites: two-mamba" in out
    summary = json.loads((root / "work" / "test-logs" / "summary.json").read_text())
    failed = sum(s["failed"] + s["errors"] for s in summary)
    assert failed > 0
    assert f", {failed} failed, " in out.rstrip().splitlines()[-1]


def test_select_list_and_passthrough(
    root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    rc, calls = run_cli(root, monkeypatch, ALL, "--suite", "two-mamba")
    assert rc == 0 and len(calls) == 1
    assert calls[0]["argv"][-3:] == ["-k", "mamba", "tests/a/test_two.py"]
    rc, calls2 = run_cli(root, monkeypatch, ALL, "--list")
    assert rc == 0 and len(calls2) == len(calls)  # --list runs nothing
    assert "gdn-thing:test_thing" in capsys.readouterr().out
    with pytest.raises(StackError, match="no suite named nope"):
        testcmd.run(cli.make_parser().parse_args(["--root", str(root), "test", "--suite", "nope"]))
    # pass-through: one pytest with the given args, its exit code returned
    table = {"tests/a/test_two.py": ("no tests ran in 0.1s", 5)}
    rc, calls3 = run_cli(root, monkeypatch, table, "--", "-x", "tests/a/test_two.py")
    assert rc == 5
    assert calls3[-1]["argv"][-2:] == ["-x", "tests/a/test_two.py"]
    rc, calls4 = run_cli(root, monkeypatch, table, "--interpret", "tests/a/test_two.py", "-q")
    assert calls4[-1]["interp"] == "1" and calls4[-1]["argv"][-2:] == [
        "tests/a/test_two.py",
        "-q",
    ]


def test_missing_venv_and_missing_suite_file(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (root / "work" / "vllm" / "tests" / "a" / "test_two.py").unlink()
    with pytest.raises(StackError, match="names tests/a/test_two.py"):
        testcmd.run(cli.make_parser().parse_args(["--root", str(root), "test"]))
    (root / "work" / "vllm" / "tests" / "a" / "test_two.py").write_text("")
    (root / "work" / "venv" / build.STAMP_NAME).unlink()
    with pytest.raises(StackError, match="no editable install"):
        testcmd.run(cli.make_parser().parse_args(["--root", str(root), "test"]))
    (root / "work" / "venv" / "bin" / "python").unlink()
    with pytest.raises(StackError, match="hybrid-stack build"):
        testcmd.run(cli.make_parser().parse_args(["--root", str(root), "test"]))


# ------------------------------------------------------------------- hfcache


def test_hf_fixture_cache(tmp_path: Path) -> None:
    repos = hfcache.materialize(tmp_path / "hf")
    for must in (
        "facebook/opt-125m",
        "llava-hf/llava-1.5-7b-hf",
        "Qwen/Qwen3.5-0.8B",
        "state-spaces/mamba-130m-hf",
    ):
        assert must in repos
    repo = tmp_path / "hf" / "hub" / "models--facebook--opt-125m"
    rev = (repo / "refs" / "main").read_text()
    cfg = json.loads((repo / "snapshots" / rev / "config.json").read_text())
    assert cfg["model_type"] == "opt"
    assert hfcache.materialize(tmp_path / "hf") == repos  # idempotent
    for r in repos:  # every fixture has a parseable config.json
        json.loads((hfcache.FIXTURES_DIR / r / "config.json").read_text())


def test_hf_fixture_cache_is_read_offline(tmp_path: Path) -> None:
    pytest.importorskip("huggingface_hub")
    hfcache.materialize(tmp_path / "hf")
    code = (
        "from huggingface_hub import hf_hub_download; "
        "print(hf_hub_download('Qwen/Qwen3-0.6B', 'config.json'))"
    )
    env = {**os.environ, **hfcache.offline_env(tmp_path / "hf")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(tmp_path / "hf" / "hub"))


def test_generated_llava_tokenizer(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    hfcache.materialize(tmp_path / "hf")
    repo = tmp_path / "hf" / "hub" / "models--llava-hf--llava-1.5-7b-hf"
    rev = (repo / "refs" / "main").read_text()
    tok = tokenizers.Tokenizer.from_file(str(repo / "snapshots" / rev / "tokenizer.json"))
    assert tok.get_vocab_size() == 32002
    assert tok.token_to_id("<image>") == 32000 and tok.token_to_id("<pad>") == 32001
    ids = tok.encode("a <image> b").ids
    assert ids[0] == 1 and 32000 in ids


def test_stale_deselect_warns(
    root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    table = {**ALL, "tests/a/test_one.py": ("===== 5 passed in 1.0s =====", 0)}
    rc, _ = run_cli(root, monkeypatch, table, "--suite", "test_one")
    assert rc == 0
    assert "pytest deselected none: stale ids?" in capsys.readouterr().out
    rc, _ = run_cli(root, monkeypatch, ALL, "--suite", "test_one")
    assert "stale ids?" not in capsys.readouterr().out


def test_suites_run_side_by_side_longest_first() -> None:
    """run_plan: at most `jobs` at once, two at once when there are two, the
    longest (by the previous run) first, results in plan order."""
    suites = [testcmd.Suite(n, [f"tests/{n}.py"]) for n in ("a", "b", "c", "d")]
    previous = {"a": 1.0, "b": 30.0, "c": 5.0, "d": 20.0}
    running: set[str] = set()
    most, started, slots_seen = 0, [], set()
    lock = threading.Lock()

    def run_one(s: testcmd.Suite, slot: int) -> testcmd.Result:
        nonlocal most
        with lock:
            running.add(s.name)
            started.append(s.name)
            slots_seen.add(slot)
            most = max(most, len(running))
        time.sleep(0.2)
        with lock:
            running.discard(s.name)
        return testcmd.Result(s, 0, dict.fromkeys(testcmd.COUNT_KEYS, 0), 0.2)

    done: list[int] = []
    results = testcmd.run_plan(suites, 2, previous, run_one, lambda r, n: done.append(n))
    assert most == 2 and slots_seen == {0, 1}
    assert started[:2] == ["b", "d"] and started[-1] == "a"
    assert [r.suite.name for r in results] == ["a", "b", "c", "d"]
    assert done == [1, 2, 3, 4]
    most = 0
    testcmd.run_plan(suites, 1, previous, run_one, lambda r, n: None)
    assert most == 1


def test_parallel_run_separates_caches_and_keeps_failures(
    root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    table = {**ALL, "tests/a/test_two.py": ("===== no tests ran in 0.01s =====", 5)}
    rc, calls = run_cli(root, monkeypatch, table, "--jobs", "2")
    out = capsys.readouterr().out
    assert rc == 1 and len(calls) == 7
    assert "no tests collected (pytest exit 5)" in out
    caches = {c["cache"] for c in calls}
    assert {Path(c).name for c in caches} <= {"slot0", "slot1"} and len(caches) == 2
    summary = json.loads((root / "work" / "test-logs" / "summary.json").read_text())
    assert len(summary) == 7 and sum(s["rc"] == 5 for s in summary) == 1
    with pytest.raises(StackError, match="--jobs wants"):
        testcmd.run(cli.make_parser().parse_args(["--root", str(root), "test", "--jobs", "0"]))
