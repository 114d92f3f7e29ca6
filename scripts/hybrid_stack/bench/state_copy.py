# SPDX-License-Identifier: Apache-2.0
"""Benchmark: mamba state copy (``postprocess_mamba_fused_kernel``).

Launches the kernel exactly as ``MambaGPUContext.run_fused_postprocess`` does
(grid ``(num_reqs, num_states, _TEMPORAL_TILES)``, ``COPY_BLOCK_SIZE=1024``) on a
Qwen3.5-9B-like cache: 24 GDN layers, each with one page per block holding the
conv state (bf16, 5 tokens x 8192, 80 KiB, SD layout) then the temporal state
(fp32 32x128x128, 2 MiB): 49.9 MiB per request. Every request copies its block
in column 0 to a distinct block in column 1 (no accepted-token bias), so each
request moves all of its state. Bytes counted: read + written.

Reported per request count: GB/s and % of a device-to-device ``torch`` copy of
1 GiB measured in the same process. The copy is verified byte-for-byte (poisoned
destinations) before timing. The stack carries no kernel of its own here (the
entry ``mamba-state-copy-u64`` is upstreamed), so value == baseline.
"""

from __future__ import annotations

import argparse
from typing import Any

try:
    from hybrid_stack.bench import common
except ImportError:  # run as a script from an unpacked bundle
    import common  # type: ignore[no-redef]

BENCH = "state_copy"
LAYERS = 24
TEMPORAL_SHAPE = (32, 128, 128)  # fp32
CONV_TOKENS, CONV_DIM = 5, 8192  # bf16, SD layout (token-major)
BLOCK_SIZE = 1024  # tokens per mamba block (only the decision arithmetic uses it)
REQUESTS = (1, 4, 8, 16, 32, 64, 128)
POOL_BLOCKS = 520  # per layer: rotation sets of 2 blocks/request fit in this


