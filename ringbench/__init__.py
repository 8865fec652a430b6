"""ringbench: run, verify and compare context-parallel (ring) attention variants.

The harness launches one process per rank, runs a registered variant from
``ringbench.variants`` on each rank's shard, checks the result against single-device
attention within a stated tolerance, measures time, FLOPs and memory, and appends one
JSON record per case. ``ringbench --help`` lists the commands; importing this package
imports no torch.
"""

__version__ = "0.1.0"
