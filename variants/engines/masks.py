"""Attention masks as one canonical form: a list of slices over global positions. Pure Python.

A *slice* is a rectangle of query positions ``[q0, q1)`` against key positions ``[k0, k1)`` cut
by a band of diagonals: the pairs it holds are those with ``lo <= k - q <= hi`` (``None``: that
side unbounded). MagiAttention's four slice types are the band's four cases:

- ``full``: no band, every pair of the rectangle;
- ``causal``: aligned bottom-right, ``k - k0 <= (q - q0) + (k1 - k0) - (q1 - q0)``, so ``hi = k1 - q1``;
- ``inv-causal``: aligned top-left, ``k - k0 >= q - q0``, so ``lo = k0 - q0``;
- ``bi-causal``: both (for ``q1 - q0 == k1 - k0`` the diagonal alone, empty for more queries than keys).

A mask is a list of slices that share no pair; a pair in no slice is masked. Over a whole sequence
every query row sees a key (:func:`rule` refuses blind rows; a block of a rank may still hold rows
that see none of its keys: out 0, lse ``-inf``). Every family of ``--mask`` is written as slices over
the sequence of S tokens (:func:`build`), and a ``--mask-file`` is read into the same form
(:func:`read_file`), so one module answers, for any of them and without torch:

- the unmasked area (:meth:`Mask.area`, the pairs FLOPs count), and the pairs of any block of
  query rows against key rows given as runs of positions (:meth:`Mask.pairs`; a run is
  ``bands.Run``, an arithmetic progression: a contiguous chunk, or a stripe of stride W), so
  the predicted work per rank and the block classification (:meth:`Mask.classify`: empty, full
  or partial) come from the same arithmetic;
- which key each query sees, as a vectorised predicate over global position tensors
  (:meth:`Mask.allows`), from which the torch side builds a block's dense boolean mask.

The families (``P``, ``C``, ``G``, ``L``, ``R`` token counts; sizes such as ``4k`` are read):

- ``causal`` and ``full``;
- ``window:L`` (query p sees keys ``p - L + 1 .. p``, as ``--window L``) and ``window:L,R`` (two-sided,
  non-causal: keys ``p - L + 1 .. p + R``; TransformerEngine's window ``(512, 512)`` is ``window:513,512``);
- ``prefix:P``: a bidirectional prompt of P tokens (prefix-LM), causal after it;
- ``shared-prefix:P,answers=A``: a causal prompt of P tokens and A answers of ``(S - P) / A`` tokens
  packed after it, each answer seeing the prompt and itself causally, never another answer
  (RLHF and GRPO batches);
- ``chunked:C``: causal inside chunks of C tokens, nothing across them (Llama 4's chunked attention);
- ``global:G,window:L``: causal, each query sees the first G tokens and its last L keys
  (global tokens beside a sliding window, as attention-sink models train);
- ``slices:q0,q1,k0,k1,type;...``: the slices themselves, the form a ``--mask-file`` is read into,
  led by ``name=STEM;`` (the file's stem), which tables show (:func:`label`) and case_id leaves out
  (:func:`unnamed`).

With packed documents (``--docs``, the varlen variants) a mask applies per document
(:func:`documents`, issue 26): a family's slices over each document's own length, positions from 0,
moved to the document's place in the packed row (a document shorter than the mask needs takes the
mask as it falls inside it; :func:`document_rule` refuses only answers a document cannot split), a
slices text cut at the document boundaries; either way one :class:`Mask` over the packed row whose
slices never cross a document, so everything above serves it unchanged.

Source: the slice representation is MagiAttention's (Tao et al., arXiv 2505.13211; its
``AttnSlice`` and mask types, docs/blog/magi_attn.md); the band algebra, the arithmetic over
runs and the families' slices are ringbench's own.
"""

from __future__ import annotations

import bisect
import functools
import re
from pathlib import Path
from typing import NamedTuple, Sequence

from ..offers import SeqlenOffer
from .bands import Run

#: MagiAttention's slice types, in its order (0 full, 1 causal, 2 inverse causal, 3 bidirectional causal).
KINDS = ("full", "causal", "inv-causal", "bi-causal")
#: The names ``--mask`` takes (``slices`` is the form a ``--mask-file`` is read into).
FAMILIES = ("causal", "full", "window", "prefix", "shared-prefix", "chunked", "global", "slices", "docs")
#: The most slices a mask may hold (their pairwise overlap check is quadratic).
MAX_SLICES = 4096
#: The longest sequence whose mask verify builds dense: a bool ``[S, S]`` of 1 GiB.
DENSE_LIMIT = 32768
#: Every named family, with an example, for refusals.
EXAMPLES = ("causal, full, window:L, window:L,R, prefix:P, shared-prefix:P,answers=A, chunked:C, global:G,window:L "
            "or slices:q0,q1,k0,k1,type;... (such as prefix:512 or chunked:8k)")

EMPTY, FULL, PARTIAL = "empty", "full", "partial"

_SIZE = re.compile(r"(\d+)([kKmM]?)")
#: The name a slices text may carry (a file's stem, its other characters written ``_``).
_NAME, _NAME_CUT = re.compile(r"[\w.-]+"), re.compile(r"[^\w.-]+")
_UNITS = {"": 1, "k": 1024, "m": 1024 ** 2}


