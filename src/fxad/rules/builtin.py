"""Registers fxad's built-in rules: importing this module imports every rule family (each
registers its rules into the op records of :mod:`fxad.rules.registry`), then the autograd
fallback for the ops left without a hand-written rule, then installs the complex-number
statuses of the ops (:mod:`fxad.rules.complex`).  :mod:`fxad.rules.dispatch`, through which
the engines find rules, imports it.
"""
from . import arithmetic, math, reductions, scans, sorting, views, indexing  # noqa: F401
from . import linalg, fft, complex_ops, random, nn  # noqa: F401,E402  (registers the rules)
from . import fallback  # noqa: F401,E402  (last: only ops without a hand-written rule)
from . import complex as _complex  # noqa: E402

_complex.install()  # the complex statuses of the ops registered above
