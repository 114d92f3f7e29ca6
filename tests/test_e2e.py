# SPDX-License-Identifier: Apache-2.0
"""The GPU bundle's end-to-end harness (bundle_data/e2e), on the CPU.

What runs here: the op-schema extraction from csrc and the builder's refusals,
the bundle's e2e contents and runner options, and, in an interpreter with
torch and vLLM's dependencies (the lean build venv, as CI has it), the checks
of tests/in_venv/e2e_checks.py against the bundled copies: each compiled-op
shim against the op's semantics, the model configs through vLLM's config
classes, the engine arguments through EngineArgs, the weight redraw and the
results writer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_bundle import ROOT, TREE, built, needs_tree, runtime_python, wheel_dir  # noqa: F401

from hybrid_stack import bundle
from hybrid_stack.errors import StackError

CHECKS = Path(__file__).parent / "in_venv" / "e2e_checks.py"

BINDINGS = """
STABLE_TORCH_LIBRARY_FRAGMENT(_C, ops) {
  ops.def("weak_ref_tensor(Tensor input) -> Tensor");
  ops.def(
      "silu_and_mul(Tensor! result, "
      "Tensor input) -> ()");
  ops.def("gemma_rms_norm(Tensor! out, Tensor x) -> ()", {at::Tag::pt2_compliant_tag});
}
STABLE_TORCH_LIBRARY_IMPL(_C, CUDA, ops) {
  ops.impl("silu_and_mul", TORCH_BOX(&silu_and_mul));
}
STABLE_TORCH_LIBRARY_FRAGMENT(_C_cache_ops, cache_ops) {
  cache_ops.def("swap_blocks(Tensor src, Tensor! dst) -> ()");
}
"""


def test_op_schemas_join_literals_per_namespace():
    schemas = bundle.op_schemas(BINDINGS)
    assert schemas == {
        "_C": {
            "weak_ref_tensor": "weak_ref_tensor(Tensor input) -> Tensor",
            "silu_and_mul": "silu_and_mul(Tensor! result, Tensor input) -> ()",
            "gemma_rms_norm": "gemma_rms_norm(Tensor! out, Tensor x) -> ()",
        },
        "_C_cache_ops": {"swap_blocks": "swap_blocks(Tensor src, Tensor! dst) -> ()"},
    }


def fake_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lookup: list[str]) -> Path:
    tree = tmp_path / "tree"
    (tree / "csrc").mkdir(parents=True)
    (tree / "csrc" / "torch_bindings.cpp").write_text(BINDINGS)
    (tree / "vllm").mkdir()
    (tree / "vllm" / "layernorm.py").write_text(
        'if hasattr(torch.ops._C, "gemma_rms_norm"):\n    pass\n'
    )
    e2e = tmp_path / "e2e"
    e2e.mkdir()
    table = ", ".join(f'"{n}": "why"' for n in lookup)
    (e2e / "compiled_ops.py").write_text(
        'IMPLEMENTED: dict[str, tuple] = {"weak_ref_tensor": (None, "why")}\n'
        f"LOOKUP_ONLY: dict[str, str] = {{{table}}}\n"
    )
    monkeypatch.setattr(bundle, "E2E_DIR", e2e)
    return tree


def test_e2e_op_schemas_carry_the_trees_schemas(tmp_path: Path, monkeypatch):
    tree = fake_tree(tmp_path, monkeypatch, ["silu_and_mul"])
    data = json.loads(bundle.e2e_op_schemas(tree))
    assert data == bundle.op_schemas(BINDINGS)


def test_e2e_op_schemas_refuse_an_op_csrc_lacks(tmp_path: Path, monkeypatch):
    tree = fake_tree(tmp_path, monkeypatch, ["silu_and_mul", "no_such_op"])
    with pytest.raises(StackError, match="no_such_op"):
        bundle.e2e_op_schemas(tree)


def test_e2e_op_schemas_refuse_an_op_vllm_probes(tmp_path: Path, monkeypatch):
    tree = fake_tree(tmp_path, monkeypatch, ["gemma_rms_norm"])
    with pytest.raises(StackError, match="hasattr.*drop them"):
        bundle.e2e_op_schemas(tree)


@needs_tree
def test_the_shims_fit_the_applied_tree():
    """The real shim list: every op is in csrc, none is one vLLM probes."""
    names = bundle.shim_names(bundle.E2E_DIR / "compiled_ops.py")
    assert "weak_ref_tensor" in names
    schemas = json.loads(bundle.e2e_op_schemas(TREE))["_C"]
    assert set(names) <= set(schemas)


@needs_tree
def test_bundle_carries_the_harness(built: Path):  # noqa: F811
    manifest = json.loads((built / "manifest.json").read_text())
    models = sorted(p.name for p in (bundle.E2E_DIR / "models").iterdir())
    assert manifest["e2e_models"] == models
    for m in models:
        assert (built / "e2e" / "models" / m / "config.json").is_file()
    for name, ids in bundle.E2E_SELECTIONS.items():
        assert manifest["selections"][name] == ids
        assert name in manifest["serial_selections"]
        assert all((built / i).is_file() for i in ids)
    schemas = json.loads((built / "e2e" / "op_schemas.json").read_text())
    assert schemas == json.loads(bundle.e2e_op_schemas(TREE))


@needs_tree
def test_runner_lists_and_rejects_e2e_models(built: Path):  # noqa: F811
    p = subprocess.run(
        [sys.executable, "run.py", "--list"], cwd=built, capture_output=True, text=True
    )
    assert p.returncode == 0
    manifest = json.loads((built / "manifest.json").read_text())
    assert "end-to-end models: " + ", ".join(manifest["e2e_models"]) in p.stdout
    bad = subprocess.run(
        [sys.executable, "run.py", "--e2e", "no-such-model"],
        cwd=built,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "unknown end-to-end model 'no-such-model'" in bad.stderr


@needs_tree
def test_in_venv_checks(built: Path, tmp_path: Path):  # noqa: F811
    py = runtime_python()
    if py is None:
        pytest.skip("no interpreter with torch + vLLM's deps (build the lean venv)")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(str(built / d) for d in ("src", "e2e", "bench")),
        CUDA_VISIBLE_DEVICES="",
        HF_HUB_OFFLINE="1",
        VLLM_TARGET_DEVICE="cpu",
        HYBRID_STACK_TREE=str(TREE),
    )
    p = subprocess.run(
        [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", CHECKS],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert " passed" in p.stdout.splitlines()[-1] and "skipped" not in p.stdout.splitlines()[-1]
