"""Time a sleep on every rank of a real torchrun job (gloo, CPU) through ``bench.time_iterations``.

    python -m torch.distributed.run --nproc-per-node W tests/dist/timing_loop.py \
        --iters N --min-time-ms X --out FOLDER

Rank r sleeps ``(r + 1) * 0.5`` ms per iteration, so the ranks need different counts to spend
the budget; each writes ``FOLDER/rank<r>.json``: ``{"count", "spent_ms", "flushes"}`` (flushes: the
calls of the flush hook, one before each timed iteration). ``tests/dist/verify_cases.py`` runs the same
loop (:func:`budget`) as a case of the session's pooled launch, rank 0 recording every rank's result.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ringbench.rank.bench import time_iterations


def budget(iters: int, min_time_ms: float) -> dict:
    """This rank's timed loop in the default process group: ``{"count", "spent_ms", "flushes"}``."""
    rank = dist.get_rank()
    flushes = []
    times = time_iterations(lambda: time.sleep((rank + 1) * 0.5e-3), iters=iters, warmup=1,
                            device=torch.device("cpu"), min_time_ms=min_time_ms,
                            flush=lambda: flushes.append(1))
    return {"count": len(times), "spent_ms": sum(times), "flushes": len(flushes)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, required=True)
    parser.add_argument("--min-time-ms", type=float, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    (args.out / f"rank{rank}.json").write_text(json.dumps(budget(args.iters, args.min_time_ms)))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
