"""Rules for ``torch.nn.functional`` and the ATen-level nn entry points, one module a family:

* :mod:`~fxad.rules.nn.activations` — ``relu``, ``gelu``, ``silu``, ``elu``/``selu``/...,
  ``softplus``, ``glu``, ``prelu``, ``softmax``/``log_softmax``/``softmin``
* :mod:`~fxad.rules.nn.normalization` — ``layer_norm``, ``batch_norm``, ``group_norm``,
  ``instance_norm``, ``rms_norm``, ``local_response_norm``, ``normalize``, ``native_*_norm``
* :mod:`~fxad.rules.nn.linear` — ``linear``, ``bilinear``
* :mod:`~fxad.rules.nn.convolution` — ``conv{1,2,3}d``, ``conv_transpose{1,2,3}d``,
  ``unfold``/``fold``, ``torch.nn.grad.conv*d_input``/``_weight``
* :mod:`~fxad.rules.nn.pooling` — max / average / adaptive pooling, ``max_unpool``
* :mod:`~fxad.rules.nn.vision` — ``pad``, pixel/channel shuffles, ``interpolate``,
  ``grid_sample``
* :mod:`~fxad.rules.nn.attention` — ``scaled_dot_product_attention``
* :mod:`~fxad.rules.nn.losses` — every ``*_loss`` and ``cross_entropy`` (``ctc_loss``,
  ``gaussian_nll_loss``, ``linear_cross_entropy`` included)
* :mod:`~fxad.rules.nn.embedding` — ``embedding``, ``embedding_bag``
* :mod:`~fxad.rules.nn.distance` — ``cosine_similarity``, ``pairwise_distance``, ``pdist``,
  ``cdist``
* :mod:`~fxad.rules.nn.recurrent` — ``torch.lstm``/``gru``/``rnn_tanh``/``rnn_relu`` (what
  ``nn.LSTM``/``nn.GRU``/``nn.RNN`` call, padded or packed) and their ``*_cell`` ops: the time
  loop and backpropagation through time written out as code
* :mod:`~fxad.rules.nn.dropout` — dropout and the other random ops (their masks are drawn
  in the forward and replayed in the backward)

Helpers shared by these modules (and only by them) are in :mod:`fxad.rules.nn._common`.
"""
from . import (activations, attention, convolution, distance, dropout, embedding,  # noqa: F401
               linear, losses, normalization, pooling, recurrent, vision)