class StateCache:
    """24 per-layer page pools plus the flattened kernel metadata."""

    def __init__(self, num_blocks: int) -> None:
        import torch

        self.conv_bytes = CONV_TOKENS * CONV_DIM * 2
        self.temporal_bytes = 4 * TEMPORAL_SHAPE[0] * TEMPORAL_SHAPE[1] * TEMPORAL_SHAPE[2]
        self.page_bytes = self.conv_bytes + self.temporal_bytes
        self.pools = []
        for _ in range(LAYERS):
            pool = torch.empty(num_blocks, self.page_bytes, dtype=torch.uint8, device="cuda")
            pool.view(torch.int32).random_()
            self.pools.append(pool)
        n = 2 * LAYERS
        dev = "cuda"
        base, stride, elem, inner, width = [], [], [], [], []
        for pool in self.pools:
            # conv: [nb, 5, 8192] bf16 at page offset 0
            base.append(pool.data_ptr())
            stride.append(self.page_bytes)
            elem.append(2)
            inner.append(CONV_DIM)
            width.append(CONV_TOKENS)
            # temporal: [nb, 32, 128, 128] fp32 after the conv state
            base.append(pool.data_ptr() + self.conv_bytes)
            stride.append(self.page_bytes)
            elem.append(4)
            inner.append(self.temporal_bytes // 4)
            width.append(0)
        self.num_states = n
        self.base = torch.tensor(base, dtype=torch.int64, device=dev)
        self.stride = torch.tensor(stride, dtype=torch.int64, device=dev)
        self.elem = torch.tensor(elem, dtype=torch.int32, device=dev)
        self.inner = torch.tensor(inner, dtype=torch.int64, device=dev)
        self.width = torch.tensor(width, dtype=torch.int32, device=dev)
        self.group = torch.zeros(n, dtype=torch.int32, device=dev)
        self.dim_rows = torch.zeros(n, dtype=torch.int32, device=dev)
        self.dim_row_stride = torch.zeros(n, dtype=torch.int64, device=dev)

    @property
    def bytes_per_request(self) -> int:
        return LAYERS * self.page_bytes


class Launch:
    """One rotation set: R requests, each copying block bt[r,0] -> bt[r,1]."""

    def __init__(self, cache: StateCache, block_ids: Any, num_reqs: int) -> None:
        import torch

        self.cache = cache
        self.num_reqs = num_reqs
        self.bt = block_ids.view(num_reqs, 2).to(torch.int32).contiguous()
        self.bt_ptrs = torch.tensor([self.bt.data_ptr()], dtype=torch.int64, device="cuda")
        ones = torch.ones(num_reqs, dtype=torch.int32, device="cuda")
        self.num_accepted = ones.clone()
        self.state_idx = torch.zeros(num_reqs, dtype=torch.int32, device="cuda")
        # running = computed + scheduled - draft = 2 * BLOCK_SIZE, which is block
        # aligned: dest column = 1, token bias 0.
        self.scheduled = ones * BLOCK_SIZE
        self.computed = ones * BLOCK_SIZE
        self.draft = torch.zeros(num_reqs, dtype=torch.int32, device="cuda")
        self.accepted_out = ones.clone()

    def __call__(self) -> None:
        from vllm.v1.worker.mamba_utils import (
            _TEMPORAL_TILES,
            postprocess_mamba_fused_kernel,
        )

        c = self.cache
        grid = (self.num_reqs, c.num_states, _TEMPORAL_TILES)
        postprocess_mamba_fused_kernel[grid](
            self.num_accepted,
            self.state_idx,
            self.scheduled,
            self.computed,
            self.draft,
            self.bt_ptrs,
            self.bt.stride(0),
            c.base,
            c.stride,
            c.elem,
            c.inner,
            c.width,
            c.group,
            c.dim_rows,
            c.dim_row_stride,
            self.accepted_out,
            None,
            self.num_reqs,
            block_size=BLOCK_SIZE,
            COPY_BLOCK_SIZE=1024,
            CONV_STATE_DIM_FIRST=False,
            TEMPORAL_TILES=_TEMPORAL_TILES,
        )

    def verify(self) -> None:
        """Poison the destinations, copy once, compare byte-for-byte."""
        import torch

        src, dst = self.bt[:, 0].long(), self.bt[:, 1].long()
        for pool in self.cache.pools:
            pool[dst] = torch.randint_like(pool[dst], 0, 256)
        torch.cuda.synchronize()
        self()
        torch.cuda.synchronize()
        for layer, pool in enumerate(self.cache.pools):
            if not torch.equal(pool[dst], pool[src]):
                bad = (pool[dst] != pool[src]).sum().item()
                raise SystemExit(
                    f"{BENCH}: copy mismatch at {self.num_reqs} requests, layer "
                    f"{layer}: {bad} bytes differ"
                )


def d2d_gbps(timer: common.Timer, nbytes: int = 1 << 30) -> tuple[float, float]:
    import torch

    srcs = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    for s in srcs:
        s.view(torch.int32).random_()
    dst = torch.empty_like(srcs[0])
    ms = timer.median_ms(lambda i: dst.copy_(srcs[i % 2]), reps=30)
    dst.copy_(srcs[0])
    if not torch.equal(dst, srcs[0]):
        raise SystemExit(f"{BENCH}: torch device-to-device copy check failed")
    return 2 * nbytes / (ms * 1e-3) / 1e9, ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_output_args(parser)
    parser.add_argument("--requests", type=int, nargs="*", default=list(REQUESTS))
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"{BENCH}: needs a CUDA device")
    reqs = [r for r in args.requests if r <= 32] if args.quick else args.requests
    reps = 10 if args.quick else args.reps
    timer = common.Timer()
    d2d, d2d_ms = d2d_gbps(timer)
    print(f"device-to-device torch copy (1 GiB): {d2d:.0f} GB/s ({d2d_ms:.3f} ms)")
    blocks = min(POOL_BLOCKS, 2 * max(reqs) * 4 + 8)
    cache = StateCache(blocks)
    gen = torch.Generator(device="cuda").manual_seed(1234)
    rows = []
    for r in reqs:
        sets = max(1, min(4, blocks // (2 * r)))
        launches = []
        for _ in range(sets):
            ids = torch.randperm(blocks, device="cuda", generator=gen)[: 2 * r]
            launches.append(Launch(cache, ids, r))
        for launch in launches:
            launch.verify()
        ms = timer.median_ms(lambda i, ls=launches: ls[i % len(ls)](), reps=reps)
        moved = 2 * r * cache.bytes_per_request
        gbps = moved / (ms * 1e-3) / 1e9
        pct = 100.0 * gbps / d2d
        rows.append(
            common.make_row(
                {"requests": r, "mib_per_request": round(cache.bytes_per_request / 2**20, 2)},
                "pct_of_d2d",
                pct,
                pct,
                ms,
                ms,
                baseline_gbps=gbps,
                value_gbps=gbps,
                rotation_sets=sets,
            )
        )
        print(f"  {r:4d} requests: {ms:.4f} ms  {gbps:7.0f} GB/s  {pct:5.1f}% of D2D")
    result = common.make_result(
        BENCH,
        rows,
        timing=timer.method,
        d2d_gbps=d2d,
        d2d_ms=d2d_ms,
        stack_kernel=None,
        notes={
            "layout": "24 GDN layers; page = conv bf16 (5x8192, SD) + temporal fp32 "
            "(32x128x128); distinct src/dst blocks per request; verified byte-for-byte",
            "bytes": "read + written; GB/s = 1e9 bytes/s",
            "value": "the stack carries no state-copy kernel (entry upstreamed): value == baseline",
        },
    )
    common.finish(result, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
