"""Plants a wrong layer: every aux depth the vllm backend asks for becomes the next one, so
each stored aux layer holds the layer below the one its label names (the lane checks that
``--check-against transformers`` catches it). On PYTHONPATH for one command only."""

import importlib.abc
import importlib.machinery
import sys

TARGET = "hsstore.extractors.backends.vllm.backend"


def _shift(module):
    plan = module.plan_capture

    def shifted(layers, num_hidden_layers):
        got = plan(layers, num_hidden_layers)
        deeper = [min(i + 1, num_hidden_layers) for i in got.aux_ids]
        return module.CapturePlan(aux_ids=deeper, layout=got.layout)

    module.plan_capture = shifted


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module):
            run(module)
            _shift(module)

        loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