class Slice(NamedTuple):
    """Query positions ``[q0, q1)`` against keys ``[k0, k1)``, the pairs with ``lo <= k - q <= hi``
    (``None``: unbounded on that side)."""

    q0: int
    q1: int
    k0: int
    k1: int
    lo: int | None = None
    hi: int | None = None

    @classmethod
    def of_kind(cls, q0: int, q1: int, k0: int, k1: int, kind: str) -> "Slice":
        """The slice of MagiAttention's ``kind`` (:data:`KINDS`) over that rectangle."""
        causal, inverse = kind in ("causal", "bi-causal"), kind in ("inv-causal", "bi-causal")
        return cls(q0, q1, k0, k1, k0 - q0 if inverse else None, k1 - q1 if causal else None)

    def area(self) -> int:
        """How many (query, key) pairs the slice holds."""
        return _band_area(self.q0, self.q1, self.k0, self.k1, self.lo, self.hi)

    def meet(self, other: "Slice") -> "Slice":
        """The pairs both slices hold, as a slice (perhaps empty)."""
        return Slice(max(self.q0, other.q0), min(self.q1, other.q1), max(self.k0, other.k0), min(self.k1, other.k1),
                     _max(self.lo, other.lo), _min(self.hi, other.hi))

    def allows(self, q, k):
        """Whether query position ``q`` sees key position ``k`` through this slice: ints, or
        integer tensors that broadcast (``q[:, None]`` against ``k[None, :]``), elementwise."""
        seen = (q >= self.q0) & (q < self.q1) & (k >= self.k0) & (k < self.k1)
        if self.lo is not None:
            seen = seen & (k - q >= self.lo)
        if self.hi is not None:
            seen = seen & (k - q <= self.hi)
        return seen


def _max(a, b):
    return b if a is None else a if b is None else max(a, b)


def _min(a, b):
    return b if a is None else a if b is None else min(a, b)


def _band_area(i0: int, i1: int, j0: int, j1: int, d0: int | None, d1: int | None) -> int:
    """``#{(i, j): i0 <= i < i1, j0 <= j < j1, d0 <= j - i <= d1}``, in closed form.

    Summed over the diagonals d = j - i that meet the rectangle: the rows on diagonal d number
    ``min(i1, j1 - d) - max(i0, j0 - d)``, a function of d that is linear between the two points
    where the min and the max switch sides, so each piece is an arithmetic series.
    """
    if i0 >= i1 or j0 >= j1:
        return 0
    lo, hi = j0 - (i1 - 1), (j1 - 1) - i0  # the diagonals that meet the rectangle, each at one row or more
    lo, hi = _max(lo, d0), _min(hi, d1)
    if lo > hi:
        return 0

    def rows(d: int) -> int:
        return min(i1, j1 - d) - max(i0, j0 - d)

    starts = sorted({lo, *(c for c in (j1 - i1 + 1, j0 - i0 + 1) if lo < c <= hi)})
    total = 0
    for a, b in zip(starts, [*starts[1:], hi + 1]):
        total += (rows(a) + rows(b - 1)) * (b - a) // 2  # linear on [a, b - 1]: exact
    return total


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


def _residues(run: Run, stride: int) -> list[Run]:
    """A run of stride 1 cut into the ``stride`` runs of stride ``stride`` its positions fall into."""
    return [Run(run.local + r, run.start + r, stride, _ceil_div(run.count - r, stride), run.doc)
            for r in range(min(stride, run.count))]


def run_pairs(q: Run, k: Run, s: Slice) -> int:
    """The pairs of slice ``s`` between the query positions of run ``q`` and the key positions of
    run ``k`` (arithmetic progressions, ``bands.Run``).

    Raises:
        ValueError: two runs of different strides, neither of stride 1 nor of one position.
    """
    if q.count <= 0 or k.count <= 0:
        return 0
    if q.count == 1:
        q = q._replace(stride=k.stride)
    elif k.count == 1:
        k = k._replace(stride=q.stride)
    if q.stride != k.stride:
        if k.stride == 1:
            return sum(run_pairs(q, part, s) for part in _residues(k, q.stride))
        if q.stride == 1:
            return sum(run_pairs(part, k, s) for part in _residues(q, k.stride))
        raise ValueError(f"a query run of stride {q.stride} and a key run of stride {k.stride} have no pair count here")
    (i0, i1), (j0, j1), d0, d1 = local_band(q, k, s)
    return _band_area(i0, i1, j0, j1, d0, d1)


