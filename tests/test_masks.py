"""Any mask, without a process group: the torch-free slices (``variants/engines/masks.py``) against masks
written here from each family's definition, the field's and the files' refusals, the work and FLOPs they
give, the engine's steps, and the math kernel's dense mask against float64 attention written apart."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ringbench_here
from ringbench.case.spec import CaseSpec, default_fields, resolve_mask
from ringbench.case.work import attention_flops, pairs_per_rank
from ringbench.errors import SpecError
from ringbench.variants.engines import bands, masked, masks

DATA = Path(__file__).parent / "data" / "masks"
FILES = ("magi_varlen_block_causal", "two_sided_window", "image_in_text")


def _kind_sees(kind: str, q0: int, q1: int, k0: int, k1: int, q: int, k: int) -> bool:
    """MagiAttention's slice types, from their definition: row i = q - q0 of m, key j = k - k0 of n."""
    if not (q0 <= q < q1 and k0 <= k < k1):
        return False
    i, j, m, n = q - q0, k - k0, q1 - q0, k1 - k0
    below = j <= i + (n - m)  # causal: aligned bottom-right
    above = j >= i  # inverse causal: aligned top-left
    return {"full": True, "causal": below, "inv-causal": above, "bi-causal": below and above}[kind]


def _sees(text: str, S: int, q: int, k: int) -> bool:
    """Whether query q sees key k under the mask ``text`` over S tokens, written from the families' words."""
    name, _, params = text.partition(":")
    if name == "slices":
        return any(_kind_sees(e[4], *map(int, e[:4]), q, k) for e in (x.split(",") for x in params.split(";")))
    args = params.split(",")
    if name == "window":
        left, right = int(args[0]), int(args[1]) if len(args) > 1 else 0
        return q - left + 1 <= k <= q + right
    if name == "prefix":
        p = int(args[0])
        return (q < p and k < p) or (q >= p and k <= q)
    if name == "shared-prefix":
        p, a = int(args[0]), int(args[1].split("=")[1])
        n = (S - p) // a
        if q < p:
            return k <= q
        start = p + (q - p) // n * n
        return k < p or start <= k <= q
    if name == "chunked":
        c = int(args[0])
        return k <= q and k // c == q // c
    if name == "global":
        g, w = int(args[0]), int(args[1].split(":")[1])
        return k <= q and (k < g or q - k < w)
    raise AssertionError(text)


def _dense(text: str, S: int) -> torch.Tensor:
    return torch.tensor([[_sees(text, S, q, k) for k in range(S)] for q in range(S)])


FAMILIES = ["window:5", "window:3,4", "prefix:7", "shared-prefix:5,answers=3", "chunked:6", "global:3,window:4",
            "slices:0,10,0,10,causal;10,20,0,20,inv-causal;20,24,3,30,bi-causal;24,30,0,5,full;24,30,5,9,bi-causal;"
            "30,32,0,32,causal"]


def _positions(run: bands.Run) -> torch.Tensor:
    return torch.tensor([run.start + run.stride * i for i in range(run.count)], dtype=torch.int64)


@pytest.mark.parametrize("text", FAMILIES)
def test_masks_area_pairs_and_predicate_match_each_familys_definition(text):
    """The slices hold exactly the pairs the family's words say, none twice; the area and every block's
    pairs (contiguous, zigzag and stripe runs, and a stripe against every key) are the dense mask's counts."""
    S = 32
    mask = masks.build(text, S)
    want = _dense(masks.parse(text), S)
    pos = torch.arange(S)
    assert torch.equal(mask.allows(pos[:, None], pos[None, :]), want)
    cover = sum(s.allows(pos[:, None], pos[None, :]).long() for s in mask.slices)
    assert int(cover.max()) == 1 and mask.area() == int(want.sum()) > 0
    every = bands.Run(0, 0, 1, S)
    checked = 0
    for W in (2, 4):
        for layout in ("contiguous", "zigzag", "stripe"):
            runs = [bands.layout_runs(layout, S, r, W) for r in range(W)]
            for mine in runs:
                for q in mine:
                    assert mask.pairs(q, every) == int(want[_positions(q)].sum())
                    for theirs in runs:
                        for k in theirs:
                            n = int(want[_positions(q)][:, _positions(k)].sum())
                            assert mask.pairs(q, k) == n
                            assert mask.classify(q, k) == ("empty" if n == 0 else "full" if n == q.count * k.count
                                                           else "partial")
                            checked += 1
    assert checked > 50


