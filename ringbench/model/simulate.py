"""Price every rank's program and play them together: the slowest rank's time and what it spent it on.

Each rank has a compute stream (kernels, merges, adds, copies, one after another, each taking at
least the host's launch time) and a communication stream (transfers in issue order). A
:class:`~ringbench.model.schedule.Post` starts on the communication stream once the compute
stream has reached it and the previous transfer has finished; a point-to-point transfer needs
both ends (it starts when the later of sender and receiver is ready), a collective every member
of its group. A :class:`~ringbench.model.schedule.Wait` holds the compute stream until that
transfer is done. So a slow rank delays its neighbours' receives, and the slowest rank gates
the ring, as in the engines.

The critical path of the slowest rank splits into compute (kernel time), overhead (merges, adds,
copies, launch floors), exposed communication (waiting while a transfer ran) and waiting for
peers (a transfer that could not start because another rank was late: the imbalance). The four
add up to its time.

Costs: a kernel call from the calibration's surface, a merge, add or copy from its bytes; a
transfer from the cluster's link between the two ranks (``fabric``): ring collectives
(all-gather, reduce-scatter) take ``W - 1`` hops of the shard over the slowest link of the
group's ring, an all-to-all sends ``1/U`` of the tensor to each peer, over each link class at
once. Torch-free.

Source: issue 24.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ringbench.model.calibration import Calibration
from ringbench.model.fabric import Cluster, Link
from ringbench.model.schedule import Compute, Post, Wait

#: The parts of a rank's time, in the order tables show them.
PARTS = ("compute", "overhead", "comm", "wait")


@dataclass
class RankTime:
    """One rank's simulated time, ms, with its parts (they sum to ``total_ms``) and the bytes it sent."""

    total_ms: float = 0.0
    fwd_ms: float | None = None
    parts: dict = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    bytes_sent: float = 0.0
    bytes_by_class: dict = field(default_factory=dict)
    kernel_calls: int = 0


def _split(program: list) -> list[tuple[list, object]]:
    """A program as segments: the compute ops before each communication op, and that op (None: the tail)."""
    segments, compute = [], []
    for op, shape in program:
        if isinstance(op, Compute):
            compute.append((op, shape))
        else:
            segments.append((compute, op))
            compute = []
    segments.append((compute, None))
    return segments


def _stream_ms(link: Link, message: float, count: float) -> float:
    """``count`` messages of ``message`` bytes one after another over ``link``, ms (one latency)."""
    if message <= 0 or count <= 0:
        return 0.0
    if link.curve:
        return count * link.seconds(message) * 1e3
    return (link.latency_us * 1e-6 + count * message / (link.gb_s * 1e9)) * 1e3


def _sent_bytes(post: Post) -> tuple[float, list[tuple[int, float]]]:
    """The bytes a rank counts as sent for ``post`` (``comm.py``'s rules) and to whom: (peer, bytes)."""
    n = len(post.group)
    if post.op == "p2p":
        return post.nbytes, [(post.send_to, post.nbytes)]
    if post.op in ("all_gather", "reduce_scatter"):
        return post.nbytes * (n - 1), []
    if post.op == "all_to_all":
        return post.nbytes * (n - 1) / n, []
    raise ValueError(f"unknown transfer {post.op!r}")