def local_band(q: Run, k: Run, s: Slice) -> tuple[tuple[int, int], tuple[int, int], int | None, int | None]:
    """Slice ``s`` between runs ``q`` and ``k`` of one stride (a run of one position takes the
    other's) in the runs' own indices: rows ``[i0, i1)``, keys ``[j0, j1)`` and the band
    ``d0 <= j - i <= d1`` (``None``: unbounded), as ``((i0, i1), (j0, j1), d0, d1)``.

    Raises:
        ValueError: runs of different strides, neither of one position.
    """
    if q.count == 1:
        q = q._replace(stride=k.stride)
    elif k.count == 1:
        k = k._replace(stride=q.stride)
    if q.stride != k.stride:
        raise ValueError(f"a query run of stride {q.stride} and a key run of stride {k.stride} make no band")
    t = q.stride
    i0, i1 = max(0, _ceil_div(s.q0 - q.start, t)), min(q.count, _ceil_div(s.q1 - q.start, t))
    j0, j1 = max(0, _ceil_div(s.k0 - k.start, t)), min(k.count, _ceil_div(s.k1 - k.start, t))
    gap = k.start - q.start  # k - q = gap + t * (j - i)
    d0 = None if s.lo is None else _ceil_div(s.lo - gap, t)
    d1 = None if s.hi is None else (s.hi - gap) // t
    return (i0, i1), (j0, j1), d0, d1


class Mask(NamedTuple):
    """A mask over a sequence of ``seqlen`` tokens: slices that share no pair, and its text;
    ``docs``: the lengths of the packed documents it was applied to, one by one (:func:`documents`),
    empty for a mask over one batch row."""

    text: str
    seqlen: int
    slices: tuple[Slice, ...]
    docs: tuple[int, ...] = ()

    def pairs(self, q: Run, k: Run) -> int:
        """The unmasked (query, key) pairs between the positions of runs ``q`` and ``k``."""
        return sum(run_pairs(q, k, s) for s in self.slices)

    def area(self) -> int:
        """The unmasked pairs of the whole sequence: what FLOPs count."""
        return sum(s.area() for s in self.slices)

    def classify(self, q: Run, k: Run) -> str:
        """:data:`EMPTY` (no pair of the block is unmasked), :data:`FULL` (every pair) or :data:`PARTIAL`."""
        n = self.pairs(q, k)
        return EMPTY if n == 0 else FULL if n == q.count * k.count else PARTIAL

    def allows(self, q, k):
        """Whether query position ``q`` sees key position ``k``: ints, or integer tensors that
        broadcast, elementwise (the predicate a dense block mask or a flex ``mask_mod`` is made of)."""
        seen = (q < 0) & (k < 0)  # no pair: positions are never negative
        for s in self.slices:
            seen = seen | s.allows(q, k)
        return seen

    def within(self, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> "Mask":
        """The same mask with only the slices that meet queries ``[q_lo, q_hi)`` and keys
        ``[k_lo, k_hi)``, for a block's predicate to test fewer of them."""
        box = Slice(q_lo, q_hi, k_lo, k_hi)
        return self._replace(slices=tuple(s for s in self.slices if s.meet(box).area()))


# --------------------------------------------------------------------------- text

def _size(text: str, what: str, mask: str, *, least: int = 1) -> int:
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"mask {mask!r}: {what} {text.strip()!r} is not a whole number of tokens; use "
                         f"{EXAMPLES}")
    value = int(match.group(1)) * _UNITS[match.group(2).lower()]
    if value < least:
        raise ValueError(f"mask {mask!r}: {what} {value} must be {least} or more; use {EXAMPLES}")
    return value


def _slice_text(s: tuple[int, int, int, int, str]) -> str:
    return ",".join(map(str, s))


def _parse_slice(text: str, mask: str, where: str) -> tuple[int, int, int, int, str]:
    parts = [p for p in re.split(r"[,\s]+", text.strip()) if p]
    if len(parts) != 5:
        raise ValueError(f"{where} {text.strip()!r} is not q_start, q_end, k_start, k_end and a type; write five "
                         f"fields such as 0,128,0,128,causal, the type one of {', '.join(KINDS)}")
    kind = parts[4].lower()
    if kind not in KINDS:
        raise ValueError(f"{where} {text.strip()!r} has type {parts[4]!r}, not one of {', '.join(KINDS)} "
                         "(MagiAttention's slice types); fix its type")
    try:
        q0, q1, k0, k1 = (int(p) for p in parts[:4])
    except ValueError:
        raise ValueError(f"{where} {text.strip()!r} has a position that is not a whole number; write its "
                         "ranges as integers, such as 0,128,0,128,causal") from None
    if not (0 <= q0 < q1 and 0 <= k0 < k1):
        raise ValueError(f"{where} {text.strip()!r} has an empty or negative range: it needs 0 <= q_start < q_end "
                         "and 0 <= k_start < k_end; fix its ranges")
    return q0, q1, k0, k1, kind


def _slices_text(entries: Sequence[tuple[int, int, int, int, str]], mask: str, name: str = "") -> str:
    if not entries:
        raise ValueError(f"mask {mask!r} holds no slice; give at least one q_start,q_end,k_start,k_end,type")
    if len(entries) > MAX_SLICES:
        raise ValueError(f"mask {mask!r} holds {len(entries)} slices, above the limit of {MAX_SLICES}; merge "
                         "slices (a causal, inv-causal or bi-causal slice covers a band in one)")
    slices = [Slice.of_kind(*e) for e in entries]
    for i, a in enumerate(slices):
        for j in range(i + 1, len(slices)):
            if a.meet(slices[j]).area():
                raise ValueError(f"mask {mask!r}: slices {i + 1} ({_slice_text(entries[i])}) and {j + 1} "
                                 f"({_slice_text(entries[j])}) share pairs, but each (query, key) pair may be in one "
                                 "slice only; cut one of them")
    return "slices:" + (f"name={name};" if name else "") + ";".join(_slice_text(e) for e in entries)


