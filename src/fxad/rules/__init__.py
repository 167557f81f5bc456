"""Derivative rules.  :mod:`fxad.rules.builtin` registers all built-in rules (the engines' door,
:mod:`fxad.rules.dispatch`, imports it); this package itself only names the op record's API,
so that importing :mod:`fxad.rules.registry` (the op record, a layer below capture) runs no
rule module.

The op record (one per op: its kind, complex status and rules, overloads included) and the
rule contract are stated once, in :mod:`fxad.rules.registry`, with the one way to declare a
rule (a class registered with ``register_vjp``); the helpers rules are written with (the table
form ``unary``, sample makers, shared combinators) are in :mod:`fxad.rules._base`.  Rules are
grouped by op family, the way PyTorch's namespaces and ``derivatives.yaml`` group the ops;
where to find a rule:

* :mod:`fxad.rules.arithmetic` — ``+ - * / ** %``, ``div`` modes, ``rsub``, ``fmod``,
  ``remainder``, ``lerp``, ``addcmul``/``addcdiv``, ``clamp``, ``maximum``/``minimum``,
  ``fmax``/``fmin``, ``where``, ``nan_to_num``
* :mod:`fxad.rules.math` — unary and special functions: ``exp``, ``log``, trigonometric and
  hyperbolic functions, ``sigmoid``, ``erf``, ``lgamma``/``digamma``/``polygamma``, Bessel
  functions, ``logit``, ``atan2``, ``hypot``, ``logaddexp``, ``xlogy``
* :mod:`fxad.rules.reductions` — ``sum``, ``mean``, ``var``/``std``, ``amax``, ``max``,
  ``prod``, ``logsumexp``, ``median``/``mode``/``kthvalue``, ``quantile``, ``cov``,
  ``segment_reduce``
* :mod:`fxad.rules.scans` — ``cumsum``, ``cumprod``, ``logcumsumexp``, ``cummax``,
  ``trapezoid``, ``diff``, ``gradient``
* :mod:`fxad.rules.sorting` — ``sort``, ``msort``, ``topk``
* :mod:`fxad.rules.views` — shape ops, views and their ``*_copy`` forms, ``cat``/``stack``/
  ``split``, ``as_strided``, casts, ``clone``, ``detach``
* :mod:`fxad.rules.indexing` — ``x[i]``, ``x[i] = v``, ``gather``, ``scatter*``, ``index_*``,
  ``index_put``, ``take``, ``masked_fill``/``masked_scatter``, ``*_scatter``
* :mod:`fxad.rules.linalg` — products, decompositions, solvers, matrix functions, norms
* :mod:`fxad.rules.fft` — ``torch.fft`` transforms and ``stft``
* :mod:`fxad.rules.complex_ops` — ``real``/``imag``, ``view_as_real``/``view_as_complex``,
  ``complex``, ``polar``, ``conj``, ``angle``
* :mod:`fxad.rules.random` — ``bernoulli``, ``normal`` (drawn as eager draws them)
* :mod:`fxad.rules.nn` — ``torch.nn.functional``: activations, normalization, convolution,
  pooling, attention, losses, embedding, dropout, recurrent networks (``torch.lstm``,
  ``gru``, ``rnn_tanh``/``rnn_relu`` and the ``*_cell`` ops), ...

Support modules: :mod:`fxad.rules.fused` (the fused-kernel level switch),
:mod:`fxad.rules.complex` (which rules are verified for complex tensors, installed into the
op records last), :mod:`fxad.rules.fallback` (the autograd fallback, registered last for ops
without a hand-written rule) and :mod:`fxad.rules.dispatch` (which rule differentiates a
graph node).  ``docs/supported_ops.md`` lists the file of every rule.

Rule modules import only torch, the registry, :mod:`fxad.rules._base`, :mod:`fxad.rules.fused`
and their own package's ``_common`` helpers, never each other
(``tests/test_layout.py`` checks it).
"""
from .registry import Rule, all_rules, lookup, register_vjp, unregister

__all__ = ["Rule", "all_rules", "lookup", "register_vjp", "unregister"]
