# SPDX-License-Identifier: Apache-2.0
"""Benchmark: GDN chunk prefill with vs without block-boundary checkpoints.

The stack's entry ``gdn-all-mode-prefill-checkpoints`` lets
``chunk_gated_delta_rule`` (vllm.third_party.flash_linear_attention.ops) write
the state at every block boundary inside a prefill into that block's state
slot, in the same pass (``checkpoints=ChunkStateCheckpoints(...)``). Baseline:
the same call without checkpoints (the kernel compiles to its 0.33.0 form);
value: with checkpoints, every sequence starting at position 0, one
block-table row of distinct slots per sequence, a state cache
``[slots, 32, 128, 128]`` in fp32 and in bf16 (case field ``state_dtype``:
vLLM's ``mamba_ssm_cache_dtype="auto"`` gives a bf16 model a bf16 GDN state
unless its config asks for another, as Qwen3.5's ``mamba_ssm_dtype`` asks for
fp32). Called as ``QwenGatedDeltaNet`` calls it for
prefills (varlen, precomputed chunk indices / offsets, initial states, final
states, q/k already normalised). Dims: 16 q/k heads, 32 v heads, head dim 128
(Qwen3.5-9B-like / Qwen3-Next), bf16 q/k/v, fp32 gates, bf16 beta; block sizes
576 and 4 x 576.

Per case: ``tok_per_s`` from wall time (CUDA events, back-to-back calls, L2
flushed, two rotating input sets, samples of the two variants interleaved),
and beside it the GPU time per call from a CUDA-graph replay
(``baseline_graph_ms`` / ``value_graph_ms``, one input set), which leaves out
the host's launch cost. Before timing, each case checks that outputs and final
states are bit-identical with and without checkpoints and that exactly the
boundary slots were written.
"""

from __future__ import annotations

import argparse
import itertools
import math
from typing import Any

try:
    from hybrid_stack.bench import common, gdn_prefill
except ImportError:  # run as a script from an unpacked bundle
    import common  # type: ignore[no-redef]
    import gdn_prefill  # type: ignore[no-redef]

BENCH = "gdn_checkpoint"
QK_HEADS, V_HEADS, HEAD_DIM = gdn_prefill.QK_HEADS, gdn_prefill.V_HEADS, gdn_prefill.HEAD_DIM
CASES = ((1, 8192), (1, 32768), (4, 8192), (1, 131072))  # (sequences, tokens each)
BLOCK_SIZES = (576, 2304)
# the state cache's dtype: case field state_dtype -> torch dtype name
STATE_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
DEVICE = "cuda"


class Inputs(gdn_prefill.Inputs):
    """gdn_prefill's inputs (same dims and distributions); ``run`` optionally
    with the checkpoint export."""

    def run(self, fn: Any, checkpoints: Any = None) -> Any:
        extra = {} if checkpoints is None else {"checkpoints": checkpoints}
        return super().run(fn, **extra)


def make_checkpoints(
    seqs: int, seqlen: int, block_size: int, state_dtype: str = "fp32"
) -> tuple[Any, list[int]]:
    """State cache (NaN-filled, ``state_dtype`` a key of STATE_DTYPES) and
    block table for ``seqs`` prefills from position 0; returns them and the
    slots the boundaries must fill."""
    import torch
    from vllm.third_party.flash_linear_attention.ops import ChunkStateCheckpoints

    blocks = math.ceil(seqlen / block_size)
    slots = 1 + torch.arange(seqs * blocks, dtype=torch.int32, device=DEVICE)
    table = slots.view(seqs, blocks)
    states = torch.full(
        (1 + seqs * blocks, V_HEADS, HEAD_DIM, HEAD_DIM),
        math.nan,
        device=DEVICE,
        dtype=getattr(torch, STATE_DTYPES[state_dtype]),
    )
    num_computed = torch.zeros(seqs, dtype=torch.int32, device=DEVICE)
    boundaries = (seqlen - 1) // block_size  # block boundaries strictly inside
    expected = [int(table[n, b]) for n in range(seqs) for b in range(boundaries)]
    return ChunkStateCheckpoints(states, table, num_computed, block_size), expected


