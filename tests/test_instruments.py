"""The instrument context (variants/instruments/): what one context counts and holds, how nested
and successive ones restore each other, the patch of ``torch.distributed`` scoped to one, and a
backward on another thread reporting to its forward's instruments.

No process group: bytes move through :class:`RingComm` under an emulated ring of two, which
counts them at commit as a real ring does.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from ringbench.variants import get_variant, instruments
from ringbench.variants.engines.comm import RingComm
from ringbench.variants.instruments import traffic

#: One fp32 block of 4 x 8: the bytes one send of :func:`_send_one` moves.
BLOCK = 4 * 8 * 4


def _ring_of_two(rank: int = 0) -> instruments.Emulation:
    shards = [(torch.full((4, 8), float(r)),) for r in range(2)]
    return instruments.Emulation(rank, 2, shards)


def _send_one() -> None:
    """One counted send and receive of BLOCK bytes, through the ring's communicator."""
    c = RingComm()
    c.send_recv(torch.ones(4, 8), torch.empty(4, 8))
    c.commit()
    c.wait()


def test_instruments_two_cases_in_one_process_do_not_see_each_others_counts():
    with instruments.open(emulation=_ring_of_two()):
        with instruments.open(traffic=True) as first:
            _send_one()
            _send_one()
        with instruments.open(traffic=True) as second:
            _send_one()
    assert (first.traffic.bytes_sent, first.traffic.bytes_received) == (2 * BLOCK, 2 * BLOCK)
    assert (second.traffic.bytes_sent, second.traffic.bytes_received) == (BLOCK, BLOCK)
    assert instruments.current() is instruments.NONE


def test_instruments_nested_contexts_restore_the_outer_one_and_count_into_it():
    with instruments.open(traffic=True, emulation=_ring_of_two()) as outer:
        _send_one()
        with instruments.open(traffic=True) as inner:
            assert instruments.current() is inner and inner.emulation is outer.emulation  # not asked: inherited
            _send_one()
            with instruments.open(observe=True) as observed:
                assert observed.traffic is inner.traffic and observed.observation is not None
                _send_one()
            assert instruments.current() is inner and inner.observation is None
        assert instruments.current() is outer
    assert inner.traffic.bytes_sent == 2 * BLOCK  # its own body only
    assert outer.traffic.bytes_sent == 3 * BLOCK  # its body, the inner one's included
    assert instruments.current() is instruments.NONE


def test_instruments_count_nothing_and_restore_everything_when_none_is_open_or_a_case_raises():
    with instruments.open(emulation=_ring_of_two()) as inst:
        _send_one()  # no traffic asked for: counted nowhere, and nothing raised
    assert inst.traffic is None
    with pytest.raises(ValueError, match="the case failed"):
        with instruments.open(traffic=True, observe=True, timeline="cpu"):
            raise ValueError("the case failed")
    assert instruments.current() is instruments.NONE


@pytest.mark.parametrize("kind", ["observe", "timeline", "emulation"])
def test_instruments_observation_timeline_and_emulation_do_not_nest(kind):
    ask = {"observe": {"observe": True}, "timeline": {"timeline": "cpu"}, "emulation": {"emulation": _ring_of_two()}}
    with instruments.open(**ask[kind]) as outer:
        with pytest.raises(RuntimeError, match="do not nest, so end the first"):
            with instruments.open(**ask[kind]):
                pass
        assert instruments.current() is outer


def _patchable() -> dict:
    return {name: getattr(dist, name) for name in (*traffic.RULES, "P2POp")}


def test_instruments_dist_patch_is_undone_when_its_context_closes_even_when_the_case_raises():
    originals = _patchable()
    session = get_variant("plain_dist_peer").open_session({}, None, torch.device("cpu"))  # comm.dist_session
    with pytest.raises(RuntimeError, match="the case failed"):
        with session:
            assert dist.all_gather is not originals["all_gather"]
            assert dist.batch_isend_irecv is not originals["batch_isend_irecv"] and dist.P2POp is not originals["P2POp"]
            raise RuntimeError("the case failed")
    assert _patchable() == originals
    with instruments.open(count_dist=True):
        with pytest.raises(KeyError):
            with instruments.open(count_dist=True):  # nested holds are one hold: the inner close keeps it
                raise KeyError("inner")
        assert dist.all_gather_into_tensor is not originals["all_gather_into_tensor"]
    assert _patchable() == originals and instruments.current() is instruments.NONE


def _ring_step(q, k, v, dout, *, threaded_backward: bool) -> int:
    """Bytes rank 0 of an emulated ring of two counts for one forward and backward, the
    backward on this thread or on a new one that sees no context of its own (as autograd's
    device thread runs a CUDA backward)."""
    shards = [(k[r], v[r]) for r in range(2)]
    qr = q.clone().requires_grad_(True)
    with instruments.open(traffic=True, emulation=instruments.Emulation(0, 2, shards)) as inst:
        out, _ = get_variant("ring").attention(qr, k[0], v[0], causal=True, kernel="math")
        backward = lambda: out.backward(dout)  # noqa: E731
        if threaded_backward:
            seen = []
            worker = threading.Thread(target=lambda: (seen.append(instruments.current()), backward()))
            worker.start()
            worker.join()
            assert seen == [instruments.NONE] and qr.grad is not None
        else:
            backward()
    return inst.traffic.bytes_sent


def test_instruments_backward_on_another_thread_reports_to_its_forwards_context():
    gen = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(1, 16, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = ([torch.randn(1, 16, 1, 8, generator=gen, dtype=torch.float64) for _ in range(2)] for _ in range(2))
    same = _ring_step(q, k, v, dout, threaded_backward=False)
    forward_only = 2 * k[0].numel() * 8  # K and V, one step each way of a ring of two
    print(f"one thread: {same} bytes; forward alone: {forward_only}")
    assert same > forward_only  # the backward's K/V and dK/dV transfers are in it
    assert _ring_step(q, k, v, dout, threaded_backward=True) == same
