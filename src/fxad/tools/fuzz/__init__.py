"""Random-program fuzzer: fxad's reverse and forward mode against eager PyTorch.

``python -m fxad.tools.fuzz --n N --seed S [--out DIR] [--mode reverse|forward|both]`` generates
``N`` random straight-line programs (:mod:`fxad.tools.fuzz.generator`: elementwise ops with
broadcasting and Python scalars, reductions, views, slicing, integer-tensor indexing,
``cat``/``stack``/``split``, ``where``, softmax, in-place ops and aliasing on intermediates,
fan-out, integer tensors), runs each through ``fxad.vjp``/``fxad.jvp`` and compares with
``torch.autograd.grad``/``torch.autograd.forward_ad`` in float64 (:mod:`fxad.tools.fuzz.oracle`),
classifies it (pass / clear refusal / wrong / crash, :mod:`fxad.tools.fuzz.runner`), and writes a
shrunk, standalone reproducer (``python file.py`` raises while the bug is there) for every
wrong result or crash.  The test suite runs a fixed-seed batch (``tests/test_fuzz.py``).
"""
from .generator import FAMILIES, generate
from .program import Program, Stmt
from .runner import (CLASSES, MODES, Outcome, Result, Summary, reproducer_source, run_batch,
                     run_mode, run_program, shrink, write_reproducer)

__all__ = ["FAMILIES", "generate", "Program", "Stmt", "CLASSES", "MODES", "Outcome", "Result",
           "Summary", "run_batch", "run_mode", "run_program", "shrink", "reproducer_source",
           "write_reproducer"]
