"""Price every rank's program and play them together: the slowest rank's time and what it spent it on.

Each rank has a host that issues every op in turn (each op's own host cost from the calibration,
``Calibration.issue_ms``: the engine's Python and the launch), a compute stream (kernels, merges,
adds, copies, one after another, each starting once the host has issued it, for its GPU time)
and a communication stream (transfers in issue order). An iteration replayed as a CUDA graph
(``graph=True``, ``run --cuda-graph``) is one launch: the host issues it once (``launch_ms``) and
no op waits for the host after that. A
:class:`~ringbench.model.schedule.Post` starts on the communication stream once the compute
stream has reached it and the previous transfer has finished; a point-to-point transfer needs
both ends (it starts when the later of sender and receiver is ready), a collective every member
of its group. A :class:`~ringbench.model.schedule.Wait` holds the compute stream until that
transfer is done. So a slow rank delays its neighbours' receives, and the slowest rank gates
the ring, as in the engines.

The critical path of a rank splits into compute (kernel time), overhead (merges, adds, copies,
and the GPU idle while the host issues), exposed communication (waiting while a transfer ran)
and waiting for peers (a transfer that could not start because another rank was late: the
imbalance). The four add up to its time.

Costs: a kernel call from the calibration's surface, a merge, add or copy from its bytes; a
transfer from the cluster's link between the two ranks (``fabric``): ring collectives
(all-gather, reduce-scatter) take ``W - 1`` hops of the shard over the slowest link of the
group's ring, an all-to-all sends ``1/U`` of the tensor to each peer, over each link class at
once.

The programs are priced once (:func:`price`, per kernel: each distinct op once, every rank's slot
an index into that table) and played (:func:`play`, per cluster and placement) with every rank and
every quantile at once in numpy arrays. Walking, pricing and playing are still W ranks of O(W)
Python ops each: ``ringbench predict`` of one zigzag case took 11-13 s at 512 ranks and 46-62 s at
1024 on an idle two-core machine (26 s and 136 s before this layout), a windowed one 10 s at 512.
Torch-free.

Source: issue 24.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ringbench.model.calibration import Calibration
from ringbench.model.fabric import Cluster, Link
from ringbench.model.schedule import Compute, Post

#: The parts of a rank's time, in the order tables show them.
PARTS = ("compute", "overhead", "comm", "wait")
#: More link classes than one transfer of one rank could send over (orders each rank's classes).
_CLASSES = 1024


@dataclass
class RankTime:
    """One rank's simulated time, ms, with its parts (they sum to ``total_ms``) and the bytes it sent."""

    total_ms: float = 0.0
    fwd_ms: float | None = None
    parts: dict = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    bytes_sent: float = 0.0
    bytes_by_class: dict = field(default_factory=dict)
    kernel_calls: int = 0


@dataclass
class Priced:
    """Every rank's program with each compute op's cost, ready to :func:`play`.

    Attributes:
        whiches: the calibration's quantiles, the first axis of every cost.
        launch_ms: the host's time to issue a transfer (and a graph's one launch).
        segments: per segment (the compute ops before one communication op), arrays over
            (op slot, quantile, rank): ``work`` ms, and over (op slot, rank): ``host`` (ms the
            host takes to issue the op), ``has`` (the rank has an op there), ``kernel`` (it is a
            kernel call), ``bwd`` (it is backward's); then that communication op of every rank
            (``None`` after the last); ``lane`` over (op slot, rank): 0 the compute stream, 1 the
            side stream, 2 a join; and for a :class:`Post`, ``(key, bwd)``: what names its pattern
            of peers and sizes, and over ranks whether it is backward's (else ``None``).
        kernel_calls: per rank.
    """

    whiches: tuple[str, ...]
    launch_ms: float
    segments: list
    kernel_calls: list[int]


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


def segments(programs: list[list]) -> list[list]:
    """Every rank's program (``schedule.programs``) cut into segments, once for any number of :func:`price` calls.

    Raises:
        ValueError: programs whose communication differs between ranks (an engine loop the model
            does not follow).
    """
    segs = [_split(p) for p in programs]
    if len({len(s) for s in segs}) != 1:
        raise ValueError("the ranks' programs have different numbers of transfers and waits")
    for j in range(len(segs[0])):
        kinds = {(type(o).__name__, getattr(o, "op", ""), o.channel) for o in (s[j][1] for s in segs)
                 if o is not None}
        if len(kinds) > 1 or (kinds and any(s[j][1] is None for s in segs)):
            raise ValueError(f"the ranks' programs differ at transfer {j}: {sorted(kinds)}")
    return segs


