"""Bootstrap across processes: three ranks form a gloo process group over
``tcp://127.0.0.1:<free port>``; for each loopback provider they call
``fabric_lib.distributed.exchange`` to learn every rank's engine address and descriptors, then
each writes to every other rank with immediates, and every rank checks all inbound bytes and
exact counts, plus an exchange over a subgroup (see ``mp_helpers.bootstrap_rank``).

The ranks are started once for all providers (importing torch in three processes is most of the
cost on 2 cores); each provider is reported by its own test.
"""

from __future__ import annotations

import mp_helpers as mh
import pytest
from fabric_lib.distributed import _ephemeral_low, rendezvous_port

WORLD = 3
PROVIDERS = [p for p in mh.LOOPBACK_PROVIDERS if mh.provider_available(p)]


@pytest.fixture(scope="module")
def bootstrap_reports() -> dict[str, dict[int, dict]] | str:
    """{provider: {rank: report}}, or the failure text of the first rank that failed."""
    pytest.importorskip("torch.distributed")
    try:
        per_rank = mh.run_ranks(mh.bootstrap_rank, WORLD, (rendezvous_port(), PROVIDERS), timeout=150)
    except mh.PeerError as e:
        return str(e)
    return {p: {rank: per_rank[rank][p] for rank in per_rank} for p in PROVIDERS}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("provider", mh.provider_params())
def test_exchange_then_all_to_all_writes(bootstrap_reports, provider: str) -> None:
    assert not isinstance(bootstrap_reports, str), bootstrap_reports
    reports = bootstrap_reports[provider]
    assert sorted(reports) == list(range(WORLD))
    for rank, report in reports.items():
        assert report["provider"].split(";")[0] == provider.split(";")[0], report
        assert report["stop_s"] < 3.0, (rank, report)


def test_rendezvous_port_is_free_and_below_the_ephemeral_range() -> None:
    # A port from the ephemeral range can be given to an early client's outgoing connection
    # before the store listens on it (EADDRINUSE); a lower one cannot.
    import socket

    low = _ephemeral_low()
    for _ in range(20):
        port = rendezvous_port()
        assert 1024 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free
