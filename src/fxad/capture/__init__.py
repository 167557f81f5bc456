"""Capture: the program run on fake tensors and recorded as a torch.fx graph
(:mod:`fxad.capture.tracer`, whose docstring gives the mechanism, the policies and the
modules of this package), then normalized (:mod:`fxad.capture.normalize`)."""
