# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prefix caching for a hybrid (full attention + GDN) model with
`mamba_cache_mode="all"`: a Mamba state is kept for every full block of the
prompt, so prefix hits land on any block boundary."""

import random
from types import SimpleNamespace

import pytest
import torch

from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.core.single_type_kv_cache_manager import MambaManager
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    get_mamba_all_mode_state_slots,
    get_mamba_chunk_aligned_prefill_end,
)
from vllm.v1.request import Request

from .test_prefix_caching import make_request

pytestmark = pytest.mark.cpu_test

BLOCK_SIZE = 128
KERNEL_CHUNK = 64
ATTN_GROUP, MAMBA_GROUP = 0, 1


@pytest.fixture(autouse=True)
def _init_none_hash() -> None:
    init_none_hash(sha256)


def _make_manager(
    mode: str = "all",
    num_blocks: int = 400,
    num_speculative_blocks: int = 0,
    use_eagle: bool = False,
    retention_interval: int | None = 0,
    num_hash_lookahead_tokens: int = 0,
) -> KVCacheManager:
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["full_attn"],
                FullAttentionSpec(
                    block_size=BLOCK_SIZE,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(
                ["gdn"],
                MambaSpec(
                    block_size=BLOCK_SIZE,
                    shapes=((1, 1),),
                    dtypes=(torch.float32,),
                    mamba_cache_mode=mode,
                    num_speculative_blocks=num_speculative_blocks,
                ),
            ),
        ],
        # The engine's default (CacheConfig.prefix_cache_retention_interval).
        prefix_cache_retention_interval=retention_interval,
    )
    return KVCacheManager(
        config,
        max_model_len=16384,
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        enable_caching=True,
        use_eagle=use_eagle,
        num_prefill_lookahead=num_hash_lookahead_tokens,
        num_hash_lookahead_tokens=num_hash_lookahead_tokens,
    )


def _prefill(
    manager: KVCacheManager,
    request: Request,
    budget: int,
    num_lookahead_tokens: int = 0,
) -> int:
    """Prefill ``request`` with kernel-chunk-aligned chunks (the "all" mode
    split); returns the prefix-cache hit length."""
    blocks, num_hit, _ = manager.get_computed_blocks(request)
    request.num_computed_tokens = 0
    num_new_computed = num_hit
    new_computed_blocks = blocks
    while request.num_computed_tokens + num_new_computed < request.num_prompt_tokens:
        start = request.num_computed_tokens + num_new_computed
        end = get_mamba_chunk_aligned_prefill_end(
            start,
            min(start + budget, request.num_prompt_tokens),
            request.num_prompt_tokens,
            KERNEL_CHUNK,
        )
        assert end > start
        new_blocks = manager.allocate_slots(
            request,
            end - start,
            num_new_computed,
            new_computed_blocks,
            num_lookahead_tokens=num_lookahead_tokens,
        )
        assert new_blocks is not None
        # As the scheduler does after a step's admissions.
        manager.fill_checkpoint_slots()
        request.num_computed_tokens = end
        num_new_computed, new_computed_blocks = 0, None
        manager.new_step_starts()
    return num_hit


def _prompt(shared: list[int], total_len: int, salt: int) -> list[int]:
    return shared + [100_000 * (salt + 1) + i for i in range(total_len - len(shared))]


def _mamba_blocks(manager: KVCacheManager, request_id: str):
    return manager.get_blocks(request_id).blocks[MAMBA_GROUP]


@pytest.mark.parametrize("lookahead", [0, 1])
def test_hits_at_every_block_boundary(lookahead: int) -> None:
    """Also with MTP's lookahead hashes (the default EAGLE/MTP path when
    prefix caching is on), which replace the last-block drop."""
    manager = _make_manager(num_hash_lookahead_tokens=lookahead)
    base = list(range(10 * BLOCK_SIZE + 37))
    producer = make_request(
        "producer", base, BLOCK_SIZE, sha256, num_hash_lookahead_tokens=lookahead
    )
    _prefill(manager, producer, budget=3 * BLOCK_SIZE + KERNEL_CHUNK)
    manager.free(producer)

    for num_shared in range(1, len(base), 61):
        request = make_request(
            f"r{num_shared}",
            _prompt(base[:num_shared], len(base) + 50, num_shared),
            BLOCK_SIZE,
            sha256,
            num_hash_lookahead_tokens=lookahead,
        )
        blocks, num_hit, _ = manager.get_computed_blocks(request)
        # Ideal: the shared prefix rounded down to a block (a lookahead hash
        # also proves the token after the block).
        assert num_hit == (num_shared - lookahead) // BLOCK_SIZE * BLOCK_SIZE
        if num_hit:
            mamba_hit = blocks.blocks[MAMBA_GROUP]
            assert len(mamba_hit) == num_hit // BLOCK_SIZE
            # The state for the last hit block is a real, cached block.
            assert not mamba_hit[-1].is_null
            assert mamba_hit[-1].block_hash is not None


@pytest.mark.parametrize("mode", ["align", "all"])
def test_all_mode_keeps_every_full_block_state(mode: str) -> None:
    """After a chunked prefill, "all" mode has a cached Mamba state for every
    full prompt block; "align" keeps only the step boundaries."""
    manager = _make_manager(mode=mode)
    prompt_len = 9 * BLOCK_SIZE + 5
    request = make_request("a", list(range(prompt_len)), BLOCK_SIZE, sha256)
    # "align" needs block-aligned chunks; 2 blocks per step suits both modes.
    _prefill(manager, request, budget=2 * BLOCK_SIZE)
    full_blocks = prompt_len // BLOCK_SIZE
    num_hits = 0
    for k in range(1, full_blocks + 1):
        probe = make_request(
            f"probe{k}",
            _prompt(list(range(k * BLOCK_SIZE)), prompt_len + 1, k),
            BLOCK_SIZE,
            sha256,
        )
        _, num_hit, _ = manager.get_computed_blocks(probe)
        num_hits += num_hit == k * BLOCK_SIZE
    if mode == "all":
        assert num_hits == full_blocks
    else:
        assert num_hits < full_blocks


def test_retention_interval_sparsifies_only_when_positive() -> None:
    manager = _make_manager(retention_interval=4 * BLOCK_SIZE)
    base = list(range(9 * BLOCK_SIZE))
    _prefill(manager, make_request("a", base, BLOCK_SIZE, sha256), 2 * BLOCK_SIZE)
    hits = []
    for k in range(1, 9):
        probe = make_request(
            f"p{k}",
            _prompt(base[: k * BLOCK_SIZE], 10 * BLOCK_SIZE, k),
            BLOCK_SIZE,
            sha256,
        )
        hits.append(manager.get_computed_blocks(probe)[1] // BLOCK_SIZE)
    # Only every 4th block (plus replay boundaries) keeps its state.
    assert hits[3] == 4 and hits[7] == 8
    assert hits[1] < 2 and hits[4] < 5


def test_partial_sharing_between_running_requests() -> None:
    manager = _make_manager()
    shared = list(range(5 * BLOCK_SIZE + 70))
    first = make_request(
        "first", _prompt(shared, 8 * BLOCK_SIZE, 1), BLOCK_SIZE, sha256
    )
    second = make_request(
        "second", _prompt(shared, 7 * BLOCK_SIZE + 3, 2), BLOCK_SIZE, sha256
    )
    assert _prefill(manager, first, budget=4 * BLOCK_SIZE) == 0
    # `first` is still running: its blocks are shared by reference.
    assert _prefill(manager, second, budget=4 * BLOCK_SIZE) == 5 * BLOCK_SIZE
    first_mamba = _mamba_blocks(manager, "first")
    second_mamba = _mamba_blocks(manager, "second")
    # The hit block is the state `first` wrote at that boundary: a cached
    # block `first` itself no longer references (checkpoints are cache), and
    # the consumer continues in its own blocks from there.
    assert first_mamba[4].is_null
    assert second_mamba[4].block_hash is not None
    assert second_mamba[4].block_hash_num_tokens == 5 * BLOCK_SIZE
    assert all(
        b.is_null or b is not first_mamba[i]
        for i, b in enumerate(second_mamba)
        if i > 4
    )


def test_eviction_under_memory_pressure() -> None:
    # Just enough blocks for two 8-block requests in both groups.
    manager = _make_manager(num_blocks=2 * 2 * 8 + 2)
    doc = list(range(8 * BLOCK_SIZE))
    a = make_request("a", doc, BLOCK_SIZE, sha256)
    _prefill(manager, a, budget=4 * BLOCK_SIZE)
    manager.free(a)
    again = make_request("again", _prompt(doc, 9 * BLOCK_SIZE, 1), BLOCK_SIZE, sha256)
    # Freed states stay reusable until evicted.
    assert manager.get_computed_blocks(again)[1] == 8 * BLOCK_SIZE

    # Unrelated running requests need more than the blocks not cached for
    # `a`: part of `a`'s cache is evicted.
    others = [
        make_request(f"o{i}", _prompt([], 8 * BLOCK_SIZE, 10 + i), BLOCK_SIZE, sha256)
        for i in range(3)
    ]
    for other in others:
        _prefill(manager, other, budget=8 * BLOCK_SIZE)
    num_hit_after = manager.get_computed_blocks(
        make_request("late", _prompt(doc, 9 * BLOCK_SIZE, 2), BLOCK_SIZE, sha256)
    )[1]
    assert num_hit_after < 8 * BLOCK_SIZE
    # Freeing returns every block (no leak of per-block states).
    for other in others:
        manager.free(other)
    assert (
        manager.block_pool.get_num_free_blocks()
        == manager.block_pool.num_gpu_blocks - 1
    )


@pytest.mark.parametrize("num_shared_blocks", [2, 5, 9])
def test_eagle_drop_keeps_mamba_hit(num_shared_blocks: int) -> None:
    """EAGLE drops the last matched attention block; the Mamba group must
    then hit the state one block lower instead of losing the whole hit."""
    manager = _make_manager(use_eagle=True, num_speculative_blocks=2)
    doc = list(range(10 * BLOCK_SIZE + 9))
    _prefill(manager, make_request("a", doc, BLOCK_SIZE, sha256), 3 * BLOCK_SIZE, 2)
    probe = make_request(
        "probe",
        _prompt(doc[: num_shared_blocks * BLOCK_SIZE + 11], 12 * BLOCK_SIZE, 3),
        BLOCK_SIZE,
        sha256,
    )
    blocks, num_hit, _ = manager.get_computed_blocks(probe)
    assert num_hit == (num_shared_blocks - 1) * BLOCK_SIZE
    mamba_hit = blocks.blocks[MAMBA_GROUP]
    assert len(mamba_hit) == num_shared_blocks - 1
    assert not mamba_hit[-1].is_null


def _decode_step(
    manager: KVCacheManager,
    request: Request,
    num_draft: int,
    num_accepted: int,
    contents: dict[int, tuple[int, ...]] | None = None,
) -> None:
    # One verified token plus `num_draft` drafts; the drafter proposes
    # `num_draft` more (lookahead). With `contents` (block id -> the tokens
    # its state has seen), the model runner's writes: each token's state into
    # the block `state_block_idxs` names.
    new_blocks = manager.allocate_slots(
        request, 1 + num_draft, num_lookahead_tokens=num_draft
    )
    assert new_blocks is not None
    manager.fill_checkpoint_slots()
    slots = get_mamba_all_mode_state_slots(
        request.num_computed_tokens,
        1 + num_draft,
        num_draft,
        BLOCK_SIZE,
        manager.kv_cache_config.kv_cache_groups[
            MAMBA_GROUP
        ].kv_cache_spec.num_speculative_blocks,  # type: ignore[attr-defined]
    )
    row = _mamba_blocks(manager, request.request_id)
    written = (
        *slots.checkpoint_block_idxs,
        slots.write_block_idx,
        *slots.spec_block_idxs,
    )
    for idx in written:
        assert idx < len(row)
        # A checkpoint slot may be left unwritten (null) when blocks are
        # short; the live slots are always allocated.
        assert not row[idx].is_null or idx in slots.checkpoint_block_idxs
        # Written slots are private to the request and hold no cached state
        # of another request.
        assert row[idx].is_null or row[idx].ref_cnt == 1
    assert slots.read_block_idx not in slots.spec_block_idxs
    assert slots.read_block_idx < 0 or not row[slots.read_block_idx].is_null
    # The drafts (and the bonus token) all take one token value, so accepted
    # drafts are the output tokens the states saw.
    token = 7 + request.num_tokens
    if contents is not None:
        seen = list(request.all_token_ids) + [token] * num_draft
        for j, idx in enumerate(slots.state_block_idxs[: 1 + num_draft]):
            contents[row[idx].block_id] = tuple(seen[: request.num_tokens + j])
    # The verified token and `num_accepted` drafts are computed; they and the
    # bonus token become output tokens (the bonus one is not computed yet).
    request.num_computed_tokens += 1 + num_accepted
    request.append_output_token_ids([token] * (1 + num_accepted))
    manager.new_step_starts()


@pytest.mark.parametrize("num_draft", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_mtp_decode_slots_stay_allocated_and_private(num_draft: int, seed: int) -> None:
    rng = random.Random(seed)
    manager = _make_manager(use_eagle=True, num_speculative_blocks=num_draft)
    doc = list(range(2 * BLOCK_SIZE + 50))
    producer = make_request("producer", doc, BLOCK_SIZE, sha256)
    producer.sampling_params.max_tokens = 10_000
    _prefill(manager, producer, BLOCK_SIZE, num_lookahead_tokens=num_draft)
    # A consumer starts from the producer's cached (shared) state.
    consumer = make_request(
        "consumer", _prompt(doc, 3 * BLOCK_SIZE + 1, 5), BLOCK_SIZE, sha256
    )
    consumer.sampling_params.max_tokens = 10_000
    assert _prefill(manager, consumer, BLOCK_SIZE, num_lookahead_tokens=num_draft) > 0
    for request in (producer, consumer):
        # The first sampled token.
        request.append_output_token_ids([1])
    for request in (producer, consumer):
        # Decode across several block boundaries.
        while request.num_tokens < 5 * BLOCK_SIZE:
            _decode_step(manager, request, num_draft, rng.randint(0, num_draft))
    # Generated blocks become reusable states too.
    probe_tokens = list(producer.all_token_ids[: 4 * BLOCK_SIZE]) + [1, 2, 3]
    probe = make_request("probe", probe_tokens, BLOCK_SIZE, sha256)
    num_hit = manager.get_computed_blocks(probe)[1]
    assert num_hit == 3 * BLOCK_SIZE  # EAGLE drops the 4th block


@pytest.mark.parametrize("num_accepted", [1, 2])
@pytest.mark.parametrize("prompt_len", [BLOCK_SIZE - 2, 3 * BLOCK_SIZE - 2])
def test_boundary_crossed_by_accepted_drafts_is_cached(
    prompt_len: int, num_accepted: int
) -> None:
    """A verification step whose accepted drafts cross a block boundary
    completes that block before the block's hash exists; its state must
    survive until the next step caches it."""
    manager = _make_manager(num_speculative_blocks=2)
    request = make_request("r", list(range(prompt_len)), BLOCK_SIZE, sha256)
    request.sampling_params.max_tokens = 10_000
    _prefill(manager, request, 2 * BLOCK_SIZE, num_lookahead_tokens=2)
    request.append_output_token_ids([1])
    boundary = (prompt_len // BLOCK_SIZE + 1) * BLOCK_SIZE
    _decode_step(manager, request, num_draft=2, num_accepted=num_accepted)
    assert request.num_computed_tokens >= boundary
    _decode_step(manager, request, num_draft=2, num_accepted=0)
    probe = make_request(
        "probe", list(request.all_token_ids[:boundary]) + [5, 6], BLOCK_SIZE, sha256
    )
    assert manager.get_computed_blocks(probe)[1] == boundary
    manager.free(request)
    assert (
        manager.block_pool.get_num_free_blocks()
        == manager.block_pool.num_gpu_blocks - 1
    )


@pytest.mark.parametrize("num_accepted", [0, 1, 2, 3])
@pytest.mark.parametrize("boundary_draft", [0, 1, 2, 3])
def test_block_crossed_in_decode_caches_its_end_state(
    boundary_draft: int, num_accepted: int
) -> None:
    """A decode step whose tokens reach a block's end at a draft writes that
    draft's state into the block (`state_block_idxs`): a later prompt that
    continues the generated text and hits the block resumes from the state
    after exactly the block's tokens, whatever the acceptance was."""
    k = 3
    manager = _make_manager(num_speculative_blocks=k)
    boundary = 2 * BLOCK_SIZE
    # The first decode step starts `boundary_draft` tokens before the last
    # position of block 1.
    prompt_len = boundary - 1 - boundary_draft
    request = make_request("r", list(range(prompt_len)), BLOCK_SIZE, sha256)
    request.sampling_params.max_tokens = 10_000
    _prefill(manager, request, 4 * BLOCK_SIZE, num_lookahead_tokens=k)
    request.append_output_token_ids([1])
    slots = get_mamba_all_mode_state_slots(prompt_len, 1 + k, k, BLOCK_SIZE, k)
    assert slots.boundary_draft == boundary_draft
    # The shadow runner: block id -> the tokens its state has seen.
    contents: dict[int, tuple[int, ...]] = {}
    _decode_step(manager, request, k, num_accepted, contents)
    for _ in range(5):
        _decode_step(manager, request, k, 0, contents)
    tokens = list(request.all_token_ids)
    probe = make_request("probe", tokens[:boundary] + [7, 8], BLOCK_SIZE, sha256)
    blocks, num_hit, _ = manager.get_computed_blocks(probe)
    assert num_hit == boundary
    assert contents[blocks.blocks[MAMBA_GROUP][-1].block_id] == tuple(tokens[:boundary])


