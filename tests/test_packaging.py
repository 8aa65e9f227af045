"""The package as people install it: a wheel that works outside the repository.

The wheel is built from a copy of the source tree, installed into a fresh virtual environment
in a temporary folder, and `hsstore demo` runs there from another folder. The environment gets
its third-party packages (torch, zarr, transformers, ...) from the running interpreter's
site-packages through a ``.pth`` file instead of downloading them, so the test takes seconds.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED_SCHEMAS = ROOT / "schemas"
PACKAGE_SCHEMAS = ROOT / "hsstore" / "schemas"
_NOT_SOURCE = shutil.ignore_patterns(
    ".git",
    ".venv",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    "*.so",  # the wheel compiles its module itself
    ".*_cache",
    "bench_out",
    "demo_out",
)


def test_package_schemas_are_the_published_ones():
    # The top-level schemas/ is the source of truth (the copy people link to and edit); the
    # code reads the copy inside the package. `make schemas` brings the package copy up to date.
    published = sorted(p.name for p in PUBLISHED_SCHEMAS.glob("*.json"))
    packaged = sorted(p.name for p in PACKAGE_SCHEMAS.glob("*.json"))
    assert published == packaged and published, "run `make schemas`"
    for name in published:
        assert (PUBLISHED_SCHEMAS / name).read_bytes() == (PACKAGE_SCHEMAS / name).read_bytes(), (
            f"schemas/{name} differs from hsstore/schemas/{name}: run `make schemas`"
        )


def test_code_reads_the_package_schema():
    from hsstore import schemas
    from hsstore.spec import schema

    assert schema.schema() == schemas.load(schemas.MANIFEST)
    assert schema.schema() == json.loads((PUBLISHED_SCHEMAS / schemas.MANIFEST).read_text())


def _shared_site_packages() -> list[str]:
    """Where the running interpreter finds its third-party packages, minus this repository."""
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return [d for d in dict.fromkeys(dirs) if Path(d).is_dir() and Path(d) != ROOT]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src") / "hsstore"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCE)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(src)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    (whl,) = out.glob("hsstore-*.whl")
    return whl


def test_wheel_ships_the_library_and_not_the_tools(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"hsstore"}
    for needed in ("manifest.schema.json", "inspect.schema.json"):
        assert f"hsstore/schemas/{needed}" in names
    assert "hsstore/demo_model.py" in names and "hsstore/py.typed" in names
    # the compiled modules (the split-zstd decoder, the batch checksums and reads), for this
    # interpreter
    for module in ("codec/_split_decoder", "spec/_xxh3_many", "storage/_pread_many"):
        (built,) = [n for n in names if n.startswith(f"hsstore/{module}.")]
        assert built.endswith(".so") and f"hsstore/{module}.c" not in names


# Loaded by a .pth line in the wheel's environment: makes the modules named in $HSSTORE_HIDE
# unimportable, as in an install without the extra that brings them.
_HIDER = """
import importlib.abc, os, sys

