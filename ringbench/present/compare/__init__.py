"""``ringbench compare``: result records as a pivot table, a plot, and a regression gate.

Everything here reads the records of docs/contracts.md through :func:`ringbench.records.store.load`
and imports no torch; pandas and matplotlib are imported inside the functions that need them.

Which records count. Only ``run`` records with status ``ok``; the others are counted and
reported as left out. When one case (one ``case_id``) has several ok records, across files
or reruns, the latest (``created_at``) stands for it, unless a ``--by`` column that is not a
spec field (``source``, ``run_id``, ``env.torch``) tells them apart.

Predictions. A record of ``ringbench predict`` (``predicted: true``) is kept apart from the
measured records of its case: where both kinds are there, ``predicted`` names a row of its own
(``predicted`` or ``measured``) and the plot draws predictions long-dashed; where all are
predicted, the title says so.

Columns. Records are flattened (``spec.seqlen``, ``env.torch``); every ``spec.<field>`` is
also there under its short name (``seqlen``, ``world_size``, ``variant``, ``heads``...), so
``--where``, ``--x`` and ``--by`` can use either. ``kernel`` is the kernel that ran.

The modules, in the order a request flows through them:

- :mod:`~ringbench.present.compare.load`: records into a frame, ``--where``, the latest per case;
- :mod:`~ringbench.present.compare.metrics`: the metrics (``tflops``, ``time``...) and their decimals;
- :mod:`~ringbench.present.compare.pivot`: the grid of one metric, and the winners and best peers;
- :mod:`~ringbench.present.compare.gate`: the regression gate (thresholds, matching, verdicts);
- :mod:`~ringbench.present.compare.render`: the pivot and the gate as a rich table, Markdown, JSON lines;
- :mod:`~ringbench.present.compare.plot`: the pivot as a matplotlib figure.
"""

from __future__ import annotations

from ringbench.present.compare.gate import GateResult, GateRow, Threshold, gate, parse_threshold
from ringbench.present.compare.load import Loaded, load_runs, read_frame, to_parquet
from ringbench.present.compare.metrics import METRICS, Metric, get_metric
from ringbench.present.compare.pivot import Contest, Pivot, contest, pivot
from ringbench.present.compare.plot import plot
from ringbench.present.compare.render import (gate_json_lines, pivot_json_lines, pivot_markdown, print_gate,
                                              print_pivot)
from ringbench.errors import CompareError

__all__ = [
    "CompareError", "Contest", "GateResult", "GateRow", "Loaded", "METRICS", "Metric", "Pivot", "Threshold",
    "contest", "gate", "gate_json_lines", "get_metric", "load_runs", "parse_threshold", "pivot", "pivot_json_lines",
    "pivot_markdown", "plot", "print_gate", "print_pivot", "read_frame", "to_parquet",
]