def price(segs: list[list], *, calibration: Calibration, kernel: str, whiches: tuple[str, ...] = ("mid",)) -> Priced:
    """Cost every compute op of the :func:`segments` of the programs at each quantile of ``whiches``."""
    W, Q = len(segs), len(whiches)
    issue: dict = {}
    # Every distinct op is described once, in a table; a segment's slots hold indices into it (0: no op),
    # since ranks share a few kinds of op (the same call at the same step) however many ranks there are.
    table = [((0.0,) * Q, 0.0, False, False, False, 0)]  # work, host, has, kernel, bwd, lane
    index: dict = {}

    def host_cost(op: Compute) -> float:
        if op.kind == "join":
            return 0.0
        key = (op.kind, op.call.mode if op.call is not None else None)
        if key not in issue:
            issue[key] = calibration.issue_ms(op.kind, kernel, key[1] or "fwd")
        return issue[key]

    def describe(op: Compute, shape) -> tuple:
        work = tuple(0.0 if op.kind == "join" else calibration.kernel_ms(kernel, op.call, shape, w)
                     if op.kind == "kernel" else calibration.overhead_ms(op.kind, op.nbytes, w) for w in whiches)
        lane = 2 if op.kind == "join" else int(op.side)  # 0 the compute stream, 1 the side stream, 2 a join
        return work, host_cost(op), True, op.kind == "kernel", op.phase == "bwd", lane

    slots = []
    for j in range(len(segs[0])):
        rows = [segs[r][j][0] for r in range(W)]
        at = [[0] * W for _ in range(max(map(len, rows)))]
        for r, row in enumerate(rows):
            for k, (op, shape) in enumerate(row):
                key = (op.kind, op.call, shape, op.nbytes, op.phase, op.side)
                u = index.get(key)
                if u is None:
                    u = index[key] = len(table)
                    table.append(describe(op, shape))
                at[k][r] = u
        slots.append(np.array(at, dtype=np.intp).reshape(len(at), W))
    work_t, host_t, has_t, kernel_t, bwd_t, lane_t = (np.array(col) for col in zip(*table))
    work_t = work_t.reshape(len(table), Q)
    segments, calls = [], np.zeros(W, dtype=int)
    for j, at in enumerate(slots):
        ops = [segs[r][j][1] for r in range(W)]
        post = None
        if isinstance(ops[0], Post):  # what play asks of every rank's transfer, once per program
            post = (_post_key(ops), np.array([op.phase == "bwd" for op in ops]))
        calls += kernel_t[at].sum(axis=0)
        segments.append((work_t[at].transpose(0, 2, 1), host_t[at].astype(float), has_t[at].astype(bool),
                         kernel_t[at].astype(bool), bwd_t[at].astype(bool), ops, lane_t[at].astype(int), post))
    return Priced(tuple(whiches), calibration.launch_ms, segments, [int(c) for c in calls])


def _post_key(ops: list) -> tuple:
    """What names the pattern of one transfer of every rank (:func:`_pattern`'s cache): its op and size,
    each rank's peers, and each rank's group as an index into the distinct group tuples (a ring's ranks
    share one tuple of W ranks: hashing every rank's would be W² per transfer)."""
    groups: dict = {}
    which = tuple(groups.setdefault(id(op.group), (len(groups), op.group))[0] for op in ops)
    return (ops[0].op, ops[0].nbytes, tuple(op.send_to for op in ops), tuple(op.recv_from for op in ops),
            tuple(g for _, g in groups.values()), which)