class _Hide(importlib.abc.MetaPathFinder):
    names = set(filter(None, os.environ.get("HSSTORE_HIDE", "").split(",")))

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _Hide())
"""


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """Runs a command in a fresh environment holding the wheel, from a folder outside the
    repository: ``run(*args, hide=())`` with ``hide`` the modules to make unimportable."""
    tmp_path = tmp_path_factory.mktemp("installed")
    env_dir = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         "--no-index", str(wheel)],
        check=True, capture_output=True, text=True, env=env,
    )  # fmt: skip
    # Only after installing, or pip would take the shared editable hsstore for this one. Plain
    # directory lines: those folders' own .pth files (the editable hsstore) stay inactive.
    Path(purelib, "shared_site.pth").write_text("\n".join(_shared_site_packages()) + "\n")
    Path(purelib, "_hsstore_test_hide.py").write_text(_HIDER)
    Path(purelib, "_hsstore_test_hide.pth").write_text("import _hsstore_test_hide\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def run(*args: str | Path, hide: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(a) for a in args], cwd=elsewhere, capture_output=True, text=True,
            env={**env, "HSSTORE_HIDE": ",".join(hide)},
        )  # fmt: skip

    run.env_dir = env_dir
    run.elsewhere = elsewhere
    return run


def test_installed_wheel_runs_the_demo_from_another_folder(installed):
    run, env_dir, elsewhere = installed, installed.env_dir, installed.elsewhere
    python = env_dir / "bin" / "python"
    where = run(
        python,
        "-c",
        "import hsstore, hsstore.extractors, hsstore.trainers.eagle3; print(hsstore.__file__)",
    )
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(env_dir), where.stdout
    no_tools = run(python, "-c", "import tools")
    assert no_tools.returncode != 0 and "No module named 'tools'" in no_tools.stderr

    demo = run(env_dir / "bin" / "hsstore", "demo", "out", "--json")
    assert demo.returncode == 0, demo.stderr[-3000:]
    summary = json.loads(demo.stdout[demo.stdout.index("{") :])
    assert summary["verify_ok"] is True and summary["inspect_verdict"] == "OK"
    assert summary["extract"]["samples_written"] == summary["v1_files"] > 0
    assert (elsewhere / "out" / "dataset").is_dir()

    extract_help = run(env_dir / "bin" / "hsstore", "extract", "--help")
    assert extract_help.returncode == 0 and "--model" in extract_help.stdout


@pytest.mark.parametrize("hidden", ["transformers", "tokenizers"])
def test_wheel_without_the_extract_extra_says_what_to_install(installed, hidden):
    """Without transformers (or tokenizers) the commands that run a model stop in one line
    naming the install command, exit 2 and create nothing."""
    hsstore_bin = installed.env_dir / "bin" / "hsstore"
    python = installed.env_dir / "bin" / "python"
    gone = installed(python, "-c", f"import {hidden}", hide=(hidden,))
    assert gone.returncode != 0 and "ModuleNotFoundError" in gone.stderr  # really hidden
    (installed.elsewhere / "p.jsonl").write_text('{"text": "hello"}\n')
    for args in (
        ["demo", "no_extra_demo"],
        ["extract", "--model", "model_dir", "--data", "p.jsonl", "--out", "no_extra_ds"],
    ):
        r = installed(hsstore_bin, *args, hide=(hidden,))
        assert r.returncode == 2, (args, r.stderr[-2000:])
        assert "Traceback" not in r.stderr and r.stdout == ""
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1, r.stderr[-2000:]
        assert f"needs {hidden}" in lines[0] and "pip install 'hsstore[extract]'" in lines[0]
    assert not (installed.elsewhere / "no_extra_demo").exists()
    assert not (installed.elsewhere / "no_extra_ds").exists()


def _runtime_imports(path: Path, module: str, modules: set[str]) -> set[str]:
    """The library modules ``module`` imports, anywhere in it (functions included) except
    under ``if TYPE_CHECKING:``; ``from pkg import sub`` counts as importing ``pkg.sub``."""
    found: set[str] = set()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    class Imports(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            test = node.test
            if getattr(test, "id", getattr(test, "attr", None)) == "TYPE_CHECKING":
                for child in node.orelse:
                    self.visit(child)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.update(filter(None, (resolve(a.name) for a in node.names)))

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            base = node.module or ""
            if node.level:
                package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in modules else resolve(base) or "")

    Imports().visit(ast.parse(path.read_text()))
    return {m for m in found if m and m != module and m != "hsstore"}


def test_no_import_cycles_in_the_library():
    # Each module may be read (and changed) without the modules that use it: a cycle (such as a
    # dataset that imports its writer which imports the dataset) makes two modules one.
    files = {}
    for path in (ROOT / "hsstore").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {m: _runtime_imports(p, m, set(files)) for m, p in files.items()}

    def cycle_from(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    return [*trail, start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*trail, nxt]))
        return None

    cycles = [c for m in sorted(graph) if (c := cycle_from(m))]
    assert not cycles, "import cycle: " + " -> ".join(cycles[0])
    assert (
        "hsstore.dataset.writer" in graph["hsstore.dataset.dataset"]
    )  # the check sees real imports


def test_readme_ci_and_makefile_agree_on_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Set up.*?```bash\n(.*?)```", readme, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert commands == ["make demo", "make test"]
    ci = [
        line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and line[0] != "#"
    ]
    assert ci[-1] == "make test" and "set -euo pipefail" in ci
    makefile = (ROOT / "Makefile").read_text()
    test_recipe = makefile[makefile.index("\ntest:") :].split("\n\n")[0]
    assert "ruff check ." in test_recipe and "-m pytest" in test_recipe
    recipe = [line[1:] for line in test_recipe.splitlines() if line.startswith("\t")]
    # Every failure fails the target: no make "-" prefix, no "|| true" (pytest's exit 5 too).
    assert recipe and not any(line.startswith("-") or "|| true" in line for line in recipe)


def test_no_test_skips_when_a_module_of_ours_is_missing():
    # A renamed or broken module must fail its tests, not turn them into skips.
    ours = r"""importorskip\(\s*["'](hsstore|tools)\b"""
    offenders = [p.name for p in (ROOT / "tests").glob("*.py") if re.search(ours, p.read_text())]
    assert offenders == []


def test_runtime_dependencies_are_what_the_library_imports():
    # A runtime dependency the library never imports costs every user an install; zarr-python
    # is the interop contract that tests/test_store_roundtrip.py checks, not a library import.
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    imported = set()
    for path in (ROOT / "hsstore").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    assert declared <= imported, f"declared but never imported: {sorted(declared - imported)}"
    assert "zarr" not in imported and "zarr" not in declared
    assert any(d.startswith("zarr") for d in project["optional-dependencies"]["dev"])