def simulate(programs: list[list], *, calibration: Calibration, kernel: str, cluster: Cluster,
             whiches: tuple[str, ...] = ("mid",), place: Callable[[int], int] = lambda r: r
             ) -> dict[str, list[RankTime]]:
    """Play every rank's program (``schedule.programs``) on ``cluster``: per quantile, one
    :class:`RankTime` per rank.

    Args:
        programs: per rank, ``(op, shape)`` pairs.
        calibration, kernel: what prices the compute (``Calibration.kernel_ms``, ``overhead_ms``).
        cluster: what prices the transfers (the link between two ranks' hosts).
        whiches: the calibration's quantiles to play (``lo``, ``mid``, ``hi``: an interval's ends
            and its middle), all in one pass.
        place: the host slot of each rank (the identity: ranks in order, node by node).

    Raises:
        ValueError: programs whose communication differs between ranks (an engine loop the model
            does not follow).
    """
    W, Q = len(programs), range(len(whiches))
    segs = [_split(p) for p in programs]
    if len({len(s) for s in segs}) != 1:
        raise ValueError("the ranks' programs have different numbers of transfers and waits")
    times = {w: [RankTime() for _ in range(W)] for w in whiches}
    by_q = [times[w] for w in whiches]
    T = [[0.0] * W for _ in Q]      # each rank's compute stream, per quantile
    free = [[0.0] * W for _ in Q]   # each rank's communication stream
    done: dict[tuple[int, str], list[tuple[float, float]]] = {}  # (rank, channel) -> per quantile (end, transfer ms)
    floor = calibration.launch_ms
    cost_cache: dict = {}
    links: dict[tuple[int, int], Link] = {}
    sent_rank = [0.0] * W
    classes: list[dict] = [dict() for _ in range(W)]
    calls = [0] * W
    fwd_at: list[list[float | None]] = [[None] * W for _ in Q]

    def link(a: int, b: int) -> Link:
        if (a, b) not in links:
            links[(a, b)] = cluster.link(place(a), place(b))
        return links[(a, b)]

    def price(op: Compute, shape) -> list[tuple[float, float]]:
        key = (op.kind, op.call, shape, op.nbytes)
        if key not in cost_cache:
            out = []
            for w in whiches:
                if op.kind == "kernel":
                    work = calibration.kernel_ms(kernel, op.call, shape, w)
                else:
                    work = calibration.overhead_ms(op.kind, op.nbytes, w)
                out.append((work, max(work, floor)))
            cost_cache[key] = out
        return cost_cache[key]

    for j in range(len(segs[0])):
        for r in range(W):
            for op, shape in segs[r][j][0]:
                if op.phase == "bwd" and fwd_at[0][r] is None:
                    for i in Q:
                        fwd_at[i][r] = T[i][r]
                kernel_op = op.kind == "kernel"
                calls[r] += kernel_op
                for i, (work, took) in enumerate(price(op, shape)):
                    T[i][r] += took
                    parts = by_q[i][r].parts
                    if kernel_op:
                        parts["compute"] += work
                        parts["overhead"] += took - work
                    else:
                        parts["overhead"] += took
        ops = [segs[r][j][1] for r in range(W)]
        if ops[0] is None:
            continue
        kinds = {(type(o).__name__, getattr(o, "op", ""), o.channel) for o in ops}
        if len(kinds) != 1:
            raise ValueError(f"the ranks' programs differ at transfer {j}: {sorted(kinds)}")
        if isinstance(ops[0], Post):
            for r, op in enumerate(ops):
                if op.phase == "bwd" and fwd_at[0][r] is None:
                    for i in Q:
                        fwd_at[i][r] = T[i][r]
            if ops[0].op == "p2p":
                durations = [(link(r, op.send_to).seconds(op.nbytes) * 1e3,
                              link(op.recv_from, r).seconds(op.nbytes) * 1e3) for r, op in enumerate(ops)]
            else:
                durations, spans = [0.0] * W, {}
                for r, op in enumerate(ops):
                    if op.group not in spans:
                        spans[op.group] = _collective_ms(op, [place(m) for m in op.group], cluster)
                    durations[r] = spans[op.group]
            for r, op in enumerate(ops):
                done[(r, op.channel)] = []
            for i in Q:
                ready = [max(T[i][r], free[i][r]) for r in range(W)]
                ends = [0.0] * W
                if ops[0].op == "p2p":
                    for r, op in enumerate(ops):
                        send, recv = durations[r]
                        ends[r] = max(max(ready[r], ready[op.send_to]) + send, max(ready[op.recv_from], ready[r]) + recv)
                        done[(r, op.channel)].append((ends[r], max(send, recv)))
                else:
                    starts = {}
                    for r, op in enumerate(ops):
                        if op.group not in starts:
                            starts[op.group] = max(ready[m] for m in op.group)
                        ends[r] = starts[op.group] + durations[r]
                        done[(r, op.channel)].append((ends[r], durations[r]))
                free[i] = ends
            for r, op in enumerate(ops):
                sent, _ = _sent_bytes(op)
                sent_rank[r] += sent
                for cls, nbytes in _by_class(op, r, link).items():
                    classes[r][cls] = classes[r].get(cls, 0.0) + nbytes
        else:
            for r, op in enumerate(ops):
                for i, (end, span) in enumerate(done[(r, op.channel)]):
                    idle = max(0.0, end - T[i][r])
                    exposed = min(idle, span)
                    by_q[i][r].parts["comm"] += exposed
                    by_q[i][r].parts["wait"] += idle - exposed
                    T[i][r] = max(T[i][r], end)
    for i in Q:
        for r in range(W):
            t = by_q[i][r]
            t.total_ms, t.fwd_ms = T[i][r], fwd_at[i][r]
            t.bytes_sent, t.bytes_by_class, t.kernel_calls = sent_rank[r], dict(classes[r]), calls[r]
    return times


def _collective_ms(op: Post, hosts: list[int], cluster: Cluster) -> float:
    """Milliseconds of a collective over ranks placed on ``hosts`` slots (module docstring)."""
    n = len(hosts)
    if n <= 1:
        return 0.0
    if op.op in ("all_gather", "reduce_scatter"):
        slowest = max((cluster.link(a, b) for a, b in zip(hosts, hosts[1:] + hosts[:1])),
                      key=lambda ln: ln.seconds(op.nbytes))
        return (n - 1) * slowest.seconds(op.nbytes) * 1e3  # W - 1 hops, each with its latency
    # all_to_all: 1/n of the tensor to each peer; each link class carries its peers' parts at once.
    message = op.nbytes / n
    worst = 0.0
    for me in hosts:
        by_link: dict[str, tuple[Link, int]] = {}
        for peer in hosts:
            if peer != me:
                ln = cluster.link(me, peer)
                by_link[ln.name] = (ln, by_link.get(ln.name, (ln, 0))[1] + 1)
        worst = max([worst] + [_stream_ms(ln, message, k) for ln, k in by_link.values()])
    return worst


def _by_class(op: Post, rank: int, link: Callable[[int, int], Link]) -> dict[str, float]:
    """Bytes ``rank`` sends over each link class for ``op`` (``link(a, b)``: the link between two ranks)."""
    if op.op == "p2p":
        return {link(rank, op.send_to).link_class: op.nbytes}
    n = len(op.group)
    out: dict[str, float] = {}
    if op.op in ("all_gather", "reduce_scatter"):
        # A ring collective passes W - 1 shards to the next member of the group's ring.
        i = op.group.index(rank)
        nxt = op.group[(i + 1) % n]
        out[link(rank, nxt).link_class] = op.nbytes * (n - 1)
        return out
    for peer in op.group:
        if peer != rank:
            cls = link(rank, peer).link_class
            out[cls] = out.get(cls, 0.0) + op.nbytes / n
    return out