def test_state_slots_for_prefill_chunks() -> None:
    # Chunk [192, 704) of a 128-token-block request: reads the running state
    # in block 1, checkpoints 256/384/512/640, writes the running state into
    # block 5.
    slots = get_mamba_all_mode_state_slots(192, 512, 0, BLOCK_SIZE, 2)
    assert slots.read_block_idx == 1
    assert slots.checkpoint_block_idxs == (1, 2, 3, 4)
    assert slots.checkpoint_token_offsets == (64, 192, 320, 448)
    assert slots.write_block_idx == 5
    assert slots.spec_block_idxs == ()
    # A chunk starting at a prefix hit never writes the shared hit block.
    slots = get_mamba_all_mode_state_slots(256, 256, 0, BLOCK_SIZE, 0)
    assert slots.read_block_idx == 1
    assert slots.checkpoint_block_idxs == (2,)
    assert slots.write_block_idx == 3


@pytest.mark.parametrize("seed", range(5))
def test_state_slots_properties(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(500):
        block_size = rng.choice([64, 128, 512])
        start = rng.randint(0, 5000)
        num_draft = rng.randint(0, 3)
        num_scheduled = num_draft + rng.randint(1, 2000)
        slots = get_mamba_all_mode_state_slots(
            start, num_scheduled, num_draft, block_size, num_draft
        )
        end = start + num_scheduled - num_draft
        assert slots.read_block_idx == (start - 1) // block_size if start else True
        # The state after `end` tokens lives in the block holding token end-1.
        assert slots.write_block_idx == (end - 1) // block_size
        for idx, offset in zip(
            slots.checkpoint_block_idxs, slots.checkpoint_token_offsets
        ):
            assert (start + offset) == (idx + 1) * block_size
            assert 0 < offset < end - start
        assert (
            len(slots.checkpoint_block_idxs)
            == (end - 1) // block_size - start // block_size
        )
        if start % block_size == 0 and start > 0:
            # Starting on a boundary (e.g. a prefix hit): the read block is
            # never written.
            written = {*slots.checkpoint_block_idxs, slots.write_block_idx}
            assert slots.read_block_idx not in written
        assert len(slots.spec_block_idxs) == (num_draft if num_draft else 0)


def test_max_memory_usage_is_not_more_than_align() -> None:
    spec = MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=((4, 4),),
        dtypes=(torch.float32,),
        mamba_cache_mode="all",
        num_speculative_blocks=2,
    )
    max_model_len = 10 * BLOCK_SIZE + 1

    def usage(mode: str) -> int:
        vllm_config = SimpleNamespace(
            cache_config=SimpleNamespace(mamba_cache_mode=mode),
            model_config=SimpleNamespace(max_model_len=max_model_len),
        )
        return spec.max_memory_usage_bytes(vllm_config)  # type: ignore[arg-type]

    # Checkpoints are cache, not working set: a request needs no more than
    # in align mode, whatever its length.
    assert usage("none") < usage("all") <= usage("align")


