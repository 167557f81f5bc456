"""Session set-up shared by the test modules.

torchvision's Linux wheel on PyPI (installed by the ``test`` extras for the library-model
suite) is a CUDA build whose ``import torchvision`` fails beside the CPU build of torch, and
transformers imports torchvision wherever it is installed: see
:mod:`fxad.tools.torchvision_import`, which makes the import work without changing anything
else, before any test module imports transformers, timm or torchvision.
"""
from fxad.tools.torchvision_import import prepare_torchvision

prepare_torchvision()
