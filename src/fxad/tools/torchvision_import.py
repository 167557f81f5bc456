"""Import torchvision beside the CPU build of torch, whether or not its C++ extension loads.

torchvision's Linux wheel on PyPI is a CUDA build.  Beside the CPU build of torch its C++
extension (``torchvision/_C.so``) does not load, which torchvision tolerates, but then
``import torchvision`` fails in ``torchvision/_meta_registrations.py``, whose
``torch.library.register_fake("torchvision::nms")`` (and ``qnms``) does not first ask whether
the extension defined those operators: "RuntimeError: operator torchvision::nms does not
exist".  transformers imports torchvision wherever it is installed (``image_utils``, reached
from every model class), and so does timm.

:func:`prepare_torchvision` first tries to load the extension itself; only where that fails
does it declare the schemas of those two operators, exactly as torchvision's C++ code
declares them and with no kernel, so that the registrations succeed.  Nothing else changes:
``torchvision.extension._has_ops()`` stays False, the detection ops raise torchvision's own
"Couldn't load custom C++ ops", and a direct ``torch.ops.torchvision.nms`` call raises
PyTorch's "could not run ... with arguments from the 'CPU' backend".  The models and
transforms need none of those operators.
"""
from __future__ import annotations

import glob
import importlib
import importlib.util
import os
from typing import Any

import torch

__all__ = ["prepare_torchvision", "import_torchvision"]

# the operators torchvision/_meta_registrations.py registers fake kernels for without asking
# whether its C++ extension (which defines them) loaded
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_DECLARED: list[torch.library.Library] = []  # kept alive: dropping it removes the schemas


def _defined(qualname: str) -> bool:
    return bool(torch._C._jit_get_schemas_for_operator(qualname))


def prepare_torchvision() -> bool:
    """Make ``import torchvision`` work beside this torch (see the module's docstring).

    Idempotent, and a no-op where torchvision is not installed or its extension loads.

    Returns:
        True where the schemas had to be declared (the extension does not load here).
    """
    if _DECLARED:
        return True
    if _defined("torchvision::nms"):
        return False
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    for folder in spec.submodule_search_locations:
        for path in glob.glob(os.path.join(folder, "_C*.so")) + \
                glob.glob(os.path.join(folder, "_C*.pyd")):
            try:
                torch.ops.load_library(path)  # what torchvision itself does, a no-op twice
            except OSError:
                continue
            if _defined("torchvision::nms"):
                return False
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _SCHEMAS:
        lib.define(schema)
    _DECLARED.append(lib)
    return True


def import_torchvision() -> Any:
    """:func:`prepare_torchvision`, then ``import torchvision``.

    Returns:
        the ``torchvision`` module.

    Raises:
        ModuleNotFoundError: torchvision is not installed.
    """
    prepare_torchvision()
    return importlib.import_module("torchvision")