@pytest.mark.parametrize("kind", masks.KINDS)
@pytest.mark.parametrize("shape", [(5, 9), (9, 5), (7, 7), (1, 4)])
def test_masks_slice_area_is_its_types_pair_count(kind, shape):
    """Each of MagiAttention's types over a rectangle of more keys, more queries or as many: bi-causal is the
    diagonal band of n - m + 1 keys per row (the diagonal alone for a square, nothing for more queries)."""
    m, n = shape
    s = masks.Slice.of_kind(3, 3 + m, 10, 10 + n, kind)
    want = sum(_kind_sees(kind, 3, 3 + m, 10, 10 + n, q, k) for q in range(3, 3 + m) for k in range(10, 10 + n))
    assert s.area() == want
    if kind == "bi-causal":
        assert s.area() == (m * (n - m + 1) if n >= m else 0)


def test_masks_parse_writes_one_text_per_mask_and_refuses_in_one_sentence():
    assert masks.parse("window:64,0") == "window:64"
    assert masks.parse(" Prefix:1k ") == "prefix:1024"
    assert masks.parse("global:4,window=1k") == masks.parse("global:4,window:1024") == "global:4,window:1024"
    assert masks.parse("shared-prefix:2k,answers:4") == "shared-prefix:2048,answers=4"
    for bad, words in (("bogus:3", "not a mask ringbench knows"), ("prefix:x", "not a whole number"),
                       ("chunked", "not of the form chunked:C"), ("window:0", "must be 1 or more"),
                       ("full:3", "takes no parameters"),
                       ("slices:0,4,0,4,causal;2,6,0,6,full", "share pairs"),
                       ("slices:0,4,0,4,triangle", "not one of full, causal, inv-causal, bi-causal")):
        with pytest.raises(ValueError, match=words) as exc:
            masks.parse(bad)
        assert bad.split(";")[0].split(",")[0].split(":")[0] in str(exc.value) and "\n" not in str(exc.value)
    for text, seqlen, words in (("prefix:300", 256, "not shorter than seqlen 256"),
                                ("shared-prefix:10,answers=4", 256, "pass --seqlen 258"),
                                ("slices:0,300,0,10,full", 256, "past seqlen 256")):
        reason = masks.rule(masks.parse(text), seqlen)
        assert reason is not None and words in reason, reason
        assert masks.rule(masks.parse(text), {"prefix:300": 301, "slices:0,300,0,10,full": 300}.get(text, 258)) is None


def test_masks_files_read_into_slices_and_the_two_sided_file_is_window_9_4():
    texts = {name: masks.read_file(DATA / f"{name}.txt") for name in FILES}
    assert masks.label(texts["magi_varlen_block_causal"]) == "magi_varlen_block_causal(7)"
    magi = masks.build(texts["magi_varlen_block_causal"], 960)
    # Three samples of 512, 256 and 192 tokens in blocks of 128: block b sees blocks 0..b of its sample.
    assert magi.area() == 128 * 128 * (1 + 2 + 3 + 4) + 128 * 128 * (1 + 2) + 192 * 192
    pos = torch.arange(256)
    band = masks.build(texts["two_sided_window"], 256)
    assert torch.equal(band.allows(pos[:, None], pos[None, :]),
                       masks.build("window:9,4", 256).allows(pos[:, None], pos[None, :]))
    assert masks.label(texts["image_in_text"]) == "image_in_text(5)"
    assert masks.label(masks.unnamed(texts["image_in_text"])) == "slices(5)"


@pytest.mark.parametrize("body, words", [("0 4 0 4 causal\n2 6 0 6 full\n", "share pairs"),
                                         ("0 4 0\n", "line 1"), ("# only a comment\n", "holds no slice"),
                                         ("0 4 4 0 full\n", "empty or negative range")])
def test_masks_file_refusals_name_the_file_and_the_rule(tmp_path, body, words):
    path = tmp_path / "m.txt"
    path.write_text(body)
    with pytest.raises(ValueError, match=words) as exc:
        masks.read_file(path)
    assert str(path) in str(exc.value)


def _spec(**fields) -> CaseSpec:
    base = {**default_fields("cpu", 0), "task": "verify", "variant": "ring", "world_size": 4, "seqlen": 256,
            "heads": 4, "kv_heads": 2, "head_dim": 16}
    return CaseSpec(**{**base, **fields})


