# SPDX-License-Identifier: Apache-2.0
"""Benchmark: Gated-DeltaNet chunk prefill (the FLA chunk kernel of Qwen3-Next).

Baseline: ``chunk_gated_delta_rule`` from vllm.third_party.flash_linear_attention.
ops, called as ``QwenGatedDeltaNet`` calls it for prefills: varlen (batch 1,
``cu_seqlens``, precomputed chunk indices/offsets), initial states from the
cache, final states returned, ``use_qk_l2norm_in_kernel=False`` (q/k arrive
normalised). Dims: 16 q/k heads, 32 v heads, head dim 128, bf16 q/k/v, fp32
log-space gates g, bf16 beta, fp32 states. The stack has no kernel of its own
yet (a later issue adds the all-mode checkpoint export), so value == baseline.
"""

from __future__ import annotations

import argparse
from typing import Any

try:
    from hybrid_stack.bench import common
except ImportError:  # run as a script from an unpacked bundle
    import common  # type: ignore[no-redef]

BENCH = "gdn_prefill"
QK_HEADS, V_HEADS, HEAD_DIM = 16, 32, 128
CASES = ((1, 8192), (1, 32768), (4, 8192))  # (sequences, tokens per sequence)


class Inputs:
    def __init__(self, seqs: int, seqlen: int, gen: Any) -> None:
        import torch
        import torch.nn.functional as F
        from vllm.third_party.flash_linear_attention.ops.index import (
            prepare_chunk_indices,
            prepare_chunk_offsets,
        )
        from vllm.third_party.flash_linear_attention.ops.utils import FLA_CHUNK_SIZE

        T = seqs * seqlen
        dev, bf16 = "cuda", torch.bfloat16

        def randn(*shape: int) -> Any:
            return torch.randn(*shape, device=dev, generator=gen)

        self.q = F.normalize(randn(1, T, QK_HEADS, HEAD_DIM), dim=-1).to(bf16)
        self.k = F.normalize(randn(1, T, QK_HEADS, HEAD_DIM), dim=-1).to(bf16)
        self.v = randn(1, T, V_HEADS, HEAD_DIM).to(bf16)
        self.g = F.logsigmoid(randn(1, T, V_HEADS) + 3.0)  # fp32, mostly near 0
        self.beta = torch.sigmoid(randn(1, T, V_HEADS)).to(bf16)
        self.h0 = randn(seqs, V_HEADS, HEAD_DIM, HEAD_DIM) * 0.1
        self.cu_seqlens = torch.arange(0, T + 1, seqlen, device=dev, dtype=torch.int32)
        self.chunk_indices = prepare_chunk_indices(self.cu_seqlens, FLA_CHUNK_SIZE)
        self.chunk_offsets = prepare_chunk_offsets(self.cu_seqlens, FLA_CHUNK_SIZE)

    def run(self, fn: Any, **extra: Any) -> Any:
        """``fn`` called as the GDN layer calls the chunk prefill (``extra``:
        further keyword arguments, e.g. the checkpoint export)."""
        return fn(
            q=self.q,
            k=self.k,
            v=self.v,
            g=self.g,
            beta=self.beta,
            initial_state=self.h0,
            output_final_state=True,
            cu_seqlens=self.cu_seqlens,
            chunk_indices=self.chunk_indices,
            chunk_offsets=self.chunk_offsets,
            use_qk_l2norm_in_kernel=False,
            **extra,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_output_args(parser)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    import torch
    from vllm.third_party.flash_linear_attention.ops import chunk_gated_delta_rule

    if not torch.cuda.is_available():
        raise SystemExit(f"{BENCH}: needs a CUDA device")
    reps = 5 if args.quick else args.reps
    timer = common.Timer()
    gen = torch.Generator(device="cuda").manual_seed(777)
    rows = []
    cases = CASES[:1] if args.quick else CASES
    for seqs, seqlen in cases:
        sets = [Inputs(seqs, seqlen, gen) for _ in range(2)]
        o, ht = sets[0].run(chunk_gated_delta_rule)
        if not (torch.isfinite(o).all() and torch.isfinite(ht).all()):
            raise SystemExit(f"{BENCH}: non-finite output at {seqs}x{seqlen}")
        ms = timer.median_ms(lambda i, s=sets: s[i % 2].run(chunk_gated_delta_rule), reps=reps)
        tokens = seqs * seqlen
        tps = tokens / (ms * 1e-3)
        rows.append(
            common.make_row(
                {"tokens": tokens, "seqs": seqs, "seqlen": seqlen},
                "tok_per_s",
                tps,
                tps,
                ms,
                ms,
            )
        )
        print(f"  {seqs} x {seqlen}: {ms:.3f} ms  {tps / 1e6:.2f}M tok/s")
        del sets, o, ht
        torch.cuda.empty_cache()
    result = common.make_result(
        BENCH,
        rows,
        timing=timer.method,
        stack_kernel=None,
        notes={
            "dims": f"{QK_HEADS} q/k heads, {V_HEADS} v heads, head dim {HEAD_DIM}",
            "value": "no stack kernel yet: value == baseline",
        },
    )
    common.finish(result, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
