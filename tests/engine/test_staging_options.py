"""Staging options and the staged protocol from Python, without a GPU: host memory takes the
staged path (``stage_host_memory``) between two tcp engines, so bounce buffers, the landing area
and the credits run for real (tests/gpu/test_gpu_network.py moves GPU memory the same way)."""

from __future__ import annotations

import fabric_lib
import pytest
import torch
from fabric_lib.errors import InvalidArgumentError


def _engine(**options: object) -> fabric_lib.TransferEngine:
    return fabric_lib.TransferEngine("tcp", poll_mode="adaptive", transfer_timeout=30.0, **options)  # type: ignore[arg-type]


def test_staging_options_are_listed_and_checked() -> None:
    defaults = fabric_lib.engine_defaults()
    assert defaults["staging"] is True and defaults["stage_host_memory"] is False
    assert defaults["staging_chunk_bytes"] == 1 << 20 and defaults["staging_slots"] == 32
    with pytest.raises(InvalidArgumentError, match="chunk_bytes"):
        _engine(staging_chunk_bytes=5000)
    with pytest.raises(InvalidArgumentError, match="staging=False"):
        _engine(staging=False, staging_slots=4)
    with pytest.raises(InvalidArgumentError, match="stage_host_memory"):
        _engine(staging=False, stage_host_memory=True)
    with _engine() as e:
        assert e.staging, "tcp has no FI_HMEM"
        assert e.staging_stats == fabric_lib.StagingStats(0, 0, 0, 0)
    with _engine(staging=False) as e:
        assert not e.staging


def test_host_memory_staged_end_to_end() -> None:
    staged = {"stage_host_memory": True, "staging_chunk_bytes": 16 << 10, "staging_slots": 3}
    with _engine(**staged) as a, _engine(**staged) as b:
        src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
        dst = torch.zeros(1 << 20, dtype=torch.uint8)
        rs, rd = a.register_tensor(src), b.register_tensor(dst)
        assert rd.descriptor.staged_reachable and rd.descriptor.network_reachable
        with b.imm_counter(41) as counter:
            a.submit_write(rs, rd.descriptor, 100_003, src_offset=5, dst_offset=7, imm=41).result(timeout=30)
            pages = [3, 0, 9, 4]
            a.submit_paged_writes(
                5000, rs, pages, rd.descriptor, [0, 1, 2, 3], dst_offset=200_000, imm=41
            ).result(timeout=30)
            counter.wait(2, timeout=30)
            assert counter.value == 0
        assert torch.equal(dst[7 : 7 + 100_003], src[5 : 5 + 100_003])
        for i, p in enumerate(pages):
            at = 200_000 + i * 5000
            assert torch.equal(dst[at : at + 5000], src[p * 5000 : (p + 1) * 5000])
        sent, landed = a.staging_stats, b.staging_stats
        assert sent.requests_sent == 2 and sent.bounced_bytes == 100_003 + 4 * 5000
        assert landed.requests_landed == 2 and landed.landed_bytes == 100_003 + 4 * 5000


def test_a_scatter_stages_each_target_like_a_single_write() -> None:
    """Two receivers, one staging (landing area) and one not: each target takes its own path,
    each receiver counts the immediate once per target, the Future completes once."""
    staged = {"stage_host_memory": True, "staging_chunk_bytes": 16 << 10, "staging_slots": 3}
    with _engine(**staged) as a, _engine(**staged) as b, _engine() as c:
        src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
        dst_b, dst_c = torch.zeros(1 << 20, dtype=torch.uint8), torch.zeros(1 << 20, dtype=torch.uint8)
        rs, rb, rc = a.register_tensor(src), b.register_tensor(dst_b), c.register_tensor(dst_c)
        assert rb.descriptor.staged_reachable and not rc.descriptor.staged_reachable
        targets = [
            (70_001, 3, rb.descriptor, 5),
            (0, 0, rb.descriptor, 0),
            (50_000, 100_000, rb.descriptor, 300_000),
            (40_000, 9, rc.descriptor, 11),
        ]
        with b.imm_counter(52) as at_b, c.imm_counter(52) as at_c:
            a.submit_scatter(rs, targets, imm=52).result(timeout=30)
            at_b.wait(3, timeout=30)
            at_c.wait(1, timeout=30)
            assert at_b.value == 0 and at_c.value == 0
        assert torch.equal(dst_b[5 : 5 + 70_001], src[3 : 3 + 70_001])
        assert torch.equal(dst_b[300_000:350_000], src[100_000:150_000])
        assert torch.equal(dst_c[11 : 11 + 40_000], src[9 : 9 + 40_000])
        # Every target was bounced on the writer; only b's landed staged.
        assert a.staging_stats.bounced_bytes == 70_001 + 50_000 + 40_000
        assert b.staging_stats.landed_bytes == 70_001 + 50_000
        assert c.staging_stats.landed_bytes == 0


def test_a_staged_paged_write_into_one_page_twice_is_refused_before_anything_lands() -> None:
    """The receiver counts a staged request complete by its bytes: destination pages that
    overlap are refused on the writer's side, typed, with nothing sent."""
    staged = {"stage_host_memory": True, "staging_chunk_bytes": 16 << 10, "staging_slots": 3}
    with _engine(**staged) as a, _engine(**staged) as b:
        src = torch.randint(1, 256, (1 << 16,), dtype=torch.uint8)
        dst = torch.zeros(1 << 16, dtype=torch.uint8)
        rs, rd = a.register_tensor(src), b.register_tensor(dst)
        with b.imm_counter(7) as counter:
            with pytest.raises(InvalidArgumentError, match="overlap"):
                a.submit_paged_writes(4096, rs, [0, 1, 2], rd.descriptor, [3, 5, 3], imm=7).result(timeout=30)
            assert int(dst.count_nonzero()) == 0 and counter.value == 0
            assert a.staging_stats.requests_sent == 0
            # The engines serve the next request as usual.
            a.submit_paged_writes(4096, rs, [0, 1, 2], rd.descriptor, [3, 5, 4], imm=7).result(timeout=30)
            counter.wait(1, timeout=30)
        assert torch.equal(dst[3 * 4096 : 4 * 4096], src[:4096])
