"""fxad's version (one place: the package, the CLI and the view page read it)."""
__version__ = "0.1.0"