def parse(text: str) -> str:
    """The canonical text of a mask (``window:64,0`` is ``window:64``; sizes as plain integers).

    Syntax only: rules that need the sequence length are :func:`rule`'s.

    Raises:
        ValueError: an unknown family or a malformed parameter, one sentence naming the value,
            the rule and the families.
    """
    raw = str(text).strip()
    name, _, params = raw.partition(":")
    name = name.strip().lower()
    if name not in FAMILIES:
        raise ValueError(f"mask {raw!r} is not a mask ringbench knows; use {EXAMPLES}, or --mask-file FILE")
    if name == "docs":
        return _parse_packed(raw, params)
    args = [a.strip() for a in params.split(",")] if params.strip() else []
    if name in ("causal", "full"):
        if args:
            raise ValueError(f"mask {raw!r}: {name} takes no parameters; pass --mask {name}")
        return name
    if name == "slices":
        named, rest = _split_name(params, raw)
        entries = [_parse_slice(e, raw, f"mask {raw!r}: slice {i + 1}")
                   for i, e in enumerate(e for e in rest if e.strip())]
        return _slices_text(entries, raw, named)
    keyed = {}
    plain = []
    for a in args:
        key, eq, value = _keyed(a)
        if eq:
            key = key.strip().lower()
            if key in keyed:
                raise ValueError(f"mask {raw!r} gives {key} twice ({key}{eq}{keyed[key].strip()} and {a}), and each "
                                 f"key may be given once; pass {key} once")
            keyed[key] = value
        else:
            plain.append(a)
    if name == "window":
        if keyed or len(plain) not in (1, 2):
            raise ValueError(f"mask {raw!r}: window takes L (keys up to the query, itself included) and perhaps R "
                             "(keys after it); pass window:4096 or window:513,512")
        left = _size(plain[0], "L", raw)
        right = _size(plain[1], "R", raw, least=0) if len(plain) == 2 else 0
        return f"window:{left}" if right == 0 else f"window:{left},{right}"
    if name == "prefix" and len(plain) == 1 and not keyed:
        return f"prefix:{_size(plain[0], 'P', raw)}"
    if name == "chunked" and len(plain) == 1 and not keyed:
        return f"chunked:{_size(plain[0], 'C', raw)}"
    if name == "shared-prefix" and len(plain) == 1 and set(keyed) == {"answers"}:
        return f"shared-prefix:{_size(plain[0], 'P', raw)},answers={_size(keyed['answers'], 'answers', raw)}"
    if name == "global" and len(plain) == 1 and set(keyed) == {"window"}:
        return f"global:{_size(plain[0], 'G', raw)},window:{_size(keyed['window'], 'window', raw)}"
    forms = {"prefix": "prefix:P, such as prefix:512", "chunked": "chunked:C, such as chunked:8k",
             "shared-prefix": "shared-prefix:P,answers=A, such as shared-prefix:1k,answers=4",
             "global": "global:G,window:L, such as global:4,window:1k"}
    raise ValueError(f"mask {raw!r} is not of the form {forms[name]}")


def _keyed(arg: str) -> tuple[str, str, str]:
    """``answers=4`` or ``window:1k`` as (key, separator, value); a plain value has no separator."""
    at = min((i for i in (arg.find("="), arg.find(":")) if i >= 0), default=-1)
    return (arg[:at], arg[at], arg[at + 1:]) if at >= 0 else (arg, "", "")


def _params(text: str) -> tuple[str, list[int], dict[str, int]]:
    name, _, params = text.partition(":")
    plain, keyed = [], {}
    for a in params.split(",") if params else []:
        key, eq, value = _keyed(a)
        if eq:
            keyed[key] = int(value)
        else:
            plain.append(int(a))
    return name, plain, keyed


def _split_name(params: str, mask: str) -> tuple[str, list[str]]:
    """The ``name=NAME`` a slices text may lead with (the file it was read from), and its slices' texts."""
    parts = params.split(";")
    if not parts[0].strip().lower().startswith("name="):
        return "", parts
    name = parts[0].strip()[len("name="):]
    if not _NAME.fullmatch(name):
        raise ValueError(f"mask {mask!r}: name {name!r} is not letters, digits, '_', '.' or '-'; pass a name such as "
                         "image_in_text, or none")
    return name, parts[1:]


def _entries(text: str) -> list[tuple[int, int, int, int, str]]:
    """The slices of a canonical ``slices:`` text, as ``(q0, q1, k0, k1, type)``."""
    return [_parse_slice(e, text, "slice") for e in _split_name(text[len("slices:"):], text)[1]]


def unnamed(text: str) -> str:
    """A mask's text without the name of the file its slices came from: what its case_id follows."""
    return re.sub(r"(^|;)slices:name=[^;]*;", r"\1slices:", text)


