"""The compressed all-reduce on real gloo ranks against a single-process simulation of the same algorithm."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from dscompile.kernels.onebit_reference import compress_reference, decompress_mean_reference, decompress_reference
from dscompile.runtime.onebit import Collectives, CompressedLayout, compressed_all_reduce, wire_bytes
from dscompile.testing.distributed import run_distributed_or_fail

ROUNDS = 3


def _inputs(rank: int, round_: int, numel: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7919 * rank + 104729 * round_ + numel)
    return torch.randn(numel, generator=gen) * (1 + rank)


def _rank(rank: int, world: int, numel: int, block_size: int | None, impl: str | None = None):
    comm = Collectives()
    layout = CompressedLayout.plan(numel, world, block_size)
    worker_error, server_error = layout.new_errors()
    results, calls = [], []
    for round_ in range(ROUNDS):
        before = comm.stats.total_bytes
        results.append(compressed_all_reduce(_inputs(rank, round_, numel), worker_error, server_error, layout, comm, impl=impl))
        calls.append(comm.stats.total_bytes - before)
    return {"results": results, "worker_error": worker_error, "server_error": server_error, "bytes": calls, "stats": comm.stats.as_dict()}


def simulate(buffers, worker_errors, server_errors, layout):
    """The algorithm written out for all ranks in one process with the reference kernels."""
    w, k, block = layout.world, layout.blocks_per_chunk, layout.block
    sent = []
    for r in range(w):
        padded = F.pad(buffers[r], (0, layout.padded - layout.numel))
        packed, scales, new_error = compress_reference(padded.view(w * k, block), worker_errors[r].view(w * k, block))
        worker_errors[r] = new_error.view(-1)
        sent.append((packed.view(w, k, block // 8), scales.view(w, k)))
    chunks = []
    for r in range(w):  # rank r serves chunk r
        received_packed = torch.stack([sent[src][0][r] for src in range(w)])
        received_scales = torch.stack([sent[src][1][r] for src in range(w)])
        mean = decompress_mean_reference(received_packed, received_scales)
        packed, scales, new_error = compress_reference(mean, server_errors[r].view(k, block))
        server_errors[r] = new_error.view(-1)
        chunks.append(decompress_reference(packed, scales).view(-1))
    return torch.cat(chunks)[: layout.numel]


CASES = {
    # divisible by 8 x world; not (padded); several scales per chunk; the Triton kernels (interpreter on CPU)
    2: [(2 * 8 * 40, None, None), (1001, None, None), (1001, 16, None), (1001, 16, "triton")],
    # the last with the optimizers' default block, padded to 4 x 2048
    4: [(4 * 8 * 25, None, None), (997, 24, None), (5000, 2048, None)],
}
BIG = 100_000


def _rank_cases(rank: int, world: int, cases):
    return {"cases": [_rank(rank, world, *case) for case in cases], "big": _rank(rank, world, BIG, 2048)}


@functools.cache
def _run(world: int):
    return run_distributed_or_fail(_rank_cases, world, CASES[world], timeout=600)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_compressed_all_reduce_equals_simulation(world):
    per_rank = _run(world)
    for index, (numel, block_size, _impl) in enumerate(CASES[world]):
        _check_case([r["cases"][index] for r in per_rank], world, numel, block_size)


def _check_case(ranks, world, numel, block_size):
    layout = CompressedLayout.plan(numel, world, block_size)
    worker_errors = [torch.zeros(layout.padded) for _ in range(world)]
    server_errors = [torch.zeros(layout.chunk) for _ in range(world)]
    for round_ in range(ROUNDS):
        expected = simulate([_inputs(r, round_, numel) for r in range(world)], worker_errors, server_errors, layout)
        for rank in ranks:
            torch.testing.assert_close(rank["results"][round_], expected, rtol=0, atol=1e-6)
        for other in ranks[1:]:
            assert torch.equal(other["results"][round_], ranks[0]["results"][round_]), "ranks must end with bitwise the same result"
    for r, rank in enumerate(ranks):
        torch.testing.assert_close(rank["worker_error"], worker_errors[r], rtol=0, atol=1e-6)
        torch.testing.assert_close(rank["server_error"], server_errors[r], rtol=0, atol=1e-6)
    # One all-to-all and one all-gather per call, each rank sending signs and scales.
    assert ranks[0]["stats"]["calls"] == {"all_to_all": ROUNDS, "all_gather": ROUNDS}
    message = layout.chunk // 8 + 4 * layout.blocks_per_chunk
    assert ranks[0]["bytes"] == [wire_bytes("all_to_all", world * message, world) + wire_bytes("all_gather", message, world)] * ROUNDS
    if numel % (8 * world) == 0 and block_size is None:
        assert layout.padded == numel


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_compressed_bytes_are_a_sixteenth_of_fp32_or_less(world):
    layout = CompressedLayout.plan(BIG, world, 2048)
    message = layout.chunk // 8 + 4 * layout.blocks_per_chunk
    expected = wire_bytes("all_to_all", world * message, world) + wire_bytes("all_gather", message, world)
    for rank in _run(world):
        assert rank["big"]["bytes"] == [expected] * ROUNDS  # measured from the collectives issued
        assert wire_bytes("all_reduce", 4 * BIG, world) / expected >= 16


def test_compression_error_feedback_converges_to_the_mean_over_rounds():
    """Error feedback: summed over many rounds, the compressed means track the true means."""
    world, numel = 3, 96
    layout = CompressedLayout.plan(numel, world, None)
    worker_errors = [torch.zeros(layout.padded) for _ in range(world)]
    server_errors = [torch.zeros(layout.chunk) for _ in range(world)]
    gen = torch.Generator().manual_seed(0)
    fixed = [torch.randn(numel, generator=gen) for _ in range(world)]
    total = torch.zeros(numel)
    rounds = 100
    for _ in range(rounds):
        total += simulate(fixed, worker_errors, server_errors, layout)
    true_mean = torch.stack(fixed).mean(0)
    one_shot = simulate(fixed, [torch.zeros(layout.padded)] * world, [torch.zeros(layout.chunk)] * world, layout)
    assert (one_shot - true_mean).abs().max() > 0.5  # a single 1-bit round is far off...
    assert (total / rounds - true_mean).abs().max() < 0.06  # ...the error-compensated average is not (error ~ 1 / rounds)


def test_single_process_is_the_identity_and_layouts_pad():
    comm = Collectives()
    assert comm.world == 1
    layout = CompressedLayout.plan(10, 1, None)
    x = torch.randn(10)
    w, s = layout.new_errors()
    assert compressed_all_reduce(x, w, s, layout, comm) is x
    assert comm.stats.total_bytes == 0
    assert CompressedLayout.plan(1001, 4, None).padded == 1024 and CompressedLayout.plan(1001, 4, None).chunk == 256
    assert CompressedLayout.plan(320, 4, None).padded == 320
    blocked = CompressedLayout.plan(5000, 4, 2048)
    assert (blocked.chunk, blocked.block, blocked.blocks_per_chunk, blocked.padded) == (2048, 2048, 1, 8192)
    with pytest.raises(ValueError, match="multiple of 8"):
        CompressedLayout.plan(100, 2, 12)
    assert wire_bytes("all_reduce", 400, 4) == 600 and wire_bytes("all_to_all", 400, 4) == 300 and wire_bytes("all_gather", 100, 4) == 300


# ----------------------------------------------------------------------------- ZeRO-1's 1-bit reduce-scatter

RS_CASES = [(37, None), (37, 16), (300, 2048)]
"""Row lengths (each rank's shard) and block sizes: padded to a multiple of 8, several scales per row, one padded block."""


def _rs_rank(rank: int, world: int):
    from dscompile.runtime.onebit.comm import compressed_reduce_scatter, reduce_scatter_chunk

    out = []
    for row, block_size in RS_CASES:
        comm = Collectives()
        chunk, _ = reduce_scatter_chunk(row, block_size)
        error = torch.zeros(world * chunk)
        results = [compressed_reduce_scatter(_inputs(rank, r, world * row).view(world, row), error, block_size, comm) for r in range(ROUNDS)]
        out.append({"results": results, "error": error.clone(), "stats": comm.stats.as_dict()})
    return out


def _simulate_reduce_scatter(world: int, row: int, block_size: int | None):
    from dscompile.runtime.onebit.comm import reduce_scatter_chunk

    chunk, block = reduce_scatter_chunk(row, block_size)
    k = chunk // block
    errors = [torch.zeros(world * chunk) for _ in range(world)]
    rounds = []
    for round_ in range(ROUNDS):
        sent = []
        for r in range(world):
            padded = F.pad(_inputs(r, round_, world * row).view(world, row), (0, chunk - row))
            packed, scales, new_error = compress_reference(padded.reshape(world * k, block), errors[r].view(world * k, block))
            errors[r] = new_error.reshape(-1)
            sent.append((packed.view(world, k, block // 8), scales.view(world, k)))
        means = []
        for r in range(world):
            mean = decompress_mean_reference(torch.stack([sent[s][0][r] for s in range(world)]), torch.stack([sent[s][1][r] for s in range(world)]))
            means.append(mean.reshape(-1)[:row])
        rounds.append(means)
    return rounds, errors


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_compressed_reduce_scatter_equals_simulation(world):
    per_rank = run_distributed_or_fail(_rs_rank, world, timeout=300)
    for index, (row, block_size) in enumerate(RS_CASES):
        rounds, errors = _simulate_reduce_scatter(world, row, block_size)
        for r in range(world):
            got = per_rank[r][index]
            for round_ in range(ROUNDS):
                torch.testing.assert_close(got["results"][round_], rounds[round_][r], rtol=0, atol=1e-6)
            torch.testing.assert_close(got["error"], errors[r], rtol=0, atol=1e-6)
            # one all-to-all per round, nothing else: (w-1)/w of the packed signs and scales
            from dscompile.runtime.onebit.comm import reduce_scatter_chunk

            chunk, block = reduce_scatter_chunk(row, block_size)
            assert got["stats"]["calls"] == {"all_to_all": ROUNDS}
            assert got["stats"]["total_bytes"] == ROUNDS * wire_bytes("all_to_all", world * (chunk // 8 + 4 * (chunk // block)), world)
