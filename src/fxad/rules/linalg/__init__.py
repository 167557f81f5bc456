"""Rules for linear algebra (``torch.*`` matrix functions and ``torch.linalg``):

* :mod:`~fxad.rules.linalg.products` — ``matmul``/``@``, ``mm``, ``bmm``, ``addmm``, ``dot``,
  ``mv``, ``outer``, ``baddbmm``, ``tensordot``, ``kron``, ``einsum``, ``multi_dot``, ``cross``,
  ``trace``
* :mod:`~fxad.rules.linalg.decompositions` — ``cholesky``, ``eigh``/``eigvalsh``, ``eig``,
  ``svd``/``svdvals``, ``qr``, ``lu``/``lu_factor``/``lu_unpack``, ``householder_product``,
  ``ormqr``
* :mod:`~fxad.rules.linalg.solvers` — ``solve``, ``solve_triangular``, ``triangular_solve``,
  ``cholesky_solve``/``cholesky_inverse``, ``lu_solve``, ``inv``, ``pinv``, ``tensorinv``,
  ``tensorsolve``
* :mod:`~fxad.rules.linalg.matrix_functions` — ``det``, ``slogdet``, ``logdet``,
  ``matrix_exp``, ``matrix_power``, ``vander``
* :mod:`~fxad.rules.linalg.norms` — ``vector_norm``, ``matrix_norm``, ``linalg.norm``,
  ``norm``, ``dist``, ``cond``, ``renorm``

Helpers shared by these modules (and only by them) are in :mod:`fxad.rules.linalg._common`.
"""
from . import decompositions, matrix_functions, norms, products, solvers  # noqa: F401