def play(priced: Priced, *, cluster: Cluster, place: Callable[[int], int] = lambda r: r,
         graph: bool = False) -> dict[str, list[RankTime]]:
    """Play priced programs on ``cluster`` (module docstring): per quantile, one :class:`RankTime` per rank.

    ``place`` gives each rank's host slot (the identity: ranks in order, node by node);
    ``graph``: the iteration is replayed as one CUDA graph, so the host issues it once and no op after.
    """
    Q, W = len(priced.whiches), len(priced.kernel_calls)
    T, H, free = np.zeros((Q, W)), np.zeros((Q, W)), np.zeros((Q, W))
    S = np.zeros((Q, W))  # where each rank's side stream is (overlap.py)
    if graph:
        H += priced.launch_ms  # the graph's one launch
    fwd_at = np.full((Q, W), np.nan)
    parts = {p: np.zeros((Q, W)) for p in PARTS}
    done: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    post_host = 0.0 if graph else priced.launch_ms
    links: dict[tuple[int, int], Link] = {}
    patterns: dict = {}
    sent = np.zeros(W)
    # Bytes per link class, each an array over ranks, and where each rank first sent over it (transfer
    # number, then place in that transfer's classes), which orders each rank's classes as it met them.
    by_class: dict[str, np.ndarray] = {}
    first: dict[str, np.ndarray] = {}

    def link(a: int, b: int) -> Link:
        if (a, b) not in links:
            links[(a, b)] = cluster.link(place(a), place(b))
        return links[(a, b)]

    def mark_bwd(mask: np.ndarray) -> None:
        first = mask & np.isnan(fwd_at[0])
        if first.any():
            fwd_at[:, first] = T[:, first]

    for n, (work, host, has, is_kernel, bwd, ops, lane, post) in enumerate(priced.segments):
        for k in range(work.shape[0]):
            mark_bwd(has[k] & bwd[k])
            if not graph:
                H += np.where(has[k], host[k], 0.0)
            main = has[k] & (lane[k] == 0)
            if not main.all():  # some ranks issue side-stream work or join it here
                T, S = _side(T, S, H, work[k], has[k] & (lane[k] == 1), has[k] & (lane[k] == 2), parts)
            gap = np.where(main, np.maximum(0.0, H - T), 0.0)  # the GPU idle, waiting for the host
            T += gap + np.where(main, work[k], 0.0)
            parts["overhead"] += gap + np.where(main & ~is_kernel[k], work[k], 0.0)
            parts["compute"] += np.where(main & is_kernel[k], work[k], 0.0)
        if ops[0] is None:
            continue
        if isinstance(ops[0], Post):
            key, post_bwd = post
            mark_bwd(post_bwd)
            H += post_host  # the host issues the transfer too
            ready = np.maximum(np.maximum(T, H), free)
            if ops[0].side:  # issued from the side stream, after the adds it sends
                ready = np.maximum(ready, S)
            if key not in patterns:
                patterns[key] = _pattern(ops, link, place, cluster)
            how = patterns[key]
            if ops[0].op == "p2p":
                to, frm, send, recv = how["to"], how["from"], how["send"], how["recv"]
                ends = np.maximum(np.maximum(ready, ready[:, to]) + send, np.maximum(ready[:, frm], ready) + recv)
                spans = np.broadcast_to(np.maximum(send, recv), ends.shape)
            else:
                ends = np.zeros((Q, W))
                for members, t in how["groups"]:
                    ends[:, members] = ready[:, members].max(axis=1, keepdims=True) + t
                spans = np.broadcast_to(how["span"], ends.shape)
            free = ends
            done[ops[0].channel] = (ends, spans)
            sent += how["sent"]
            for cls, nbytes, place_in in how["classes"]:
                if cls not in by_class:
                    by_class[cls], first[cls] = np.zeros(W), np.full(W, np.inf)
                by_class[cls] += nbytes  # 0.0 where a rank sends none over cls: its sum is unchanged
                new = (place_in >= 0) & np.isinf(first[cls])
                first[cls][new] = n * _CLASSES + place_in[new]
        else:
            end, span = done[ops[0].channel]
            idle = np.maximum(0.0, end - T)
            exposed = np.minimum(idle, span)
            parts["comm"] += exposed
            parts["wait"] += idle - exposed
            T = np.maximum(T, end)
    classes = [{cls: float(by_class[cls][r]) for cls in sorted((c for c in first if first[c][r] < np.inf),
                                                                 key=lambda c: first[c][r])} for r in range(W)]
    out = {}
    for i, w in enumerate(priced.whiches):
        out[w] = [RankTime(total_ms=float(T[i, r]), fwd_ms=None if np.isnan(fwd_at[i, r]) else float(fwd_at[i, r]),
                           parts={p: float(parts[p][i, r]) for p in PARTS}, bytes_sent=float(sent[r]),
                           bytes_by_class=dict(classes[r]), kernel_calls=priced.kernel_calls[r]) for r in range(W)]
    return out


#: The share of a side-stream merge's or add's GPU time that still lands on the compute stream: it runs
#: beside the next kernel, but takes SMs and memory bandwidth from it. Fitted to the one A/B measured
#: (H100, 2026-12-06, results/reference/2026-12-06-h100-b/call3/: emulated zigzag W=8 with flash-attn-4
#: went from 2.826 to 2.766 ms at 16k and 8.374 to 8.297 ms at 32k, where 0.5 had predicted 2.5x and
#: 4x those savings): about 0.8-0.875.
SIDE_SHARE = 0.85


