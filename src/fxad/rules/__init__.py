"""Derivative rules.  Importing this package registers all built-in rules.

The rule contract is stated once, in :mod:`fxad.rules.registry`.  Where to find a rule:

* :mod:`fxad.rules.elementwise` — arithmetic, unary math, activations, ``where``, ``clamp``
* :mod:`fxad.rules.reductions` — ``sum``, ``mean``, ``var``, ``amax``, ``max``, ...
* :mod:`fxad.rules.linalg` — ``matmul``, ``mm``, ``bmm``, ``linear``, ``addmm``
* :mod:`fxad.rules.shape` — views, indexing, ``cat``/``stack``/``split``, casts
* :mod:`fxad.rules.nn` — softmax, normalization, losses, attention, convolution, pooling
"""
from . import elementwise, linalg, nn, reductions, shape  # noqa: F401  (registers the rules)
from . import extra_math, extra_linalg, extra_shape, extra_nn  # noqa: F401,E402
from . import extra_reductions, extra_shape2  # noqa: F401,E402
from . import extra_fft, extra_decomp, extra_pool, extra_index, extra_nn2  # noqa: F401,E402
from . import extra_strided, extra_segment, extra_grid, extra_householder  # noqa: F401,E402
from . import conv_grads, complex_ops  # noqa: F401,E402
from . import fallback  # noqa: F401,E402  (last: only ops without a hand-written rule)
from .registry import Rule, all_rules, lookup, register_vjp, unregister

__all__ = ["Rule", "all_rules", "lookup", "register_vjp", "unregister"]
