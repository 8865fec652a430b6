"""The per-head max logit (``--max-logit``, issue 26 item 2) without torchrun: the math kernel's maximum
against plain torch under the causal mask, a mask, a window and a bias; the accumulator's rules; the
spec's and the command line's refusals; case_id; and world-size-1 verify in-process (a gloo group of one).
The runs over ranks are ``test_max_logit_distributed.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers import ringbench_here
from ringbench.case.spec import CaseSpec, default_fields, validate
from ringbench.errors import SpecError
from ringbench.rank import check
from ringbench.variants import VARIANTS
from ringbench.variants.kernels import KERNELS
from ringbench.variants.kernels.common import Bias, PositionMask, alibi_slopes
from ringbench.variants.kernels.max_logit import MaxLogit, with_max_logit

#: Awkward sizes on purpose: 37 rows in tiles of 16, GQA 4/2, batch 2.
B, S, H, HKV, D = 2, 37, 4, 2, 8


def spec(variant: str = "ring", world_size: int = 2, **fields) -> CaseSpec:
    """A validated CPU verify spec of a small problem with --max-logit (raises SpecError when refused)."""
    base = {**default_fields("cpu", 0), "task": "verify", "variant": variant, "kernel": "math",
            "world_size": world_size, "seqlen": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "max_logit": True,
            **fields}
    case = CaseSpec(**base)
    validate(case, visible_gpus=0)
    return case


def _inputs():
    gen = torch.Generator().manual_seed(3)
    return tuple(torch.randn(shape, generator=gen, dtype=torch.float64)
                 for shape in ((B, S, H, D), (B, S, HKV, D), (B, S, HKV, D)))


def _plain_max(q, k, seen: torch.Tensor, added: torch.Tensor | None = None) -> torch.Tensor:
    """Each head's largest scaled score over the pairs ``seen`` (bool ``[S, S]``), plus ``added``
    (``[1 or B, H, S, S]``), by plain torch, float64 ``[H]``."""
    g = q.shape[2] // k.shape[2]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(g, 2)) * q.shape[-1] ** -0.5
    if added is not None:
        scores = scores + added
    return scores.masked_fill(~seen, -math.inf).amax(dim=(0, 2, 3))


def _kernel_max(**kw) -> torch.Tensor:
    q, k, v = _inputs()
    peak = MaxLogit.empty(H, torch.float64, "cpu")
    KERNELS["math"].forward(q, k, v, kw.pop("causal", False), D ** -0.5, chunk=16, max_logit=peak, **kw)
    return peak.values


def test_max_logit_math_kernel_matches_plain_torch_causal_full_window_mask_and_bias():
    q, k, _ = _inputs()
    rows = torch.arange(S)
    causal = rows[None, :] <= rows[:, None]
    every = torch.ones(S, S, dtype=torch.bool)
    torch.testing.assert_close(_kernel_max(causal=True), _plain_max(q, k, causal), rtol=0, atol=1e-12)
    torch.testing.assert_close(_kernel_max(), _plain_max(q, k, every), rtol=0, atol=1e-12)
    band = causal & (rows[:, None] - rows[None, :] < 5)
    torch.testing.assert_close(_kernel_max(window=(4, 0)), _plain_max(q, k, band), rtol=0, atol=1e-12)
    # A prefix mask: the first 9 rows see each other both ways, causal after.
    prefix = causal | ((rows[:, None] < 9) & (rows[None, :] < 9))
    mask = PositionMask(rows, rows, lambda qp, kp: (kp <= qp) | ((qp < 9) & (kp < 9)), "prefix:9", dense=prefix)
    torch.testing.assert_close(_kernel_max(mask=mask), _plain_max(q, k, prefix), rtol=0, atol=1e-12)
    bias = Bias("alibi", torch.tensor(alibi_slopes(H), dtype=torch.float64))
    added = bias.at(rows, rows).dense(torch.float64)
    got = _kernel_max(causal=True, bias=bias.at(rows, rows))
    torch.testing.assert_close(got, _plain_max(q, k, causal, added), rtol=0, atol=1e-12)
    assert not torch.equal(got, _kernel_max(causal=True))  # the bias is in the maximum


def test_max_logit_accumulator_views_raise_their_heads_only_and_refuse_other_heads():
    peak = MaxLogit.empty(4, torch.float32, "cpu")
    peak.heads(slice(2, 4)).meet(torch.full((1, 2, 1, 3, 3), 7.0))
    assert peak.values.tolist() == [-math.inf, -math.inf, 7.0, 7.0]
    peak.meet(torch.empty(1, 4, 0, 3))  # an empty tile changes nothing
    with pytest.raises(ValueError, match=r"^a tile of scores holds 3 heads, but the max logit accumulator holds 4; "):
        peak.meet(torch.zeros(1, 3, 2, 2))
    with pytest.raises(ValueError, match=r"^the cpu kernel cannot return the per-head max logit \("):
        with_max_logit(KERNELS["cpu"], peak)
    assert with_max_logit(KERNELS["cpu"], None) is KERNELS["cpu"]


def test_max_logit_is_in_the_case_id_and_ids_without_it_stay_what_they_were():
    plain, peaked = spec(max_logit=False), spec()
    assert plain.case_id() != peaked.case_id()
    without = {k: v for k, v in plain.to_dict().items() if k != "max_logit"}
    assert CaseSpec.from_dict(without).case_id() == plain.case_id()


def test_max_logit_taken_by_the_batch_engines_and_the_math_kernel_only():
    takers = sorted(n for n, v in VARIANTS.items() if "max_logit" in v.options)
    assert takers == sorted(["ring", "zigzag", "stripe", "llama3", "ulysses", "usp"])
    assert [n for n, k in KERNELS.items() if k.takes_max_logit] == ["math"]


@pytest.mark.parametrize("fields, message", [
    (dict(kernel="cpu"), r"^the cpu kernel cannot return the per-head max logit \(its op returns out and lse only, "
                         r"never the scores' maximum\), which --max-logit needs; pass --kernel math$"),
    (dict(variant="zigzag_varlen", docs="32,32"),
     r"^zigzag_varlen cannot return the per-head max logit \(--max-logit\), since only ringbench's batch engines "
     r"raise it block by block and take its maximum over the group; use one of ring, zigzag, stripe, llama3, "
     r"ulysses, usp$"),
    (dict(hf_model="llama-tiny"), r"^max_logit does not go with hf_model llama-tiny"),
])
def test_max_logit_refusals_name_the_value_and_the_rule(fields, message):
    with pytest.raises(SpecError, match=message):
        spec(**fields)


@pytest.mark.parametrize("kernel", ["flash-attn", "torch-flash", "cudnn", "flash-attn-4", "cpu"])
def test_max_logit_refused_on_the_command_line_with_exit_2(tmp_path, kernel):
    proc = ringbench_here("verify", "--device", "cpu", "--variant", "ring", "--world-size", "2", "--seqlen", "64",
                     "--head-dim", "16", "--kernel", kernel, "--max-logit", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"the {kernel} kernel cannot return the per-head max logit" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "results").exists()


def test_max_logit_auto_kernel_resolves_to_math_on_cpu():
    from ringbench.case.spec import resolve

    assert resolve(spec(kernel="auto")).kernel == "math"


@pytest.mark.parametrize("variant, fields", [("zigzag", {}), ("llama3", {"bias": "alibi"}),
                                             ("ulysses", {"mask": "prefix:20"})])
def test_max_logit_world_size_1_in_process(solo_group, variant, fields):
    """verify_case at world size 1 on a gloo group of one: max_logit is the last check, [heads] float32, and passes."""
    from ringbench.case.spec import resolve_mask

    case = resolve_mask(spec(variant, 1, **fields))
    got = check.verify_case(case, device=torch.device("cpu"), group=solo_group)
    assert got["status"] == "ok", got["reason"]
    entry = got["checks"][-1]
    assert entry["tensor"] == "max_logit" and entry["dtype"] == "float32" and entry["shape_ok"], entry
    assert entry["passed"] and entry["shadow_err"] is None, entry
