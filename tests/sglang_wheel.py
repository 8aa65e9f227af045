"""SGLang's EAGLE-3 capture rules, read from the real sglang wheel's sources (never imported).

SGLang cannot run on CPU CI, but the rule each model class applies to the aux layer ids it is
given lives in plain Python: ``set_eagle3_layers_to_capture`` in ``sglang/srt/models/*.py``.
This module parses every model source with :mod:`ast`, finds every class that captures EAGLE-3
aux states (its own setter, one inherited from a base class, or one delegated to an inner
language model), and turns each setter into a callable rule by executing the setter's own code
against a recording stand-in for ``self``. Nothing is hand-kept: a class whose setter cannot be
run or does not tell which layers it captures raises :class:`Unclassifiable`.

Captured layer index L means the residual entering decoder layer L, i.e. depth L
(sglang/srt/models/llama.py, ``LlamaModel.forward``: ``if i in self.layers_to_capture:
aux_hidden_states.append(hidden_states + residual)`` before layer i runs).

The wheel is found through ``HSSTORE_SGLANG_WHEEL`` or in ``.cache/wheels/`` of the repository,
where ``scripts/install.sh`` downloads it.
"""

from __future__ import annotations

import ast
import builtins
import os
import textwrap
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

SGLANG_VERSION = "0.5.23"
WHEEL_DIR = Path(__file__).resolve().parent.parent / ".cache" / "wheels"
HOW_TO_GET = (
    f"the sglang {SGLANG_VERSION} wheel is needed (its sources are read, never imported): run "
    f"scripts/install.sh, or `pip download --no-deps sglang=={SGLANG_VERSION} -d .cache/wheels`, "
    "or point HSSTORE_SGLANG_WHEEL at the .whl"
)
MODELS = "sglang/srt/models/"
SETTER = "set_eagle3_layers_to_capture"


class Unclassifiable(AssertionError):
    """A class captures aux states, but its id -> layer rule could not be read."""


