"""``ringbench predict``, ``advise`` and ``calibrate``: a calibrated model of every variant at any world size.

- ``fabric``: the fabric table (``fabrics.toml``) and the cluster (ranks on hosts, links between them);
- ``calibration``: the calibration file (kernel rate surfaces, per-step overheads) and its lookups;
- ``gpus``: which GPU a prediction is for, and the calibration that prices it (or derives it);
- ``schedule``: every rank's program, walked from the engines' own plans;
- ``simulate``: the programs played together on the cluster, the slowest rank's critical path;
- ``memory``: peak memory per rank, estimated from shapes;
- ``predict``: one case's predicted record; ``advise``: every candidate ranked; ``calibrate``: the measurement;
- ``against``: measured records predicted and their errors; ``published``: another library's published table predicted.

Beside ``sweep/``: imported by the CLI, it imports ``case/``, ``records/``, the peaks table and the
engines' plan functions, never a process group. Source: issue 24.
"""