def test_masks_plain_ones_are_the_plain_cases_and_the_others_set_causal_false():
    """``--mask causal``, ``full`` and ``window:L`` are the cases of --causal, --no-causal and --window
    (one case_id each); any other mask leaves causal false, the mask alone deciding."""
    plain = _spec()
    assert resolve_mask(_spec(mask="causal")).case_id() == plain.case_id()
    assert resolve_mask(_spec(mask="full")).case_id() == _spec(causal=False).case_id()
    assert resolve_mask(_spec(mask="window:64")).case_id() == _spec(window=64).case_id()
    named = resolve_mask(_spec(mask="prefix:40"))
    assert named.mask == "prefix:40" and named.causal is False and named.case_id() != plain.case_id()


def test_masks_fields_refuse_contradictions_before_torch_loads():
    """The field's and the variant's rules answer without torch: a mask beside --window, a mask that does
    not fit the seqlen, a peer, a bad family."""
    code = """
import sys
from ringbench.case.spec import check_fields
for given in ({"variant": "ring", "mask": "prefix:40", "window": 8, "seqlen": 256, "world_size": 2},
              {"variant": "ring", "mask": "prefix:300", "seqlen": 256, "world_size": 2},
              {"variant": "rfa_llama3_varlen", "mask": "chunked:8", "seqlen": 256, "world_size": 2},
              {"mask": "bogus"}):
    try:
        check_fields(given)
    except Exception as exc:
        print(type(exc).__name__, exc)
print("torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[-1] == "False", out
    assert len(out) == 5 and all(line.startswith("SpecError ") for line in out[:4]), out
    assert "--window L is the short form of --mask window:L" in out[0]
    assert "not shorter than seqlen 256" in out[1]
    assert "rfa_llama3_varlen cannot take mask chunked:8" in out[2]
    assert "mask 'bogus' is not a mask ringbench knows" in out[3]
    with pytest.raises(SpecError, match="mask prefix:40 says alone which keys each query sees"):
        from ringbench.case.options import check_given

        check_given({"variant": ["ring"], "mask": ["prefix:40"], "causal": False})


def test_masks_cli_refuses_a_mask_file_it_cannot_read_with_exit_2(tmp_path):
    """On the command line as a user types it: one sentence on stderr, exit 2, nothing launched."""
    missing = ringbench_here("run", "--device", "cpu", "--variant", "zigzag", "--mask-file", str(tmp_path / "none.txt"),
                             "--out", str(tmp_path), cwd=tmp_path)
    assert missing.returncode == 2 and "mask-file" in missing.stderr and "cannot be read" in missing.stderr
    assert not (tmp_path / "runs.jsonl").exists()


def test_masks_a_named_kernel_that_takes_no_mask_is_refused_naming_the_mask():
    from ringbench.variants.kernels import KERNELS, check_kernel

    reason = check_kernel(KERNELS["cudnn"], "cuda", mask="prefix:64")
    assert reason.startswith("the cudnn kernel cannot take mask prefix:64 (a mask runs as a dense block or as one "
                             "window call per slice, and PyTorch's cuDNN attention op takes no window size); pass "
                             "--kernel with one of ")
    assert reason.endswith(" or auto") and "torch-flash" in reason and "flash-attn-4" in reason


def test_masks_verify_refuses_a_dense_reference_past_its_limit():
    from ringbench.case.spec import validate

    with pytest.raises(SpecError, match=f"above {masks.DENSE_LIMIT} tokens.*pass --seqlen {masks.DENSE_LIMIT}"):
        validate(resolve_mask(_spec(mask="prefix:40", seqlen=2 * masks.DENSE_LIMIT, kernel="math")), visible_gpus=0)


@pytest.mark.parametrize("variant, degree", [("ring", 0), ("zigzag", 0), ("stripe", 0), ("llama3", 0),
                                             ("ulysses", 0), ("usp", 2)])
def test_masks_predicted_work_and_flops_count_only_unmasked_pairs(variant, degree):
    spec = resolve_mask(_spec(variant=variant, mask="shared-prefix:28,answers=3", ulysses_degree=degree, batch=2))
    area = masks.build(spec.mask, 256).area()
    pairs = pairs_per_rank(spec)
    assert sum(pairs) == 2 * area and len(pairs) == 4
    flops = attention_flops(batch=2, seqlen=256, heads=4, head_dim=16, causal=False, mode="fwd_bwd", mask=spec.mask)
    assert flops == 3.5 * 4 * 2 * area * 4 * 16
    if variant == "ring":  # the contiguous ring: the first rank holds the prompt and the least work
        assert pairs[0] < pairs[-1]


def test_masks_ring_steps_skip_empty_blocks_and_end_the_forward_ring_early():
    """Under chunked:64 at W=4 a rank's queries see its own block only: one forward step, no transfer;
    under prefix:40 rank 0 sees no later rank. The steps of one argument set are built once."""
    from ringbench.variants.engines import masked

    dev = torch.device("cpu")
    steps = masked.ring_steps(masks.build("chunked:64", 256), "contiguous", 64, 3, 4, dev)
    assert steps.n_steps == 1 and steps(0, 3) is not None and all(steps(s, (3 - s) % 4) is None for s in (1, 2, 3))
    assert masked.ring_steps(masks.build("chunked:64", 256), "contiguous", 64, 3, 4, dev) is steps
    prefix = masks.build("prefix:40", 256)
    first = masked.ring_steps(prefix, "contiguous", 64, 0, 4, dev)
    assert [first(s, (0 - s) % 4) is not None for s in range(4)] == [True, False, False, False]
    last = masked.ring_steps(prefix, "contiguous", 64, 3, 4, dev)
    assert all(last(s, (3 - s) % 4) is not None for s in range(4)) and last.n_steps == 4
    # Block (rank 3, source 0): keys 0..63 all precede the queries 192..255, so one full part, no mask.
    (part,) = last(3, 0).parts
    assert part.mask is None and part.q == (0, 64) and part.kv == (0, 64)
    (diag,) = last(0, 3).parts
    assert diag.mask is not None and diag.mask.dense() is diag.mask.dense()  # built once, kept


def _attention_fp64(q, k, v, seen, scale):
    groups = q.shape[2] // k.shape[2]
    k, v = (t.double().repeat_interleave(groups, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k) * scale
    scores = scores.masked_fill(~seen, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", torch.exp(scores - lse[..., None].clamp_min(-1e300)), v), lse


def test_masks_math_kernel_takes_a_position_mask_rectangular_and_with_rows_that_see_nothing():
    from ringbench.variants.kernels import KERNELS
    from ringbench.variants.kernels.common import PositionMask

    mask = masks.build("chunked:8", 64)
    qp, kp = torch.arange(20, 44), torch.arange(8, 40)  # 24 queries, 32 keys: rows 40..43 see none of 8..39
    pm = PositionMask(qp, kp, mask.allows, mask.text)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 24, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 32, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 32, 2, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    math_kernel = KERNELS["math"]
    out, lse = math_kernel.forward(q, k, v, False, 0.3, mask=pm)
    lse = lse.detach()
    ref_out, ref_lse = _attention_fp64(q, k, v, pm.dense(), 0.3)
    ref_lse = ref_lse.detach()
    seen = torch.isfinite(ref_lse)
    assert not bool(seen[..., -4:].any())  # the rows past the last chunk's keys
    assert torch.equal(torch.isfinite(lse), seen) and float((lse - ref_lse)[seen].abs().max()) < 1e-12
    assert float((out - ref_out).detach().abs().max()) < 1e-12 and bool((out[:, -4:] == 0).all())
    dout = torch.randn_like(out)
    with torch.no_grad():
        grads = math_kernel.backward(dout, q, k, v, out, lse, False, 0.3, mask=pm)
    ref_out.backward(dout)
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        assert float((got - want).abs().max()) < 1e-12
    with pytest.raises(ValueError, match="takes neither causal=True nor a window"):
        math_kernel.forward(q, k, v, True, 0.3, mask=pm)


def _attention_sink_fp64(q, k, v, seen, scale, sink):
    """Plain float64 attention under the bool ``[S, S]`` mask ``seen``, the sink one more logit column of
    every row (it takes weight and has no value)."""
    groups = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(groups, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~seen, -math.inf)
    every = torch.cat([scores, sink[None, :, None, None].expand(*scores.shape[:-1], 1)], dim=-1)
    lse = torch.logsumexp(every, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", torch.exp(every - lse[..., None])[..., :-1], v), lse


@pytest.mark.parametrize("text", FAMILIES)
def test_masks_sink_references_are_masked_attention_with_a_sink_column_written_apart(text):
    """verify's float64 reference and single-device run of a case with a mask and a learnable sink (and a
    value head dim apart from the query one) are attention under the family's own dense mask with the sink
    as one more logit column: out, lse with the sink, dq, dk, dv and d sink, by autograd."""
    from ringbench.rank import sink_pad
    from ringbench.variants.kernels import KERNELS

    S, scale, text = 32, 8 ** -0.5, masks.parse(text)
    gen = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(2, S, h, d, generator=gen, dtype=torch.float64)
                     for h, d in ((4, 8), (2, 8), (2, 6), (4, 6)))
    sink = torch.randn(4, generator=gen, dtype=torch.float64)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, sink)]
    want_out, want_lse = _attention_sink_fp64(*leaves[:3], _dense(text, S), scale, leaves[3])
    (want_out * dout).sum().backward()
    want = (want_out, want_lse, *(leaf.grad for leaf in leaves))
    ref = sink_pad.reference_fp64((q, k, v, dout), None, True, scale, sink.clone().requires_grad_(True), None,
                                  mask=text)
    single = sink_pad.single_row(KERNELS["math"], (q, k, v, dout), None, True, scale,
                                 sink.clone().requires_grad_(True), None, mask=text)
    for got in (ref, single):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w.detach(), rtol=0, atol=1e-11)


def test_masks_take_a_sink_and_a_value_head_dim_on_every_batch_engine():
    """A sink (learnable or off-by-one) and head_dim_v beside any mask pass the spec's rules on the six batch
    engines, and on the varlen ones with packed documents (the mask inside each document)."""
    from ringbench.case.spec import validate

    for variant in ("ring", "zigzag", "stripe", "llama3", "ulysses", "usp"):
        for sink in ("learnable", "off-by-one"):
            validate(resolve_mask(_spec(variant=variant, mask="shared-prefix:28,answers=3", sink=sink, head_dim_v=8,
                                        kernel="math")), visible_gpus=0)
    from ringbench.case.spec import check_fields

    check_fields({"variant": "ring_varlen", "mask": "prefix:40", "sink": "learnable", "seqlen": 256,
                  "world_size": 2})
    for variant in ("ring_varlen", "zigzag_varlen", "llama3_varlen", "ulysses_varlen", "usp_varlen"):
        validate(resolve_mask(_spec(variant=variant, mask="shared-prefix:28,answers=3", sink="learnable",
                                    head_dim_v=8, kernel="math", docs="16,40,64,136")), visible_gpus=0)


def test_masks_every_kernel_with_a_window_takes_one_and_auto_picks_the_fastest():
    from ringbench.variants.kernels import KERNELS, as_kernel, resolve_kernel

    assert [n for n, k in KERNELS.items() if k.takes_mask] == ["flex", "math"]  # one call per block
    assert [n for n, k in KERNELS.items() if k.by_slices] == ["flash-attn-4", "flash-attn", "torch-flash", "cpu"]
    assert resolve_kernel("auto", "cpu", dtype=torch.bfloat16, head_dim=16, mask="prefix:40").name == "cpu"
    assert as_kernel("cpu", "cpu", torch.float32, head_dim=16, mask="prefix:40").by_slices
    with pytest.raises(ValueError, match=r"the torch-efficient kernel cannot take mask prefix:40 \(.*\); pass --kernel "
                                         r"with one of .*torch-flash.* or auto"):
        as_kernel("torch-efficient", "cuda", torch.bfloat16, head_dim=16, mask="prefix:40")


@pytest.mark.parametrize("args, sentence", [
    (["--mask", "chunked:4k", "--seqlen", "4k"],
     "mask chunked:4096 at --seqlen 4096 is plain causal attention (every query sees every key up to itself); pass "
     "--mask causal"),
    (["--mask", "window:9,4095", "--seqlen", "4k"],
     "mask window:9,4095 at --seqlen 4096: R must be below seqlen - 1 = 4095, or every query sees every key after it "
     "and the window has no right edge; pass an R below 4095"),
    (["--mask", "window:4k,4", "--seqlen", "4k"],
     "mask window:4096,4 at --seqlen 4096: L must be below the seqlen, or every query sees every key before it and "
     "the window has no left edge; pass an L below 4096"),
    (["--mask", "window:8k,8k", "--seqlen", "4k"],
     "mask window:8192,8192 at --seqlen 4096: the window must be shorter than the sequence, and this one reaches past "
     "it on both sides, so every query sees every key; use --no-causal in its place"),
    (["--mask-file", str(DATA / "image_in_text.txt"), "--seqlen", "1k"],
     "mask image_in_text(5) at --seqlen 1024 gives query rows 256 to 1023 no key, and every query row must see one; "
     "pass --seqlen 256, or slices that give those rows a key"),
])
def test_masks_degenerate_masks_are_refused_in_one_sentence_before_any_launch(tmp_path, args, sentence):
    """Issue 26: chunked:C at C >= seqlen (plain causal), a two-sided window past the sequence and a slices file
    of 256 tokens at --seqlen 1k (768 rows seeing no key) ran silently."""
    from helpers import ringbench_here

    result = ringbench_here("verify", "--device", "cpu", "--variant", "zigzag", *args, "--out", str(tmp_path),
                            cwd=tmp_path)
    assert result.returncode == 2, result.stdout
    assert result.stderr.strip() == sentence
    assert not list(tmp_path.rglob("*.jsonl"))


CAUSAL = "plain causal attention (every query sees every key up to itself); pass --mask causal"
FULL = "full attention (every query sees every key); pass --mask full"


@pytest.mark.parametrize("text, seqlen, refusal", [
    ("global:4,window:1020", 1024, f"mask global:4,window:1020 at --seqlen 1024 is {CAUSAL}"),  # L = S - G
    ("global:4,window:2k", 1024, f"mask global:4,window:2048 at --seqlen 1024 is {CAUSAL}"),
    ("global:4,window:1019", 1024, None),  # query 1023 misses key 4
    ("prefix:1", 1024, f"mask prefix:1 at --seqlen 1024 is {CAUSAL}"),  # a prompt of one token sees only itself
    ("prefix:2", 1024, None),
    ("shared-prefix:4,answers=1", 1024, f"mask shared-prefix:4,answers=1 at --seqlen 1024 is {CAUSAL}"),
    ("shared-prefix:4,answers=2", 1024, None),
    ("window:1024", 1024, f"mask window:1024 at --seqlen 1024 is {CAUSAL}"),
    ("window:4k", 1024, f"mask window:4096 at --seqlen 1024 is {CAUSAL}"),
    ("window:1023", 1024, None),
    ("chunked:2k", 1024, f"mask chunked:2048 at --seqlen 1024 is {CAUSAL}"),
    ("chunked:1023", 1024, None),
    ("slices:name=lm;0,1,0,1,full;1,8,0,8,causal", 8, f"mask lm(2) at --seqlen 8 is {CAUSAL}"),
    ("slices:0,4,0,8,full;4,8,0,8,full", 8, f"mask slices(2) at --seqlen 8 is {FULL}"),
    ("slices:0,8,0,4,full;0,8,4,8,inv-causal;1,8,4,8,causal", 8, None),  # every key but (q, k > q) for q >= 4
    ("slices:0,4,0,4,full;4,8,0,8,causal", 8, None),  # prefix:4
    ("causal", 8, None),
    ("full", 8, None),
])
def test_masks_causal_or_full_in_disguise_is_refused_naming_the_plain_mask(text, seqlen, refusal):
    """A mask whose slices over the seqlen hold exactly the pairs of causal or full attention ran as a
    mask: it is refused, naming the plain mask to pass. The rule is exact (areas and the diagonal), so the
    mask one token short of it is accepted."""
    from ringbench.case.spec import check_fields

    assert masks.rule(masks.parse(text), seqlen) == refusal
    given = {"mask": text, "seqlen": seqlen, "world_size": 2, "variant": "rfa_zigzag"}  # a peer: no mask option
    if refusal is None:
        assert masks.disguise(masks.parse(text), seqlen) is None
    else:
        with pytest.raises(SpecError) as refused:
            check_fields(given)
        assert str(refused.value) == refusal


@pytest.mark.parametrize("text, sentence", [
    ("shared-prefix:4,answers=2,answers=3", "mask 'shared-prefix:4,answers=2,answers=3' gives answers twice "
     "(answers=2 and answers=3), and each key may be given once; pass answers once"),
    ("global:4,window:8,window:8", "mask 'global:4,window:8,window:8' gives window twice (window:8 and window:8), and "
     "each key may be given once; pass window once"),
])
def test_masks_a_key_given_twice_is_refused_not_overwritten(text, sentence):
    """shared-prefix:4,answers=2,answers=3 ran as answers=3, the first value dropped without a word."""
    from ringbench.case.spec import check_fields

    with pytest.raises(ValueError) as refused:
        masks.parse(text)
    assert str(refused.value) == sentence
    with pytest.raises(SpecError, match="gives .* twice"):
        check_fields({"mask": text})


def test_masks_blind_rows_are_the_rows_no_slice_gives_a_key():
    rows = masks.blind_rows([masks.Slice.of_kind(0, 4, 0, 4, "causal"), masks.Slice.of_kind(6, 8, 0, 3, "full"),
                             masks.Slice.of_kind(8, 10, 12, 14, "bi-causal")], 14)
    assert rows == [(4, 6), (10, 14)]  # 8..9 see keys 12, 13 on the diagonal; 10.. lie past every slice
    assert masks.blind_rows([masks.Slice.of_kind(0, 4, 0, 2, "bi-causal")], 4) == [(0, 4)]  # more rows than keys


def test_masks_cp_active_reason_is_short_in_verify_table_and_whole_in_the_record():
    """cp-active's reason filled a 9-character note column a dozen lines deep at 80 columns: the table
    now says ``local`` or ``W=1``, and the record keeps the sentence."""
    import io
    import json

    from rich.console import Console

    from ringbench.present import report
    from ringbench.records import cp_reasons

    root = Path(__file__).resolve().parents[1]
    record = next(r for r in map(json.loads, (root / "results/reference/2026-12-02-cpu-masks/verify.jsonl").open())
                  if r.get("cp_active") is None and r.get("cp_active_reason"))
    sentence = cp_reasons.no_key_crossing("mask image_in_text(5)")
    assert sentence == ("under mask image_in_text(5) no query sees a key of another rank, so no rank needs another's "
                        "K/V")
    local = {**record, "cp_active_reason": sentence}
    console = Console(record=True, width=80, color_system=None, file=io.StringIO())
    report.print_verify_table([record, local], console)
    table = console.export_text()
    lines = table.splitlines()
    rows = [i for i, line in enumerate(lines) if "cp-active" in line]
    assert [lines[i].split()[-2:] for i in rows] == [["n/a", "W=1"], ["n/a", "local"]], table
    assert all(not lines[i + 1].strip() or lines[i + 1].startswith("ring") or lines[i + 1][0].isdigit()
               for i in rows), table  # not wrapped onto a line of its own
    assert "another rank" not in table and len(table.splitlines()) <= 18, table
    assert cp_reasons.short(cp_reasons.no_document_crossing()) == "local"
    assert local["cp_active_reason"] == sentence  # the record is not rewritten


def test_masks_coalesced_slices_hold_the_same_pairs_in_fewer_calls():
    # A shared prompt's answers see the prompt through one slice, so a stripe rank makes one window
    # call for them per step, not one per answer; the pairs are the same, position by position.
    S, W = 512, 8
    m = masks.build("shared-prefix:64,answers=7", S)
    assert len(m.slices) == 1 + 1 + 7
    assert masks.Slice(64, S, 0, 64) in m.slices
    stripe = [bands.Run(0, r, W, S // W) for r in range(W)]
    calls = [len(masked.slice_parts(m, q, k)) for q in stripe for k in stripe]
    assert max(calls) == 1 + 1 + 7
    pos = torch.arange(S)
    for text in ("shared-prefix:64,answers=7", "prefix:40", "chunked:24", "global:4,window:24",
                 "slices:0,128,0,128,full;128,256,0,128,full;0,128,128,256,full;128,256,128,256,causal;"
                 "256,512,0,256,full;256,512,256,512,bi-causal"):
        raw = masks._family_slices(text, S) if not text.startswith("slices:") else [
            masks.Slice.of_kind(*e) for e in masks._entries(text)]
        before = torch.zeros(S, S, dtype=torch.bool)
        for s in raw:
            before |= s.allows(pos[:, None], pos[None, :])
        assert torch.equal(masks.build(text, S).allows(pos[:, None], pos[None, :]), before), text
        assert masks.build(text, S).area() == int(before.sum()), text
    # The four full quarters of the slices text above are one slice; the causal one stays apart.
    assert masks.Slice(0, 256, 0, 128) in masks.build("slices:0,128,0,128,full;128,256,0,128,full;"
                                                       "0,128,128,256,full;128,256,128,256,causal", 256).slices
