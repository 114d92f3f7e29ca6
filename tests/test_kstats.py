# SPDX-License-Identifier: Apache-2.0
"""`hybrid-stack kernel-stats`: the ptxas parser, argument errors, and (with
work/venv) real sm_90 / sm_89 compiles of the fused SSD kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_stack.kstats_probe import SMEM_LIMIT, parse_ptxas

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / "work" / "venv"

PTXAS_SAMPLE = """\
ptxas info    : 11 bytes gmem
ptxas info    : Compiling entry function '_ssd_fused_varlen_kernel' for 'sm_90a'
ptxas info    : Function properties for _ssd_fused_varlen_kernel
    152 bytes stack frame, 220 bytes spill stores, 264 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 152 bytes cumulative stack size
"""


def test_parse_ptxas_reads_registers_spills_and_stack() -> None:
    assert parse_ptxas(PTXAS_SAMPLE) == {
        "regs": 255,
        "spill_store_bytes": 220,
        "spill_load_bytes": 264,
        "stack_bytes": 152,
        "wgmma_serialized": [],
    }


# what Triton 3.6's ptxas printed for two of the fused SSD kernel's
# session-local sm_90 variants, verbatim (its double space included)
PTXAS_SERIALIZED = {
    "C7514": "ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async "
    "instructions are serialized due to non wgmma instructions reading accumulator "
    "registers of  a wgmma between start and end of the pipeline stage in the "
    "function '_ssd_fused_sm90_kernel'\n",
    "C7512": "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async "
    "instructions are serialized due to insufficient register resources for the "
    "function '_ssd_fused_sm90_kernel'\n",
}


@pytest.mark.parametrize(
    ("code", "why"),
    [
        (
            "C7514",
            "non wgmma instructions reading accumulator registers of a wgmma "
            "between start and end of the pipeline stage",
        ),
        ("C7512", "insufficient register resources"),
    ],
)
def test_parse_ptxas_reports_serialized_wgmma(code: str, why: str) -> None:
    usage = parse_ptxas(PTXAS_SAMPLE.replace(
        "ptxas info    : Function properties", PTXAS_SERIALIZED[code]
        + "ptxas info    : Function properties",
    ))  # fmt: skip
    assert usage["regs"] == 255
    assert usage["wgmma_serialized"] == [f"{code}: {why}"]


@pytest.mark.parametrize(
    "text",
    [
        "",
        PTXAS_SAMPLE.replace("Used 255 registers", "Used registers"),
        PTXAS_SAMPLE + PTXAS_SAMPLE,  # two functions: ambiguous
    ],
)
def test_parse_ptxas_rejects_output_it_cannot_read(text: str) -> None:
    with pytest.raises(ValueError):
        parse_ptxas(text)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "scripts")}
    return subprocess.run(
        [sys.executable, "-m", "hybrid_stack.cli", "--root", str(REPO), "kernel-stats", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )


def test_bad_triton_release_is_one_clear_error() -> None:
    p = _cli("--triton", "3.6")
    assert p.returncode != 0
    assert "--triton wants a release like 3.6.0, not '3.6'" in p.stderr


def test_unknown_entry_is_one_clear_error() -> None:
    p = _cli("--entry", "no-such-entry")
    assert p.returncode == 2
    assert "no kernel cases for no-such-entry" in p.stderr


needs_venv = pytest.mark.skipif(
    not (VENV / "bin" / "python").exists(),
    reason="needs work/venv: run 'hybrid-stack build' first (CI does)",
)


@pytest.mark.venv
@needs_venv
def test_fused_ssd_kernel_compiles_for_sm90(tmp_path: Path) -> None:
    # CI ran `kernel-stats --arch 90 --json FILE` just before (and failed if
    # it failed): check its result rather than compile the same kernels again
    given = os.environ.get("HYBRID_STACK_KSTATS_SM90_JSON")
    if given:
        data = json.loads(Path(given).read_text())
    else:
        out = tmp_path / "ks.json"
        p = _cli("--json", str(out))
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        data = json.loads(out.read_text())
    assert data["arch"] == 90
    assert not any("error" in r for r in data["rows"])
    # the GDN chunk prefill, without block checkpoints and with them into an
    # fp32 and a bf16 state cache (stored at two places in the loop)
    gdn = [r for r in data["rows"] if r["entry"] == "gdn-all-mode-prefill-checkpoints"]
    assert {r["case"].rsplit(" ", 1)[-1] for r in gdn} == {"off", "fp32", "bf16"}
    assert all(0 < r["regs"] <= 255 and r["smem_bytes"] <= SMEM_LIMIT[90] for r in gdn)
    rows = [r for r in data["rows"] if r["entry"].startswith("mamba2-ssd-fused-prefill")]
    compiled = [r for r in rows if "skipped" not in r]
    kernels = [r["kernel"] for r in compiled]
    assert kernels.count("_ssd_fused_varlen_kernel") == 4
    for r in compiled:
        sm90 = r["kernel"] == "_ssd_fused_sm90_kernel"
        assert r["entry"] == "mamba2-ssd-fused-prefill" + ("-sm90" if sm90 else "")
        assert 0 < r["regs"] <= 255
        # ptxas keeps every bf16 kernel's wgmma asynchronous; the fp32 case
        # is the one it serializes (accepted, kstats_probe.WGMMA_SERIAL_OK)
        assert bool(r["wgmma_serialized"]) == r["case"].startswith("fp32"), r
        assert 0 < r["smem_bytes"] <= SMEM_LIMIT[90]
        # 4 warps; the warp-specialized sm_90 run kernel 12 (three warpgroups)
        assert r["num_warps"] == (12 if "ws:" in r["case"] else 4)
    # the sm_90 Gluon form: compiled under the Triton releases it supports
    # (3.6, 3.8), else reported as skipped with the reason (never silently
    # dropped)
    if data["triton"].startswith(("3.6.", "3.8.")):
        # runs x 2 on one warpgroup, x 2 warp-specialized (one kernel, WS
        # constexpr)
        assert kernels.count("_ssd_fused_sm90_kernel") == 4
    else:
        (skip,) = [r for r in rows if "skipped" in r]
        assert skip["group"] == "_ssd_fused_sm90_cases"
        assert "needs Triton 3.6/3.8" in skip["skipped"]
        assert "--triton 3.6.0" in skip["skipped"]


@pytest.mark.venv
@needs_venv
def test_shared_memory_over_the_arch_limit_fails_the_case(tmp_path: Path) -> None:
    """sm_89 gives a program 99 KiB: the fp32 case (BLOCK_KB 256 of fp32 B and
    x tiles) needs more, the bf16 cases fit. The command fails and says why."""
    out = tmp_path / "ks.json"
    ssd = ("--entry", "mamba2-ssd-fused-prefill", "--entry", "mamba2-ssd-fused-prefill-sm90")
    p = _cli("--arch", "89", *ssd, "--json", str(out))
    assert p.returncode == 1, p.stdout[-3000:]
    all_rows = json.loads(out.read_text())["rows"]
    (skip,) = [r for r in all_rows if "skipped" in r]
    assert "sm_90 only" in skip["skipped"]
    rows = {r["case"]: r for r in all_rows if "skipped" not in r}
    bad = [name for name, r in rows.items() if "error" in r]
    assert bad and all(name.startswith("fp32") for name in bad), rows
    assert "sm_89 allows 101376" in rows[bad[0]]["error"]
    assert all(r["smem_bytes"] <= SMEM_LIMIT[89] for r in rows.values() if "error" not in r)
    assert "kernel-stats: 3 compiled, 1 failed, 1 group(s) skipped" in p.stdout


def test_an_entry_declares_its_kernel_cases(tmp_path: Path) -> None:
    """The probe loads an entry's case file (series.toml's kernel_cases), whose
    `import kstats_probe` is the probe itself: one CasesSkipped class."""
    from hybrid_stack import kstats_probe

    f = tmp_path / "cases.py"
    f.write_text(
        "import kstats_probe\n"
        "def _group(arch):\n"
        "    raise kstats_probe.CasesSkipped(f'not for sm_{arch}')\n"
        "GROUPS = (_group,)\n"
        "WGMMA_SERIAL_OK = {'a case': 'its reason'}\n"
    )
    groups, ok = kstats_probe.load_cases(f)
    assert ok == {"a case": "its reason"}
    with pytest.raises(kstats_probe.CasesSkipped, match="not for sm_80"):
        groups[0](80)


def test_the_series_names_the_fused_kernels_cases() -> None:
    from hybrid_stack.stack import load_stack

    stack = load_stack(REPO)
    named = {e.name: e.kernel_cases for e in stack.carried if e.kernel_cases}
    assert named == {
        "mamba2-ssd-fused-prefill": "ci/kernel-cases/mamba2-ssd-fused-prefill.py",
        "mamba2-ssd-fused-prefill-sm90": "ci/kernel-cases/mamba2-ssd-fused-prefill-sm90.py",
        "gdn-all-mode-prefill-checkpoints": "ci/kernel-cases/gdn-all-mode-prefill-checkpoints.py",
    }