def _side(T, S, H, work, on_side, join, parts):
    """One op slot where some ranks issue side-stream work (``on_side``) or join it (``join``): side
    work starts once the compute stream reached it, the host issued it and the side stream is free,
    and costs the compute stream :data:`SIDE_SHARE` of its time; a join holds the compute stream
    until the side stream is done. Returns the new ``(T, S)``."""
    start = np.maximum(np.maximum(S, T), H)
    S = np.where(on_side, start + work, S)
    stolen = np.where(on_side, SIDE_SHARE * work, 0.0)
    idle = np.where(join, np.maximum(0.0, S - T), 0.0)
    parts["overhead"] += stolen + idle
    return T + stolen + idle, S


def simulate(programs: list[list], *, calibration: Calibration, kernel: str, cluster: Cluster,
             whiches: tuple[str, ...] = ("mid",), place: Callable[[int], int] = lambda r: r, graph: bool = False
             ) -> dict[str, list[RankTime]]:
    """:func:`segments`, :func:`price` then :func:`play`: per quantile of ``whiches``, one :class:`RankTime` per rank."""
    return play(price(segments(programs), calibration=calibration, kernel=kernel, whiches=whiches), cluster=cluster,
                place=place, graph=graph)


def issue_and_run_ms(priced: Priced, rank: int = 0, which: int = 0) -> tuple[float, float]:
    """``(host_ms, gpu_ms)`` of one eager iteration of ``rank``: the host's time to issue every op
    (transfers at ``launch_ms``) and the GPU's time to run the compute ops, at quantile index
    ``which``; what ``run --cuda-graph auto`` compares (``rank.graphs.issue_and_run_ms``)."""
    host = gpu = 0.0
    for work, cost, has, _, _, ops, _, _ in priced.segments:
        host += float(cost[:, rank].sum()) + (priced.launch_ms if ops[0] is not None and isinstance(ops[0], Post)
                                              else 0.0)
        gpu += float(np.where(has[:, rank], work[:, which, rank], 0.0).sum())
    return host, gpu


def _pattern(ops: list, link, place, cluster: Cluster) -> dict:
    """What one transfer of every rank costs and sends: durations, groups, bytes per rank and class."""
    W = len(ops)
    # per link class: the bytes each rank sends over it, and its place among that rank's classes (-1: none)
    classes: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for r, op in enumerate(ops):
        for place_in, (cls, nbytes) in enumerate(_by_class(op, r, link).items()):
            if cls not in classes:
                classes[cls] = (np.zeros(W), np.full(W, -1))
            sent, where = classes[cls]
            sent[r], where[r] = nbytes, place_in
    out: dict = {"sent": np.array([_sent_bytes(op) for op in ops]),
                 "classes": [(cls, sent, where) for cls, (sent, where) in classes.items()]}
    if ops[0].op == "p2p":
        out["to"] = np.array([op.send_to for op in ops])
        out["from"] = np.array([op.recv_from for op in ops])
        out["send"] = np.array([link(r, op.send_to).seconds(op.nbytes) * 1e3 for r, op in enumerate(ops)])
        out["recv"] = np.array([link(op.recv_from, r).seconds(op.nbytes) * 1e3 for r, op in enumerate(ops)])
        return out
    groups, span = {}, np.zeros(W)
    for r, op in enumerate(ops):
        if op.group not in groups:
            groups[op.group] = _collective_ms(op, [place(m) for m in op.group], cluster)
        span[r] = groups[op.group]
    out["groups"] = [(np.array(g), t) for g, t in groups.items()]
    out["span"] = span
    return out


def _stream_ms(link: Link, message: float, count: float) -> float:
    """``count`` messages of ``message`` bytes one after another over ``link``, ms (one latency)."""
    if message <= 0 or count <= 0:
        return 0.0
    if link.curve:
        return count * link.seconds(message) * 1e3
    return (link.latency_us * 1e-6 + count * message / (link.gb_s * 1e9)) * 1e3


def _sent_bytes(post: Post) -> float:
    """The bytes a rank counts as sent for ``post`` (``comm.py``'s rules)."""
    n = len(post.group)
    if post.op == "p2p":
        return post.nbytes
    if post.op in ("all_gather", "reduce_scatter"):
        return post.nbytes * (n - 1)
    if post.op == "all_to_all":
        return post.nbytes * (n - 1) / n
    raise ValueError(f"unknown transfer {post.op!r}")


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
        out[link(rank, op.group[(i + 1) % n]).link_class] = op.nbytes * (n - 1)
        return out
    for peer in op.group:
        if peer != rank:
            cls = link(rank, peer).link_class
            out[cls] = out.get(cls, 0.0) + op.nbytes / n
    return out
