# A probe for the A/B of 2026-12-07 (third session), not part of ringbench: with
# RINGBENCH_PROBE_NO_COALESCE=1 and this folder first on PYTHONPATH, every process (torchrun's workers
# too) builds masks from their slices as they were before coalescing (one window call per answer).
import os

if os.environ.get("RINGBENCH_PROBE_NO_COALESCE") == "1":
    from ringbench.variants.engines import masks

    masks.coalesced = lambda slices: tuple(slices)
    import sys

    print("ringbench probe: mask slices not coalesced in this process", file=sys.stderr)
