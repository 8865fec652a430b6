# A probe for the A/B of 2026-12-07 (fourth session), not part of ringbench: with
# RINGBENCH_PROBE_UNFUSED=1 and this folder first on PYTHONPATH, every process (torchrun's workers
# too) folds a step's window calls as before (window.attend: torch's merge_, several launches a
# part; attend_backward: three adds a part) instead of one merge_step / add_steps launch a part.
import os
import site

if os.path.isdir("/tmp/site"):  # flash-attn-4's install on the GPU machine (its own sitecustomize)
    site.addsitedir("/tmp/site")

if os.environ.get("RINGBENCH_PROBE_UNFUSED") == "1":
    import sys
    import types

    from ringbench.variants.engines import window
    from ringbench.variants.kernels.common import merge_

    def merge_step(out, lse, rows, block_out, block_lse, *, into, inv=None):
        merge_(out[:, rows], lse[:, :, rows], block_out, block_lse)
        return out

    def add_steps(jobs):
        for acc, rows, grad, *_ in jobs:
            acc[:, rows] += grad
        return [job[0] for job in jobs]

    window.merge = types.SimpleNamespace(merge_step=merge_step, add_steps=add_steps)
    print("ringbench probe: window calls folded unfused in this process", file=sys.stderr)