def find_wheel() -> Path:
    env = os.environ.get("HSSTORE_SGLANG_WHEEL")
    if env:
        path = Path(env)
        if not path.is_file():
            raise FileNotFoundError(f"HSSTORE_SGLANG_WHEEL={env} is not a file; {HOW_TO_GET}")
        return path
    found = sorted(WHEEL_DIR.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if not found:
        raise FileNotFoundError(f"no sglang wheel in {WHEEL_DIR}; {HOW_TO_GET}")
    return found[0]


@dataclass(frozen=True)
class ClassRef:
    module: str  # file name under sglang/srt/models/, without .py
    name: str
    node: ast.ClassDef

    @property
    def where(self) -> str:
        return f"sglang/srt/models/{self.module}.py:{self.node.lineno} {self.name}"


class _Probe:
    """A stand-in for ``self`` and everything reached from it: attribute reads give child
    probes, writes and calls are recorded, ``num_hidden_layers`` and ``len()`` give N."""

    def __init__(self, path: str, log: list, n: int):
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_log", log)
        object.__setattr__(self, "_n", n)
        object.__setattr__(self, "_children", {})

    def __getattr__(self, name: str):
        if name == "num_hidden_layers":
            return self._n
        children = self._children
        if name not in children:
            children[name] = _Probe(f"{self._path}.{name}", self._log, self._n)
        return children[name]

    def __setattr__(self, name: str, value) -> None:
        self._log.append(("set", f"{self._path}.{name}", value))
        self._children[name] = value

    def __call__(self, *args, **kwargs):
        self._log.append(("call", self._path, args, kwargs))
        return _Probe(f"{self._path}()", self._log, self._n)

    def __getitem__(self, key):
        return _Probe(f"{self._path}[]", self._log, self._n)

    def __bool__(self) -> bool:
        return True

    def __len__(self) -> int:
        return self._n

    def __iter__(self):
        return iter(())


class _Globals(dict):
    """Module globals for an executed setter: any name it uses resolves to a probe."""

    def __init__(self, log: list, n: int):
        super().__init__()
        self._log, self._n = log, n

    def __missing__(self, name: str):
        if hasattr(builtins, name):  # a non-exact dict is asked before the builtins are
            return getattr(builtins, name)
        return _Probe(name, self._log, self._n)


class SGLangModels:
    """Every ``sglang/srt/models/*.py`` of one wheel, parsed."""

    def __init__(self, wheel: Path):
        self.wheel = wheel
        self.sources: dict[str, str] = {}
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                rest = name[len(MODELS) :]
                if name.startswith(MODELS) and rest.endswith(".py") and "/" not in rest:
                    self.sources[rest[:-3]] = zf.read(name).decode()
        self.trees = {m: ast.parse(src) for m, src in self.sources.items()}
        self._compiled: dict[tuple[str, int], object] = {}
        self.classes: dict[tuple[str, str], ClassRef] = {}
        self.imports: dict[tuple[str, str], tuple[str, str]] = {}
        for module, tree in self.trees.items():
            for node in tree.body:
                if isinstance(node, ast.ClassDef):
                    self.classes[(module, node.name)] = ClassRef(module, node.name, node)
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "sglang.srt.models."
                ):
                    src_mod = node.module.rsplit(".", 1)[1]
                    for alias in node.names:
                        self.imports[(module, alias.asname or alias.name)] = (src_mod, alias.name)

    def resolve(self, module: str, name: str) -> ClassRef | None:
        seen = set()
        while (module, name) not in self.classes:
            if (module, name) in seen or (module, name) not in self.imports:
                return None
            seen.add((module, name))
            module, name = self.imports[(module, name)]
        return self.classes[(module, name)]

    def bases(self, ref: ClassRef) -> list[ClassRef]:
        out = []
        for base in ref.node.bases:
            if isinstance(base, ast.Name):
                if base.id == ref.name:  # class X(X): the X imported before this statement
                    src = self.imports.get((ref.module, base.id))
                    found = self.resolve(*src) if src else None
                else:
                    found = self.resolve(ref.module, base.id)
                if found is not None:
                    out.append(found)
        return out

    def find_method(self, ref: ClassRef, method: str) -> tuple[ClassRef, ast.FunctionDef] | None:
        """The method as Python's MRO would find it among the model sources (depth first)."""
        for node in ref.node.body:
            if isinstance(node, ast.FunctionDef) and node.name == method:
                return ref, node
        for base in self.bases(ref):
            found = self.find_method(base, method)
            if found is not None:
                return found
        return None

    def attribute_class(self, ref: ClassRef, attr: str) -> ClassRef | None:
        """The class constructed into ``self.<attr>`` by ``__init__`` (own or inherited)."""
        found = self.find_method(ref, "__init__")
        if found is None:
            return None
        owner, init = found
        for node in ast.walk(init):
            if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Call):
                continue
            for target in node.targets:
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr == attr
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                    and isinstance(node.value.func, ast.Name)
                ):
                    return self.resolve(owner.module, node.value.func.id)
        return None

    @cached_property
    def entry_classes(self) -> set[tuple[str, str]]:
        """(module, class) of every class a model module exports through ``EntryClass``."""
        out = set()
        for module, tree in self.trees.items():
            for node in tree.body:
                if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "EntryClass" for t in node.targets
                ):
                    names = node.value.elts if isinstance(node.value, ast.List) else [node.value]
                    for elt in names:
                        if isinstance(elt, ast.Name):
                            ref = self.resolve(module, elt.id)
                            if ref is not None:
                                out.add((ref.module, ref.name))
        return out

    def setter_param(self, ref: ClassRef) -> str | None:
        found = self.find_method(ref, SETTER)
        if found is None:
            return None
        args = found[1].args.args
        return args[1].arg if len(args) > 1 else None

    def capturing_classes(self) -> list[ClassRef]:
        """Every class with an EAGLE-3 capture setter taking draft-config ids (``layer_ids``):
        its own, inherited, or delegated. Inner ``...Model`` setters, which take the already
        shifted list, are covered through the class that calls them."""
        return sorted(
            (r for r in self.classes.values() if self.setter_param(r) == "layer_ids"),
            key=lambda r: (r.module, r.name),
        )

    def inner_setters(self) -> list[ClassRef]:
        return sorted(
            (r for r in self.classes.values() if self.setter_param(r) not in (None, "layer_ids")),
            key=lambda r: (r.module, r.name),
        )

    def run_setter(self, ref: ClassRef, ids: list[int] | None, n: int) -> list:
        """Execute the class's setter on ``ids`` for a model with ``n`` layers; the log."""
        found = self.find_method(ref, SETTER)
        if found is None:
            raise Unclassifiable(f"{ref.where}: no {SETTER}")
        owner, func = found
        key = (owner.module, func.lineno)
        if key not in self._compiled:
            source = textwrap.dedent(ast.get_source_segment(self.sources[owner.module], func))
            self._compiled[key] = compile(source, f"{owner.module}.py", "exec")
        log: list = []
        namespace = _Globals(log, n)
        exec(self._compiled[key], namespace)
        fn = namespace[func.name]
        fn(_Probe("self", log, n), None if ids is None else list(ids))
        return log

    def rule(self, ref: ClassRef) -> Callable[[list[int], int], list[int]]:
        """``rule(ids, n)``: the decoder-layer indices the class captures for draft ids."""
        return lambda ids, n: self.captured(ref, ids, n, depth=0)

    def captured(self, ref: ClassRef, ids: list[int], n: int, *, depth: int) -> list[int]:
        if depth > 4:
            raise Unclassifiable(f"{ref.where}: delegation does not end")
        try:
            log = self.run_setter(ref, ids, n)
        except Unclassifiable:
            raise
        except Exception as exc:  # the setter's own code could not run against the probe
            raise Unclassifiable(f"{ref.where}: cannot run {SETTER}: {exc!r}") from exc
        delegated = [e for e in log if e[0] == "call" and e[1].endswith("." + SETTER)]
        stored = [e for e in log if e[0] == "set" and e[1].endswith(".layers_to_capture")]
        if delegated:
            _, path, args, kwargs = delegated[-1]
            arg = list(args[0]) if args else list(kwargs.get("layer_ids", []))
            attr = path.split(".")[1]  # self.<attr>.set_eagle3_layers_to_capture
            target = self.attribute_class(ref, attr)
            if target is not None and self.setter_param(target) == "layer_ids":
                return self.captured(target, arg, n, depth=depth + 1)
            if target is not None and self.setter_param(target) is not None:
                return self.inner_stored(target, arg, n)
            if arg != list(ids):
                # an inner model built from a variable class (qwen3_vl, qwen3_5_text): every
                # inner setter in the wheel stores its list verbatim (checked separately)
                return arg
            raise Unclassifiable(
                f"{ref.where}: hands the ids unchanged to self.{attr}, whose class is not "
                "constructed from a model source in the wheel"
            )
        if stored:
            return [int(v) for v in stored[-1][2]]
        raise Unclassifiable(f"{ref.where}: {SETTER} stores no layers_to_capture")

    def inner_stored(self, ref: ClassRef, layers: list[int], n: int) -> list[int]:
        """What an inner model's setter (called with an already shifted list) captures."""
        log = self.run_setter(ref, layers, n)
        stored = [e for e in log if e[0] == "set" and e[1] == "self.layers_to_capture"]
        if not stored:
            raise Unclassifiable(f"{ref.where}: inner {SETTER} stores no layers_to_capture")
        return [int(v) for v in stored[-1][2]]

    def classify(self, ref: ClassRef, n: int = 12) -> str:
        """A name for the rule, from its behaviour on probe lists (for reports and the fake)."""
        rule = self.rule(ref)
        plus = rule([3, 5, 7], n) == [4, 6, 8]
        first_one = rule([1, 5, 7], n) == [2, 6, 8]
        identity = rule([3, 5, 7], n) == [3, 5, 7]
        to_final = rule([3, 5, n], n) == [3, 5, n]
        if plus and first_one and not to_final:
            return "llama"
        if plus and first_one and to_final:
            return "gpt-oss"
        if identity and first_one:
            return "deepseek"
        raise Unclassifiable(
            f"{ref.where}: [3,5,7]->{rule([3, 5, 7], n)}, [1,5,7]->{rule([1, 5, 7], n)}"
        )

    def forward_passes_prenorm(self, ref: ClassRef) -> bool:
        """Whether the class's forward hands ``hidden_states_before_norm`` to its logits
        processor (SGLang's FULL capture then returns that instead of what it stores first,
        sglang/srt/layers/logits_processor.py ``_get_hidden_states_to_store``)."""
        found = self.find_method(ref, "forward")
        if found is None:
            return False
        return any(
            isinstance(node, ast.keyword) and node.arg == "hidden_states_before_norm"
            for node in ast.walk(found[1])
        )