@pytest.mark.parametrize("num_draft", [0, 2])
def test_block_table_row_holds_every_block_of_a_request(num_draft: int) -> None:
    """The runners size a request's block table row by
    ``max_num_blocks_per_req``; in "all" mode the row is position-indexed
    over the whole sequence (a state slot per block), so every block the
    manager hands a request, through prefill and decode, must fit in it."""
    manager = _make_manager(use_eagle=num_draft > 0, num_speculative_blocks=num_draft)
    spec = manager.kv_cache_config.kv_cache_groups[MAMBA_GROUP].kv_cache_spec
    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_mode="all"))
    row_capacity = spec.max_num_blocks_per_req(
        vllm_config,  # type: ignore[arg-type]
        manager.max_model_len,
    )
    request = make_request("long", list(range(6 * BLOCK_SIZE + 7)), BLOCK_SIZE, sha256)
    request.sampling_params.max_tokens = 10_000
    _prefill(manager, request, 2 * BLOCK_SIZE, num_lookahead_tokens=num_draft)
    assert len(_mamba_blocks(manager, request.request_id)) <= row_capacity
    request.append_output_token_ids([1])
    while request.num_tokens < 8 * BLOCK_SIZE:
        _decode_step(manager, request, num_draft, num_draft)
        assert len(_mamba_blocks(manager, request.request_id)) <= row_capacity


def test_manager_accepts_all_mode_with_caching() -> None:
    manager = _make_manager()
    mamba_managers = [
        m
        for m in manager.coordinator.single_type_managers
        if isinstance(m, MambaManager)
    ]
    assert [m.mamba_cache_mode for m in mamba_managers] == ["all"]
    assert all(m.has_positionally_stable_blocks for m in mamba_managers)
