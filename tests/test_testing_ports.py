"""``stallguard.testing.free_ports``: ports for test servers (gloo stores, HTTP servers,
real SGLang and vLLM servers) from below the kernel's ephemeral range.

A port found by binding port 0 is an ephemeral one, and any process's own ephemeral bind
or outgoing connection can take it before the server binds it: a gloo rank and a real
prefill each died of "address already in use" that way in suite runs under load."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stallguard.testing import free_port, free_ports


def test_ports_come_from_below_the_ephemeral_range_and_are_free() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = free_ports(5)
    assert len(set(ports)) == 5 and all(21000 <= p < 27000 < low for p in ports)
    assert 21000 <= free_port() < 27000
    for port in ports:  # each is free: a server can bind it
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_taken_port_is_skipped() -> None:
    """Hold all but one port of a tiny range: that one is the answer, and two are
    more than the range has (control: the held ports really are taken)."""
    held = []
    try:
        for port in range(26990, 26995):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            held.append(s)
        if len(held) < 5:
            pytest.skip("another process holds a port of 26990-26994")
        spare = held.pop()
        free = spare.getsockname()[1]
        spare.close()
        with socket.socket() as probe, pytest.raises(OSError):
            probe.bind(held[0].getsockname())
        assert free_ports(1, 26990, 26995) == [free]
        with pytest.raises(RuntimeError, match="no 2 free ports in 26990-26995"):
            free_ports(2, 26990, 26995)
    finally:
        for s in held:
            s.close()


@settings(max_examples=200, deadline=None)
@given(
    n=st.one_of(st.integers(-3, 4), st.booleans(), st.floats(), st.text(max_size=2)),
    lo=st.integers(-70000, 70000),
    hi=st.integers(-70000, 70000),
)
def test_any_arguments_give_ports_in_range_or_a_named_error(n: object, lo: int, hi: int) -> None:
    if isinstance(n, int) and not isinstance(n, bool) and n >= 1 and 0 < lo < hi <= 65536:
        hi = min(hi, lo + 50)  # keep the scan short
    try:
        ports = free_ports(n, lo, hi)  # type: ignore[arg-type]
    except ValueError as e:
        assert "free_ports:" in str(e)
        return
    except RuntimeError as e:
        assert f"free ports in {lo}-{hi}" in str(e)
        return
    assert isinstance(n, int) and len(ports) == n == len(set(ports))
    assert all(lo <= p < hi for p in ports)
