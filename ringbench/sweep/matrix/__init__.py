"""``ringbench matrix``: which implementation is right for which mask, dtype, shape, sink, padding and world size.

Modules: ``grid`` (the grid and each cell's fields), ``running`` (the cells through the sweep),
``classes`` (a cell's class from its record); ``ringbench.present.matrix`` renders it (JSON
objects, Markdown, the picture).

The grid (:func:`build_grid`): every implementation (ringbench's variants, then every peer)
against twenty-three columns around one base cell, each column changing one thing from it, at each
world size. The base: causal, bf16, batch 1, 8 query heads over 2 K/V heads (GQA 4:1), head dim
128, :func:`base_seqlen` tokens (packed into four documents for a varlen implementation, whose
base mask is packed documents). The columns (:data:`COLUMNS`):

- mask: causal, full (no mask), sliding window, packed documents, and the named masks of
  ``--mask`` (:data:`MASK_COLUMNS`: a two-sided window, prefix-LM, a shared prompt with three
  answers, chunked, global tokens beside a window), which only the batch engines take;
- dtype: bf16, fp16, fp32;
- shape: head dim 64, 128, 256; MLA (query/key head dim 192, value head dim 128); MHA 8/8,
  GQA 8/2, MQA 8/1; an odd length (``S = W * c`` with ``c`` odd, so a contiguous share is an odd
  number of tokens; a varlen implementation gets documents of odd lengths instead);
- sink: a learnable sink, the off-by-one softmax (``sink``);
- padding: the base documents 3 tokens short each, padded to the first multiple of 2W from 8 up (``doc_pad``).

The base cell shows under four columns (causal or packed, bf16, D=128, GQA 8/2): it is one case.
A column that sets a variant option (the sliding window, the sinks) is ``unsupported`` for an
implementation that does not declare the option (``Variant.options``), in the declaration's
own sentence. Packed documents go to the varlen implementations, the batch masks to the batch
ones; the other way round the spec's own refusal is the cell's reason.

Each cell is one ``verify`` case built as the CLI builds one (``sweep.build_cases``) and
refused per cell: a refusal (``SpecError``, ``Unavailable``) is recorded as a ``skipped`` record
with its sentence and never launched; the others run through ``sweep.run_sweep`` (one torchrun
launch per world size, its watchdog, its records in ``OUT/verify.jsonl``). Every cell is then
classified (:func:`classify`) as one of :data:`CLASSES`, and :func:`write` writes
``OUT/matrix.jsonl`` (one object per cell, :func:`cell_object`), ``OUT/matrix.md`` and
``OUT/matrix.png``.

The test-only variants join under ``RINGBENCH_TEST_VARIANTS=1`` (the CLI's hidden
``--test-variants`` sets it): ``broken_merge`` over every column (a mismatch), ``fault_oom`` and
``fault_raise`` at their base cell only (an oom, an error), in a sweep of their own after the
others, so that the launch ``fault_raise`` crashes holds nothing else.

pandas-free; matplotlib is imported by :func:`plot` alone, torch by the case building.
"""

from ringbench.sweep.matrix.classes import classify
from ringbench.sweep.matrix.grid import (AXES, BASE, BASE_SEQLEN, CLASS_MEANING, CLASSES, COLUMNS, MLA_HEAD_DIMS,
                                         MATRIX_OPTIONS, TEST_VARIANTS, Cell, Column, Grid, base_seqlen, build_grid,
                                         cell_fields, check_runnable, default_world_sizes, implementations, matrix_fix)
from ringbench.sweep.matrix.running import run

__all__ = ["AXES", "BASE", "BASE_SEQLEN", "CLASS_MEANING", "CLASSES", "COLUMNS", "MATRIX_OPTIONS", "MLA_HEAD_DIMS",
           "TEST_VARIANTS", "Cell", "Column", "Grid", "base_seqlen", "build_grid", "cell_fields", "check_runnable",
           "classify", "default_world_sizes", "implementations", "matrix_fix", "run"]
