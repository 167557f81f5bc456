"""The derivative engines: reverse mode (:mod:`~fxad.ad.reverse`), forward mode
(:mod:`~fxad.ad.forward`), the rule lookup they share (:mod:`~fxad.ad.node_rules`), the
derivatives of custom ``autograd.Function``\\ s (:mod:`~fxad.ad.custom_function`) and of
control flow (:mod:`~fxad.ad.control_flow`), the classes of generated modules
(:mod:`~fxad.ad.generated`) and the engine entry that turns a captured graph into its
derivative module (:mod:`~fxad.ad.transform`).

Importing the package registers the node kinds with their own rules (custom Functions,
control flow) in :mod:`fxad.ad.node_rules`, whichever engine module is imported first.
"""
from . import control_flow, custom_function  # noqa: F401  (register their node rules)