def rule(text: str, seqlen: int) -> str | None:
    """Why mask ``text`` (canonical) cannot apply to a sequence of ``seqlen`` tokens, in one
    sentence with the fix, or ``None``. A fix offering a seqlen is a :class:`SeqlenOffer`."""
    if text.startswith("docs:"):
        return _packed_rule(text, seqlen)
    if text.startswith("slices:"):
        return _slices_rule(text, seqlen)
    name, plain, keyed = _params(text)
    if name == "prefix" and plain[0] >= seqlen:
        return (f"mask {text} has a prompt of {plain[0]} tokens, not shorter than seqlen {seqlen}; a prompt of the "
                "whole sequence is --mask full, so pass a P below the seqlen")
    if name == "shared-prefix":
        p, a = plain[0], keyed["answers"]
        rest = seqlen - p
        if rest < a or rest % a:
            fit = p + (max(rest, 0) // a + 1) * a
            need = (f"has a prompt of {p} tokens, which leaves seqlen {seqlen} no tokens for its {a} answers"
                    if rest <= 0 else f"needs the {rest} tokens after the prompt to split into {a} answers of "
                    f"equal length, which seqlen {seqlen} does not give")
            return SeqlenOffer(f"mask {text} {need}",
                               lambda s: f"pass --seqlen {s} or another P or A", fit, "pass another P or A")
    if name == "global" and plain[0] >= seqlen:
        return (f"mask {text} has {plain[0]} global tokens, not fewer than seqlen {seqlen}; pass a G below the "
                "seqlen")
    if name == "window" and len(plain) == 2:
        reason = _window_rule(text, plain[0], plain[1], seqlen)
        if reason:
            return reason
    return _disguise_rule(text, seqlen)


def disguise(text: str, seqlen: int) -> str | None:
    """``"causal"`` or ``"full"`` where mask ``text`` (canonical, passing :func:`rule`'s other checks)
    over ``seqlen`` tokens holds exactly the pairs of that plain mask, else ``None``.

    Exact, from the slices: they share no pair (:func:`parse` refuses overlapping slices, the families'
    are disjoint by construction), so the mask is full where their area inside the S x S square is S²,
    and causal where it is S(S + 1) / 2 with no pair above the diagonal. A second chunk of ``chunked:C``
    (C < S) or a second answer of ``shared-prefix`` never sees the first's keys, so those are neither,
    answered without building their (perhaps millions of) slices."""
    if text in ("causal", "full") or text.startswith("docs:"):
        return None
    if not text.startswith("slices:"):
        name, plain, keyed = _params(text)
        if (name == "chunked" and plain[0] < seqlen) or (name == "shared-prefix" and keyed["answers"] > 1):
            return None
    S = seqlen
    square, above = Slice(0, S, 0, S), Slice(0, S, 0, S, 1, None)
    slices = _slices(text, S)
    area = sum(s.meet(square).area() for s in slices)
    if area == S * S:
        return "full"
    if area == S * (S + 1) // 2 and not any(s.meet(above).area() for s in slices):
        return "causal"
    return None


def _disguise_rule(text: str, seqlen: int) -> str | None:
    """Why a mask that is plain causal or full attention at this seqlen is refused, naming the one to pass."""
    plain = disguise(text, seqlen)
    if plain is None:
        return None
    what = ("plain causal attention (every query sees every key up to itself)" if plain == "causal"
            else "full attention (every query sees every key)")
    return f"mask {label(text)} at --seqlen {seqlen} is {what}; pass --mask {plain}"


def _window_rule(text: str, left: int, right: int, seqlen: int) -> str | None:
    """A two-sided window must end inside the sequence on each side: at L >= S every query sees every
    key before it, at R >= S - 1 every key after it, and the window is no window on that side."""
    past_left, past_right = left >= seqlen, right >= seqlen - 1
    if past_left and past_right:
        return (f"mask {text} at --seqlen {seqlen}: the window must be shorter than the sequence, and this one "
                "reaches past it on both sides, so every query sees every key; use --no-causal in its place")
    if past_left:
        return (f"mask {text} at --seqlen {seqlen}: L must be below the seqlen, or every query sees every key "
                f"before it and the window has no left edge; pass an L below {seqlen}")
    if past_right:
        return (f"mask {text} at --seqlen {seqlen}: R must be below seqlen - 1 = {seqlen - 1}, or every query sees "
                f"every key after it and the window has no right edge; pass an R below {seqlen - 1}")
    return None


def _seeing_rows(s: Slice) -> tuple[int, int]:
    """The query rows ``[a, b)`` of slice ``s`` that see at least one of its keys: row q sees keys
    ``max(k0, q + lo) .. min(k1 - 1, q + hi)``, so ``k0 - hi <= q <= k1 - 1 - lo``."""
    if s.lo is not None and s.hi is not None and s.lo > s.hi:
        return s.q0, s.q0
    a = s.q0 if s.hi is None else max(s.q0, s.k0 - s.hi)
    b = s.q1 if s.lo is None else min(s.q1, s.k1 - s.lo)
    return a, max(a, b)


def blind_rows(slices: Sequence[Slice], seqlen: int) -> list[tuple[int, int]]:
    """The runs ``[a, b)`` of query rows below ``seqlen`` that no slice gives a key, in order."""
    gaps, at = [], 0
    for a, b in sorted(r for r in map(_seeing_rows, slices) if r[0] < r[1]):
        if a > at:
            gaps.append((at, min(a, seqlen)))
        at = max(at, b)
    if at < seqlen:
        gaps.append((at, seqlen))
    return [(a, b) for a, b in gaps if a < b]


def _slices_rule(text: str, seqlen: int) -> str | None:
    entries = _entries(text)
    end = max(max(e[1], e[3]) for e in entries)
    tag = label(text)
    if end > seqlen:
        return SeqlenOffer(f"mask {tag} reaches position {end}, past seqlen {seqlen}",
                           lambda s: f"pass --seqlen {s}, or slices within the sequence", end,
                           "pass slices within the sequence")
    gaps = blind_rows([Slice.of_kind(*e) for e in entries], seqlen)
    if not gaps:
        return _disguise_rule(text, seqlen)
    a, b = gaps[0]
    rows = f"row {a}" if b - a == 1 else f"rows {a} to {b - 1}"
    more = " and others after them" if len(gaps) > 1 else ""
    sentence = (f"mask {tag} at --seqlen {seqlen} gives query {rows}{more} no key, and every query row must see "
                "one")
    if len(gaps) == 1 and b == seqlen and a >= end:  # only the tail past the slices: a shorter sequence fits
        return SeqlenOffer(sentence, lambda s: f"pass --seqlen {s}, or slices that give those rows a key", a,
                           "pass slices that give those rows a key")
    return f"{sentence}; pass slices that give those rows a key"


@functools.lru_cache(maxsize=64)
def build(text: str, seqlen: int) -> Mask:
    """The mask ``text`` (any spelling :func:`parse` takes) over ``seqlen`` tokens, as slices.

    Raises:
        ValueError: a malformed mask (:func:`parse`), or one the seqlen cannot take (:func:`rule`).
    """
    text = parse(text)
    reason = rule(text, seqlen)
    if reason:
        raise ValueError(reason)
    return Mask(text, seqlen, _slices(text, seqlen))


def _slices(text: str, seqlen: int) -> tuple[Slice, ...]:
    """The slices of mask ``text`` (canonical) over ``seqlen`` tokens, unchecked, :func:`coalesced`."""
    if text.startswith("docs:"):
        docs, inner = packed_parts(text)
        return documents(inner, docs).slices
    if text.startswith("slices:"):
        return coalesced(Slice.of_kind(*e) for e in _entries(text))
    return coalesced(_family_slices(text, seqlen))


def coalesced(slices) -> tuple[Slice, ...]:
    """``slices`` with every two that share a band and a key range over abutting query ranges (or a
    query range over abutting key ranges) made one: the same pairs in fewer slices, so a kernel
    that takes windows makes fewer, larger calls (a shared prompt's answers see the prompt in one
    call, not one per answer). Exact: a band's bounds are offsets ``k - q``, the same on both sides."""
    out = list(slices)
    while True:
        before = len(out)
        for along in ("q", "k"):
            out = _joined(out, along)
        if len(out) == before:
            return tuple(out)


def _joined(slices: list[Slice], along: str) -> list[Slice]:
    """One pass of :func:`coalesced` along the query (``q``) or key (``k``) axis."""
    lo, hi = (0, 1) if along == "q" else (2, 3)
    groups: dict[tuple, list[Slice]] = {}
    for s in slices:
        groups.setdefault(tuple(x for i, x in enumerate(s) if i not in (lo, hi)), []).append(s)
    out = []
    for group in groups.values():
        group.sort(key=lambda s: s[lo])
        run = group[0]
        for s in group[1:]:
            if s[lo] == run[hi]:
                run = run._replace(**{f"{along}1": s[hi]})
            else:
                out.append(run)
                run = s
        out.append(run)
    return out


def _family_slices(text: str, S: int) -> list[Slice]:
    """The slices of a named family's canonical ``text`` over ``S`` tokens, each parameter cut to
    the sequence where it reaches past it (the rule of a packed document, :func:`documents`: a
    prompt, a chunk or global tokens covering the whole document, a window's side reaching past
    it). A shared prompt's answers must split evenly (:func:`document_rule`). For a sequence
    :func:`rule` takes, no parameter reaches past it, so nothing is cut."""
    name, plain, keyed = _params(text)
    if name == "causal":
        return [Slice(0, S, 0, S, None, 0)]
    if name == "full":
        return [Slice(0, S, 0, S)]
    if name == "window":
        return [Slice(0, S, 0, S, -(plain[0] - 1), plain[1] if len(plain) == 2 else 0)]
    if name == "prefix":
        p = min(plain[0], S)
        return [Slice(0, p, 0, p)] + ([Slice(p, S, 0, S, None, 0)] if p < S else [])
    if name == "shared-prefix":
        p, a = plain[0], keyed["answers"]
        if p >= S:  # the prompt covers the whole document: causal
            return [Slice(0, S, 0, S, None, 0)]
        n = (S - p) // a
        out = [Slice(0, p, 0, p, None, 0)]
        for i in range(a):
            s, e = p + i * n, p + (i + 1) * n
            out += [Slice(s, e, 0, p), Slice(s, e, s, e, None, 0)]
        return out
    if name == "chunked":
        c = plain[0]
        return [Slice(s, min(s + c, S), s, min(s + c, S), None, 0) for s in range(0, S, c)]
    if name == "global":
        g, w = min(plain[0], S), keyed["window"]
        return [Slice(0, S, 0, g, None, 0)] + ([Slice(g, S, g, S, -(w - 1), 0)] if g < S else [])
    raise ValueError(f"mask {text!r} is not a family ringbench knows; use {EXAMPLES}")


def _shifted(s: Slice, by: int) -> Slice:
    """Slice ``s`` moved ``by`` positions along both axes (its band, ``k - q``, unchanged)."""
    return s._replace(q0=s.q0 + by, q1=s.q1 + by, k0=s.k0 + by, k1=s.k1 + by)


def _offsets(docs: Sequence[int]) -> list[int]:
    out = [0]
    for n in docs:
        out.append(out[-1] + n)
    return out


def document_rule(text: str, docs: Sequence[int]) -> str | None:
    """Why mask ``text`` (canonical) cannot apply per document to packed documents of lengths
    ``docs``, in one sentence with the fix, or ``None``.

    A named family applies inside each document, its positions re-based to 0, each parameter cut
    to the document where it reaches past it (:func:`_family_slices`): a prompt, chunk or global
    tokens at least the document's length cover it whole (``prefix:P``: full attention within it;
    ``chunked:C``, ``global:G``: causal), a window's side reaching past it has no edge there. The
    one refusal: ``shared-prefix:P,answers=A`` needs every document longer than P to leave
    tokens after its prompt that split into A equal answers. A slices text is absolute over the
    packed row (:func:`rule` at the row's length), cut to the document blocks, and refused where
    that leaves a query row no key.
    """
    total = sum(docs)
    if text.startswith("docs:"):
        return (f"mask {label(text)} packs its own documents into a batch row, and the case packs documents "
                f"{','.join(map(str, docs))} too; pass the documents once, with --docs and the mask to apply inside "
                "each (such as --mask prefix:16)")
    if text.startswith("slices:"):
        reason = rule(text, total)
        if reason:
            return reason
        gaps = blind_rows(_document_cut([Slice.of_kind(*e) for e in _entries(text)], docs), total)
        if not gaps:
            return None
        a, b = gaps[0]
        rows = f"row {a}" if b - a == 1 else f"rows {a} to {b - 1}"
        return (f"mask {label(text)} over documents {','.join(map(str, docs))} gives query {rows} no key of its own "
                "document (with --docs, slices are cut at the document boundaries and every query row must still "
                "see a key); pass slices that give those rows a key inside their document")
    name, plain, keyed = _params(text)
    if name == "shared-prefix":
        p, a = plain[0], keyed["answers"]
        for i, n in enumerate(docs):
            rest = n - p
            if rest > 0 and (rest < a or rest % a):
                return (f"mask {text} with --docs applies per document, and document {i} of {n} tokens leaves "
                        f"{rest} tokens after its prompt of {p}, which do not split into {a} answers of equal "
                        f"length; pass documents whose length minus {p} is a multiple of {a} (or at most {p}), "
                        "or another P or A")
    return None


def _document_cut(slices: Sequence[Slice], docs: Sequence[int]) -> list[Slice]:
    """``slices`` (absolute over the packed row) cut to the same-document blocks: each slice's
    meet with every document's square, the empty ones left out."""
    at = _offsets(docs)
    out = []
    for s in slices:
        for a, b in zip(at, at[1:]):
            if b > a and s.q0 < b and s.q1 > a and s.k0 < b and s.k1 > a:
                m = s.meet(Slice(a, b, a, b))
                if m.area():
                    out.append(m)
    return out


@functools.lru_cache(maxsize=64)
def documents(text: str, docs: tuple[int, ...]) -> Mask:
    """The mask ``text`` over packed documents of lengths ``docs``, as one :class:`Mask` over
    the packed row (``seqlen`` their sum, ``docs`` set): a named family applied inside each
    document, its positions re-based to 0 (:func:`document_rule` says how a document shorter
    than the mask needs is taken), a slices text cut to the document blocks. No slice crosses
    a document boundary, so every cross-document pair stays masked, and the area, the pairs of
    any runs of packed positions and the predicate over them are the plain :class:`Mask`'s.

    Raises:
        ValueError: a malformed mask (:func:`parse`), or one the documents cannot take
            (:func:`document_rule`).
    """
    text = parse(text)
    docs = tuple(int(n) for n in docs)
    reason = document_rule(text, docs)
    if reason:
        raise ValueError(reason)
    if text.startswith("slices:"):
        return Mask(text, sum(docs), coalesced(_document_cut([Slice.of_kind(*e) for e in _entries(text)], docs)), docs)
    out = []
    for a, n in zip(_offsets(docs), docs):
        if n:
            out += [_shifted(s, a) for s in coalesced(_family_slices(text, n)) if s.area()]
    return Mask(text, sum(docs), tuple(out), docs)


@functools.lru_cache(maxsize=16)
def by_document(mask: Mask) -> tuple[Mask, ...]:
    """A mask over packed documents (:func:`documents`) as one mask per document, each holding only
    that document's slices (over the same packed row): a block inside one document is counted and
    classified against its few slices, not every document's."""
    at = _offsets(mask.docs)
    parts: list[list[Slice]] = [[] for _ in mask.docs]
    for s in mask.slices:
        parts[bisect.bisect_right(at, s.q0) - 1].append(s)
    return tuple(mask._replace(slices=tuple(p)) for p in parts)


def over(text: str, seqlen: int, docs: "Sequence[int] | None" = None) -> Mask:
    """A case's mask: over the batch row of ``seqlen`` tokens (:func:`build`), or with packed
    documents (``docs``, their lengths) per document over the packed row (:func:`documents`)."""
    return build(text, seqlen) if docs is None else documents(text, tuple(docs))


def plain_fields(text: str) -> dict | None:
    """The fields a mask the plain path runs is written as (``causal`` is ``causal: True``,
    ``full`` is ``causal: False``, ``window:L`` is ``window: L`` under the causal mask), or
    ``None`` for a mask only the mask path runs."""
    text = parse(text)
    if text in ("causal", "full"):
        return {"causal": text == "causal"}
    if text.startswith(("slices:", "docs:")):
        return None
    name, plain, _ = _params(text)
    if name == "window" and len(plain) == 1:
        return {"causal": True, "window": plain[0]}
    return None


def label(text: str) -> str:
    """A mask as a table names it: its text, or for slices their count after the name of the file
    they came from (``image_in_text(5)``), else after ``slices`` (``slices(5)``); a mask over packed
    documents of a batch row (:func:`packed`) as its mask and the count of documents
    (``prefix:16 in 3 docs``)."""
    if text.startswith("docs:"):
        docs, inner = packed_parts(text)
        return f"{label(inner)} in {len(docs)} docs"
    if not text.startswith("slices:"):
        return text
    name, entries = _split_name(text[len("slices:"):], text)
    return f"{name or 'slices'}({len(entries)})"


def read_file(path: str | Path) -> str:
    """The canonical text of a ``--mask-file``: one slice a line, ``q_start q_end k_start k_end type``
    (commas or spaces between them, ``#`` to the end of a line a comment, blank lines skipped),
    the type one of :data:`KINDS`; named by the file's stem, so two files read apart in tables.

    Raises:
        ValueError: the file cannot be read, or a line or the slices break a rule (:func:`parse`).
    """
    name = str(path)
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise ValueError(f"mask-file {name!r} cannot be read ({why}); pass a text file of slices") from None
    entries = []
    for n, line in enumerate(lines, 1):
        body = line.split("#", 1)[0]
        if body.strip():
            entries.append(_parse_slice(body, name, f"mask-file {name!r} line {n}"))
    return _slices_text(entries, name, _NAME_CUT.sub("_", Path(path).stem) or "file")


# --------------------------------------------------------------------------- documents of a batch row

def packed(docs: Sequence[int], inner: str) -> str:
    """The canonical text of the family ``docs``: mask ``inner`` (any family but ``docs``, ``causal``
    and ``full`` included) applied inside each of the packed documents of lengths ``docs``, as
    one mask over a batch row (``docs:96,64,96;prefix:16``). It is how the batch engines take
    ``--docs``: their own layout over the whole row (zigzag's head-tail), the documents a mask
    like any other (:func:`build` gives :func:`documents`' slices with ``Mask.docs`` empty, so
    nothing cuts the row per document).

    Raises:
        ValueError: a malformed ``inner``, or documents that are not whole numbers of 0 or more.
    """
    return parse(f"docs:{','.join(str(int(n)) for n in docs)};{inner}")


def packed_parts(text: str) -> tuple[tuple[int, ...], str]:
    """A canonical ``docs:`` text (:func:`packed`) as its document lengths and its inner mask's text."""
    head, _, inner = text[len("docs:"):].partition(";")
    return tuple(int(n) for n in head.split(",")), inner


def _parse_packed(raw: str, params: str) -> str:
    head, sep, inner = params.partition(";")
    form = "docs:LENGTHS;MASK, such as docs:96,64,96;causal or docs:96,64,96;prefix:16"
    if not sep or not inner.strip():
        raise ValueError(f"mask {raw!r} names no mask to apply inside the documents; write {form}")
    try:
        docs = [int(n) for n in head.split(",")]
    except ValueError:
        raise ValueError(f"mask {raw!r} has a document length that is not a whole number; write {form}") from None
    if not docs or min(docs) < 0 or not sum(docs):
        raise ValueError(f"mask {raw!r} needs document lengths of 0 or more tokens that sum to more than 0; "
                         f"write {form}")
    inner = parse(inner)
    if inner.startswith("docs:"):
        raise ValueError(f"mask {raw!r} packs documents inside documents; write {form}")
    return f"docs:{','.join(map(str, docs))};{inner}"


def _packed_rule(text: str, seqlen: int) -> str | None:
    """Why a ``docs:`` mask cannot apply to a batch row of ``seqlen`` tokens: documents that do not
    fill the row, or the inner mask's per-document rule (:func:`document_rule`)."""
    docs, inner = packed_parts(text)
    if sum(docs) != seqlen:
        return (f"documents {','.join(map(str, docs))} sum to {sum(docs)} tokens but seqlen is {seqlen}; the "
                f"documents must fill the row exactly, so pass --seqlen {sum(docs)} or documents that sum to {seqlen}")
    return document_rule(inner, docs)
