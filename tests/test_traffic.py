"""Traffic counted where it is sent (variants/engines/comm.py, variants/instruments/traffic.py),
and what ``run`` records of it.

- The counting helpers and the patch of ``torch.distributed`` (``instruments.open(count_dist=True)``)
  at world size 1 (what is patched, and put back) and 2 (the byte counts, with real transfers
  between two gloo processes).
- Under real torchrun (the cases of four run commands in one launch, the session's pooled run command's):
  a peer-like variant whose bytes go through plain ``torch.distributed`` calls is counted and not refused; a variant
  declared ``traffic_counted=False`` records ``bytes_sent: null``; llama3's gathers are counted;
  a variant that never communicates is still refused (``fault_silent``, in test_faults.py).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import command_cases, pool_cli_run
from ringbench.rank.bench import refusal
from ringbench.variants import instruments
from ringbench.variants.engines import comm
from ringbench.variants.engines.comm import RingComm
from ringbench.variants.instruments.traffic import RULES

#: One rank's K (or V) shard of the run commands' shape (``ran``) in fp32: 128 tokens x 1 head x
#: 16 channels x 4 bytes.
SHARD = 128 * 1 * 16 * 4


def _counts(inst: instruments.Instruments) -> tuple[int, int]:
    return inst.traffic.bytes_sent, inst.traffic.bytes_received


# --------------------------------------------------------------------------- world size 1

@pytest.mark.dist
def test_dist_patch_is_held_while_its_context_is_open_and_puts_everything_back(solo_group):
    originals = {name: getattr(dist, name) for name in (*RULES, "P2POp")}
    with instruments.open(count_dist=True):
        with instruments.open(count_dist=True):  # nested holds are one hold
            assert all(getattr(dist, name) is not originals[name] for name in RULES)
        assert dist.isend is not originals["isend"]
        # P2POp takes the counted isend and stores the real one, as batch_isend_irecv needs.
        op = dist.P2POp(dist.isend, torch.zeros(2), 0)
        assert op.op is originals["isend"] and isinstance(op, originals["P2POp"])
        with instruments.open(traffic=True) as inst:
            t = torch.arange(6.0)
            dist.all_reduce(t)  # a real call: W = 1 moves nothing, and the sum is itself
        assert torch.equal(t, torch.arange(6.0)) and _counts(inst) == (0, 0)
    assert {name: getattr(dist, name) for name in originals} == originals


def test_refusal_skips_the_byte_rule_where_traffic_cannot_be_counted():
    assert refusal(tflops=10.0, peak=None, bytes_sent=None, world_size=2, variant="torch_cp") is None
    assert refusal(tflops=10.0, peak=None, bytes_sent=0, world_size=2, variant="fault_silent").startswith(
        "the fault_silent variant sent no bytes at world size 2")
    assert refusal(tflops=1200.0, peak=989.0, bytes_sent=None, world_size=2, variant="torch_cp").startswith(
        "measured 1200 TFLOP/s per GPU exceeds")


# --------------------------------------------------------------------------- world size 2, two processes

def _pair(rank: int, store_path: str, out_dir: str) -> None:
    """Rank ``rank`` of two: every counted call, its counts written to ``out_dir/rank{rank}.json``."""
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    other = 1 - rank
    found: dict[str, list] = {}

    def record(name, fn):
        with instruments.open(traffic=True) as inst:
            value = fn()
        found[name] = [*_counts(inst), value]

    x = torch.full((4, 8), float(rank))  # 128 bytes
    y = torch.empty_like(x)

    def ring():
        c = RingComm()
        c.send_recv(x, y)
        c.send_recv(x[:2].contiguous(), torch.empty(2, 8))  # 64 bytes more
        c.commit()
        c.wait()
        return y[0, 0].item()

    def gather():
        out = torch.empty(8, 8)
        comm.all_gather_into_tensor(out, x, async_op=True).wait()
        return out[:, 0].tolist()

    def scatter():
        part = torch.empty(2, 8)
        comm.reduce_scatter_tensor(part, torch.ones(4, 8) * (rank + 1))
        return part[0, 0].item()

    def plain():
        # A peer's own calls, as ring-flash-attn makes them: counted only under the patch (count_dist).
        ops = [dist.P2POp(dist.isend, x, other), dist.P2POp(dist.irecv, y, other)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        out = torch.empty(8, 8)
        dist.all_gather_into_tensor(out, x)
        part = torch.empty(2, 8)
        dist.reduce_scatter_tensor(part, torch.ones(4, 8))
        return y[0, 0].item()

    def each_collective():
        t = torch.ones(4, 8)
        dist.all_reduce(t)  # 2 (W-1)/W of 128 bytes both ways
        b = torch.full((16,), float(rank))
        dist.broadcast(b, src=0)  # rank 0 sends 64 bytes, rank 1 receives them
        a = torch.empty(16)
        dist.all_to_all_single(a, torch.arange(16.0))  # half of 64 bytes each way
        if rank == 0:
            dist.send(torch.zeros(3), 1)  # 12 bytes
        else:
            dist.recv(torch.zeros(3), 0)
        return [t[0, 0].item(), b[0].item()]

    record("ring", ring)
    record("gather", gather)
    record("scatter", scatter)
    record("plain_uncounted", plain)
    with instruments.open(count_dist=True):
        record("plain_counted", plain)
        record("ring_under_the_patch", ring)  # RingComm counts; the patched call adds nothing
        record("collectives", each_collective)

        def plain_from_a_thread():
            # A thread that sees no context of its own (autograd's device thread running a
            # peer's CUDA backward): counted in the context open under the patch's holder.
            result = []
            worker = threading.Thread(target=lambda: result.append(plain()))
            worker.start()
            worker.join()
            return result[0]

        record("plain_from_a_thread", plain_from_a_thread)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(found))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.slow  # two spawned processes: 15-19 s on two cores
def test_counts_at_world_size_two_follow_the_rules_and_count_each_byte_once(tmp_path):
    mp.start_processes(_pair, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, found in enumerate(got):
        print(rank, found)
        other = 1 - rank
        assert found["ring"] == [192, 192, float(other)]  # both sends of the batch, once
        assert found["gather"] == [128, 128, [0.0] * 4 + [1.0] * 4]  # the 128-byte shard to W - 1 = 1 rank
        assert found["scatter"] == [64, 64, 3.0]  # the 64-byte shard x (W - 1); 1 + 2 summed
        assert found["plain_uncounted"] == [0, 0, float(other)]  # outside the patch: unseen
        assert found["plain_counted"] == [128 + 128 + 64, 128 + 128 + 64, float(other)]
        assert found["ring_under_the_patch"][:2] == [192, 192]
        assert found["plain_from_a_thread"] == found["plain_counted"]
        sent, received, (reduced, broadcast) = found["collectives"]
        assert (reduced, broadcast) == (2.0, 0.0)  # the real calls ran
        assert (sent, received) == ((128 + 64 + 32 + 12, 128 + 32) if rank == 0 else (128 + 32, 128 + 64 + 32 + 12))


# --------------------------------------------------------------------------- the records of run, under torchrun

#: The run commands the tests below check, by name: the variant and its options beside the shared shape.
RUNS = {"plain_dist_peer": ("plain_dist_peer", {}), "plain_dist_peer fwd": ("plain_dist_peer", {"mode": "fwd"}),
        "uncounted_peer": ("uncounted_peer", {}), "llama3": ("llama3", {})}


def _wanted() -> dict:
    """The cases of the run commands of :data:`RUNS`, as the command line builds them: name -> cases."""
    small = {"device": "cpu", "world_size": [2], "seqlen": 256, "heads": 2, "kv_heads": 1, "head_dim": 16,
             "iters": 3, "warmup": 1}
    return {name: command_cases("run", {**small, **extra, "variant": [variant]})
            for name, (variant, extra) in RUNS.items()}


# The session's pooled run command runs them (helpers.CliRunPool).
pool_cli_run(__name__, lambda: [c for cases in _wanted().values() for c in cases])


@pytest.fixture(scope="module")
def ran(cli_run_pool):
    """The cases of the run commands of :data:`RUNS`, run in the session's pooled ``run --scenario``
    (``helpers.CliRunPool``: one launch of two ranks, where each command had its own): name -> record."""
    wanted = _wanted()
    case = wanted["llama3"][0]
    assert SHARD == case.seqlen // case.world_size * case.kv_heads * case.head_dim * 4
    got = cli_run_pool.get(__name__)
    records = dict(zip([c.case_id() for cases in wanted.values() for c in cases], got["records"]))
    assert len(records) == len(RUNS) and None not in records.values(), got["result"].stderr
    return {name: records[cases[0].case_id()] for name, cases in wanted.items()}


@pytest.mark.slow
@pytest.mark.dist
def test_run_counts_a_peer_that_sends_through_its_own_torch_distributed_calls(ran):
    """plain_dist_peer never touches ringbench's communicators (like rfa_*); its session counts it.

    Per iteration: forward gathers K and V (one fp32 shard each to the other rank), backward
    reduce-scatters their fp32 gradients (one shard each): 4 shards, counted once each.
    """
    record = ran["plain_dist_peer"]
    assert record["status"] == "ok", record["reason"]
    assert record["bytes_sent"] == record["bytes_received"] == 4 * SHARD
    assert record["bus_gib_s"] > 0
    fwd = ran["plain_dist_peer fwd"]
    assert fwd["status"] == "ok" and fwd["spec"]["mode"] == "fwd" and fwd["bytes_sent"] == 2 * SHARD


@pytest.mark.dist
@pytest.mark.slow
def test_run_records_null_bytes_for_a_variant_whose_traffic_cannot_be_seen(ran):
    record = ran["uncounted_peer"]  # the ring, declared traffic_counted=False
    assert record["status"] == "ok", record["reason"]
    assert record["bytes_sent"] is None and record["bytes_received"] is None and record["bus_gib_s"] is None
    assert record["time_ms"] > 0


@pytest.mark.dist
@pytest.mark.slow
def test_run_counts_llama3_by_its_gather_and_reduce_scatter(ran):
    """Per iteration llama3 gathers the K and V shards to the other rank in forward and
    reduce-scatters their fp32 gradients in backward, through comm's counted helpers."""
    record = ran["llama3"]
    assert record["status"] == "ok", record["reason"]
    assert record["bytes_sent"] == record["bytes_received"] == 4 * SHARD
