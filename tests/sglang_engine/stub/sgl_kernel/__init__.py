"""A stand-in for ``sgl_kernel``, SGLang's compiled kernel package, for the CPU test lane.

sglang 0.5.23 imports ``sgl_kernel`` (and submodules such as ``sgl_kernel.kvcacheio``) at
module level on its CPU path, e.g. ``kernels/ops/kvcache/cache_move.py``, but the package has no
CPU build on the registry. On the torch-native attention path none of its kernels runs, so this
module only has to satisfy the imports: every name it hands out is a :class:`Missing` whose call
raises. Each import and each call is appended to the file named by ``HSSTORE_SGL_KERNEL_LOG``
(engine work happens in subprocesses, so a file is what reaches the test), and the lane asserts
that the log shows the stand-in imported and never called: it can never quietly test a stub.

``torch.ops.sgl_kernel`` stays empty, so ``cpu_has_amx_support()`` is False and SGLang picks its
native layers by itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

LOG_ENV = "HSSTORE_SGL_KERNEL_LOG"
__version__ = "0.0.0+hsstore-stand-in"


def record(event: str) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"{event} pid={os.getpid()}\n")


class StandInCalled(RuntimeError):
    """A kernel of the stand-in was called: the lane ran code the real engine would not."""


class Missing:
    """A name from the stand-in: attributes give more stand-ins, a call records and raises."""

    def __init__(self, qualname: str):
        self._qualname = qualname

    def __getattr__(self, name: str) -> Missing:
        if name.startswith("__"):
            raise AttributeError(name)
        return Missing(f"{self._qualname}.{name}")

    def __call__(self, *args, **kwargs):
        record(f"call {self._qualname}")
        raise StandInCalled(f"{self._qualname} is a test stand-in (no sgl_kernel CPU build)")

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in {self._qualname}>"


def _module_getattr(module_name: str):
    def __getattr__(name: str) -> Missing:
        if name.startswith("__"):
            raise AttributeError(name)
        return Missing(f"{module_name}.{name}")

    return __getattr__


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every ``sgl_kernel.X`` submodule is an empty module that hands out stand-ins."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        record(f"import {module.__name__}")


sys.meta_path.insert(0, _SubmoduleFinder())
__getattr__ = _module_getattr(__name__)
record(f"import {__name__}")
