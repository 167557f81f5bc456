"""Capture: symbolic tracing with shape-carrying proxies, then normalization."""