def check(inputs: Inputs, fn: Any, ckpt: Any, expected: list[int], label: str) -> None:
    import torch

    o0, ht0 = inputs.run(fn)
    o1, ht1 = inputs.run(fn, ckpt)
    if not (torch.equal(o0, o1) and torch.equal(ht0, ht1)):
        raise SystemExit(f"{BENCH}: outputs differ with checkpoints at {label}")
    written = torch.isfinite(ckpt.states).flatten(1).all(1).nonzero().flatten().tolist()
    untouched = torch.isnan(ckpt.states).flatten(1).all(1).sum().item()
    if sorted(written) != sorted(expected) or untouched != ckpt.states.shape[0] - len(expected):
        raise SystemExit(f"{BENCH}: wrong checkpoint slots written at {label}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_output_args(parser)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument(
        "--block-sizes",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        default=BLOCK_SIZES,
        help="comma-separated mamba block sizes (multiples of 64)",
    )
    parser.add_argument(
        "--state-dtypes",
        type=lambda s: tuple(s.split(",")),
        default=tuple(STATE_DTYPES),
        help=f"comma-separated state cache dtypes, of {', '.join(STATE_DTYPES)}",
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.state_dtypes) - set(STATE_DTYPES))
    if unknown:
        parser.error(f"unknown state dtype(s) {', '.join(unknown)} (of {', '.join(STATE_DTYPES)})")
    import torch
    from vllm.third_party.flash_linear_attention.ops import chunk_gated_delta_rule

    if not torch.cuda.is_available():
        raise SystemExit(f"{BENCH}: needs a CUDA device")
    reps = 5 if args.quick else args.reps
    timer = common.Timer()
    gen = torch.Generator(device="cuda").manual_seed(777)
    fn = chunk_gated_delta_rule
    rows = []
    cases = CASES[:1] if args.quick else CASES
    for seqs, seqlen in cases:
        sets = [Inputs(seqs, seqlen, gen) for _ in range(2)]
        for block_size, state_dtype in itertools.product(args.block_sizes, args.state_dtypes):
            label = f"{seqs}x{seqlen} block {block_size} {state_dtype} state"
            ckpt, expected = make_checkpoints(seqs, seqlen, block_size, state_dtype)
            check(sets[0], fn, ckpt, expected, label)
            base_ms, value_ms = timer.paired_median_ms(
                [
                    lambda i, s=sets: s[i % 2].run(fn),
                    lambda i, s=sets, c=ckpt: s[i % 2].run(fn, c),
                ],
                reps=reps,
            )
            graph: dict[str, float] = {}
            try:
                graph["baseline_graph_ms"] = timer.graph_ms(lambda s=sets: s[0].run(fn))
                graph["value_graph_ms"] = timer.graph_ms(lambda s=sets, c=ckpt: s[0].run(fn, c))
                graph["graph_ratio"] = graph["baseline_graph_ms"] / graph["value_graph_ms"]
            except Exception as e:  # capture can fail on some torch/triton pairs
                print(f"  {label}: CUDA graph timing failed: {e!r}")
                graph = {"baseline_graph_ms": math.nan, "value_graph_ms": math.nan}
            tokens = seqs * seqlen
            rows.append(
                common.make_row(
                    {
                        "tokens": tokens,
                        "seqs": seqs,
                        "seqlen": seqlen,
                        "block_size": block_size,
                        "state_dtype": state_dtype,
                        "checkpoints": len(expected),
                    },
                    "tok_per_s",
                    tokens / (base_ms * 1e-3),
                    tokens / (value_ms * 1e-3),
                    base_ms,
                    value_ms,
                    **graph,
                )
            )
            print(
                f"  {label}: {len(expected)} checkpoints  wall {base_ms:.3f} -> "
                f"{value_ms:.3f} ms ({base_ms / value_ms:.4f}x)  graph "
                f"{graph['baseline_graph_ms']:.3f} -> {graph['value_graph_ms']:.3f} ms"
            )
            common.write_partial(common.make_result(BENCH, rows), args)
            del ckpt
        del sets
        torch.cuda.empty_cache()
    result = common.make_result(
        BENCH,
        rows,
        timing=timer.method
        + "; beside it GPU time per call from one CUDA-graph replay of 100 calls "
        "(*_graph_ms, graph_ratio = baseline / value)",
        stack_kernel="chunk_gated_delta_rule(checkpoints=ChunkStateCheckpoints)",
        # the kernel's module is upstream's: pr-stack links the result by name
        entry="gdn-all-mode-prefill-checkpoints",
        notes={
            "dims": f"{QK_HEADS} q/k heads, {V_HEADS} v heads, head dim {HEAD_DIM}",
            "baseline": "chunk_gated_delta_rule without checkpoints",
            "value": "the same call writing the state at every block boundary into "
            "a state cache of the case's state_dtype (fp32 or bf16; prefills from "
            "position 0)",
        },
    )
    common.finish(result, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
