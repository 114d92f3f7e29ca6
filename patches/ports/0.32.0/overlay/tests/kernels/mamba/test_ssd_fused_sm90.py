# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for the Hopper (sm_90) Gluon form of the fused Mamba2 SSD prefill.

The GPU tests are the Triton form's (``test_ssd_fused``), imported here and
run on each kernel of the sm_90 form through this module's ``fused_form``
fixture, which passes the launch plan explicitly
(``ssd_fused_sm90.LaunchConfig``): the one-warpgroup run kernel with runs of
3 chunks (runs span sequences and sequences span runs, with state passes
and hand-overs), the warp-specialized kernel with ranges of 3 chunks
(crossing heads) and with the launcher's own plan. A case the sm_90 form
does not take (fp32, headdim other than 64, ...) is skipped here: the Triton
form's tests run it.
"""

import functools

import pytest
import torch

from tests.kernels.mamba.test_ssd_fused import (  # noqa: F401
    FusedForm,
    chunk_metadata,
    make_inputs,
    test_fused_ssd_empty_sequences,
    test_fused_ssd_flag_buffer_kept_and_graphs,
    test_fused_ssd_intermediate_states,
    test_fused_ssd_long_sequence,
    test_fused_ssd_more_chunks_than_resident_ctas,
    test_fused_ssd_vs_chain,
    test_fused_ssd_vs_reference,
    test_launch_key_determines_the_specialization,
    test_launch_skips_only_empty_hooks,
)
from vllm.model_executor.layers.mamba.ops import ssd_fused, ssd_fused_sm90
from vllm.model_executor.layers.mamba.ops.ssd_fused import (
    _mamba_chunk_scan_fused_fwd,
)

requires_gluon = pytest.mark.skipif(
    not ssd_fused_sm90.HAS_GLUON,
    reason="the sm_90 form needs Triton's Gluon in a release of "
    f"{ssd_fused_sm90.GLUON_TRITON_VERSIONS}",
)

SM90_CONFIGS = {
    "sm90-runs": ssd_fused_sm90.LaunchConfig(run_chunks=3, warp_specialize=False),
    "sm90-ws": ssd_fused_sm90.LaunchConfig(run_chunks=3, warp_specialize=True),
    "sm90-ws-default": ssd_fused_sm90.LaunchConfig(warp_specialize=True),
}


@pytest.fixture(params=list(SM90_CONFIGS))
def fused_form(request) -> FusedForm:
    """One kernel of the sm_90 form (skipped off sm_90)."""
    if not (
        ssd_fused_sm90.HAS_GLUON
        and torch.cuda.is_available()
        and ssd_fused_sm90._is_sm90(None)
    ):
        pytest.skip("the sm_90 form needs an sm_90 GPU and Triton's Gluon")
    config = SM90_CONFIGS[request.param]

    def handles(inp: dict[str, torch.Tensor], chunk_size: int) -> bool:
        x = inp["x"]
        return ssd_fused_sm90.supports(
            x, inp["B"], inp["C"], torch.empty_like(x), chunk_size
        )

    return FusedForm(
        request.param,
        functools.partial(_mamba_chunk_scan_fused_fwd, sm90_config=config),
        handles,
    )


def _launch_sm90_form(config: ssd_fused_sm90.LaunchConfig) -> None:
    """A launch of the sm_90 form on small CPU tensors (132 SMs assumed)."""
    lens = [300, 128, 50]
    inp = make_inputs(lens, 16, 64, 2, 64, torch.bfloat16, "cpu")
    x = inp["x"]
    cu, cu_chunk, last, seq_idx = chunk_metadata(lens, 128, "cpu")
    ssd_fused_sm90.launch(
        x, inp["dt"], inp["A"], inp["B"], inp["C"], 128, cu_chunk, last,
        seq_idx, torch.empty_like(x), inp["D_head"], None, inp["dt_bias"], None,
        True, (0.0, float("inf")), None, torch.empty(3, 16, 64, 64),
        torch.tensor([2, 0, 1], dtype=torch.int32), True, config,
    )  # fmt: skip


@pytest.fixture(params=["sm90-ws", "sm90-runs"])
def launch_case(request, monkeypatch):
    """A function making one launch of an sm_90 kernel (CPU tensors)."""
    if not ssd_fused_sm90.HAS_GLUON:
        pytest.skip("the sm_90 form needs Triton's Gluon (Triton 3.6 or 3.8)")
    monkeypatch.setattr(ssd_fused_sm90, "_num_sms", lambda device_index: 132)
    return functools.partial(_launch_sm90_form, SM90_CONFIGS[request.param])


def test_sm90_form_is_the_default_where_supported(monkeypatch):
    """mamba_chunk_scan_fused_varlen takes the sm_90 form wherever
    ``supports`` holds, and the Triton form elsewhere."""
    got = []

    def spy(*args, sm90_config=None, **kwargs):
        got.append(sm90_config)

    monkeypatch.setattr(ssd_fused, "_mamba_chunk_scan_fused_fwd", spy)
    monkeypatch.setattr(ssd_fused.platforms.current_platform, "is_cpu", lambda: False)
    lens = [300, 50]
    inp = make_inputs(lens, 4, 64, 1, 64, torch.bfloat16, "cpu")
    cu, cu_chunk, last, seq_idx = chunk_metadata(lens, 128, "cpu")
    for supported in (True, False):
        monkeypatch.setattr(ssd_fused_sm90, "supports", lambda *a, _s=supported: _s)
        ssd_fused.mamba_chunk_scan_fused_varlen(
            inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 128, cu, cu_chunk,
            last, seq_idx, torch.empty_like(inp["x"]),
        )  # fmt: skip
    assert got == [ssd_fused_sm90.DEFAULT_CONFIG, None]


def test_gluon_gate_is_the_triton_release():
    """The sm_90 form is available exactly under the Triton releases it is
    written and tested for (3.6 and 3.8), so that no other release runs it."""
    import triton

    release = ".".join(triton.__version__.split(".")[:2])
    assert ssd_fused_sm90.GLUON_TRITON_VERSIONS == ("3.6", "3.8")
    assert (release in ("3.6", "3.8")) == ssd_fused_sm90.HAS_GLUON


def test_launch_config_is_checked():
    with pytest.raises(ValueError, match="run_chunks"):
        ssd_fused_sm90.LaunchConfig(run_chunks=0)


@pytest.mark.parametrize(
    "n_chunks,nheads,expect",
    [
        (64, 128, 32),  # 2 runs per head, one per program slot
        (65, 128, 33),
        (64, 80, 22),  # 3 runs per head
        (1, 128, 1),
        (64, 8, 2),  # 33 runs per head
        (64, 300, 64),  # more heads than slots: one run per head
    ],
)
def test_run_length(n_chunks, nheads, expect):
    """The one-warpgroup run kernel splits every head's chunks into
    slots // heads runs (264 program slots: 2 x 132 SMs), one wave."""
    assert ssd_fused_sm90.run_length(n_chunks, nheads, 264) == expect
