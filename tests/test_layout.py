"""The package's shape (docs/architecture.md): no import cycle between its modules, the runtime
imports neither tools/, tests/ nor the repository root's app.py, and only serving/ knows Gradio."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import sdxl_engine

PACKAGE = Path(sdxl_engine.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at its top or inside a function, as absolute names."""
    tree, found = ast.parse(path.read_text(), str(path)), set()
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}  # "from pkg import module"
    return found


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {name: {m for m in imports(path) if m in MODULES and m != name} for name, path in MODULES.items()}


def _parents(name: str) -> set[str]:
    """A module's packages: importing a.b.c runs a/__init__ and a/b/__init__ first."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_runtime_has_no_import_cycle():
    # Package __init__ files only hold docstrings, so an edge to a package is not an edge to its modules.
    assert cycles(GRAPH) == []


def test_the_tools_have_no_import_cycle():
    """tools/ (STYLE.md rule 17: a cycle between two modules is one concept living in both)."""
    tools = {module_name(p): p for p in (PACKAGE.parent / "tools").rglob("*.py")}
    assert cycles({name: {m for m in imports(path) if m in tools and m != name} for name, path in tools.items()}) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_runtime_imports_no_tool_no_test_and_not_app():
    bad = {name: sorted(m for m in imports(path) if m.split(".")[0] in ("tools", "tests", "app", "conftest"))
           for name, path in MODULES.items()}
    assert {k: v for k, v in bad.items() if v} == {}


def test_app_py_is_the_pages_layout_and_event_wiring():
    """app.py (issue #59: "back to the page's layout"): at most 250 lines, one function (build_demo) with no
    function inside it: what an event runs lives in serving/ (page.py's plain functions, page_*.py's wiring)."""
    path = PACKAGE.parent / "app.py"
    tree = ast.parse(path.read_text(), str(path))
    functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert len(path.read_text().splitlines()) <= 250
    assert [node.name for node in functions] == ["build_demo"]


def test_only_serving_imports_gradio():
    users = sorted(name for name, path in MODULES.items()
                   if any(m.split(".")[0] in ("gradio", "gradio_client") for m in imports(path)))
    assert users and all(name.startswith("sdxl_engine.serving.") for name in users), users


def test_the_service_and_the_engine_know_no_front():
    """The service layer imports no Gradio and nothing of serving/; the engine (and below) nothing of either; no
    front of serving/apis imports another front or the page's handler (each is a client of the service)."""
    def imports_of(prefix):
        return {name: {m for m in GRAPH[name] | imports(MODULES[name]) if m.split(".")[0] in ("gradio", "gradio_client")
                       or m.startswith("sdxl_engine.serving")} for name in MODULES if name.startswith(prefix)}

    assert {k: v for k, v in imports_of("sdxl_engine.service").items() if v} == {}
    for layer in ("engine", "program", "models", "checkpoint"):
        assert {name for name in MODULES if name.startswith(f"sdxl_engine.{layer}")
                and any(m.startswith(("sdxl_engine.service", "sdxl_engine.serving")) for m in GRAPH[name])} == set()
    fronts = {"sdxl_engine.serving.apis.a1111", "sdxl_engine.serving.apis.openai_images",
              "sdxl_engine.serving.apis.jobs", "sdxl_engine.serving.handler"} & set(MODULES)
    crossing = {front: sorted(GRAPH[front] & (fronts - {front})) for front in fronts}
    assert {k: v for k, v in crossing.items() if v} == {}


def test_each_layer_is_a_folder():
    layers = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert layers == {"checkpoint", "models", "program", "engine", "service", "serving"}
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py", "config.py"]


TESTS = PACKAGE.parent / "tests"
TEST_FILES = sorted(path for path in TESTS.rglob("test_*.py") if "fixtures" not in path.relative_to(TESTS).parts)
REPOSITORY_CHECKS = {"layout", "repository"}  # tests/test_layout.py, tests/test_repository.py: the repository's own


def test_test_files_have_unique_names():
    """tests/ folders are not packages: pytest imports each test file by its base name, so two files of one name
    (tests/serving/test_x.py and tests/engine/test_x.py) stop the whole collection."""
    from collections import Counter

    names = Counter(path.name for path in TEST_FILES)
    assert [name for name, count in names.items() if count > 1] == []


def test_tests_mirror_the_package():
    """Each test file is found by its module's name: ``tests/<layer>/test_<module>[_<topic>].py`` for
    ``sdxl_engine/<layer>/<module>.py`` (or the layer's own package), ``tests/tools/`` for tools/, and at the top
    the two top-level modules (app.py, sdxl_engine/config.py) and the repository's own checks."""
    tools = PACKAGE.parent / "tools"
    misplaced = []
    for path in TEST_FILES:
        where = path.parent.relative_to(TESTS).parts
        if where == ():
            names = {"app", "config"} | REPOSITORY_CHECKS
        elif where[0] == "tools":
            names = {p.stem for p in tools.glob("*.py")} - {"__init__"}
        else:
            folder = PACKAGE.joinpath(*where)
            names = {p.stem for p in folder.glob("*.py")} - {"__init__"} | {folder.name}
        stem = path.stem[len("test_"):]
        if not any(stem == name or stem.startswith(name + "_") for name in names):
            misplaced.append(str(path.relative_to(TESTS)))
    assert misplaced == []


E2E_SIGNS = ("RunningApp", "app_server", "serve_harness", "sync_playwright")  # an app process, a browser


def test_a_test_file_that_starts_an_app_is_marked_e2e_and_so_slow(request):
    """The level is a mark, so it must be on every file that starts ``python app.py``, a server or a browser (and
    on no other), and ``pytest -m "not slow"`` must skip those: conftest makes every e2e test slow."""
    import re

    marked = re.compile(r"^pytestmark = \[?[^\n]*pytest\.mark\.e2e\b", re.M)
    texts = {path: path.read_text() for path in TEST_FILES if path != Path(__file__)}
    wrong = [str(path.relative_to(TESTS)) for path, text in texts.items()
             if any(sign in text for sign in E2E_SIGNS) != bool(marked.search(text))]
    assert wrong == []

    class Item:  # what conftest's hook reads and writes of a collected test
        def __init__(self, *marks, path="tests/test_x.py"):
            self.marks, self.path = [m.mark for m in marks], Path(path)

        def get_closest_marker(self, name):
            return next((m for m in self.marks if m.name == name), None)

        def add_marker(self, marker):
            self.marks.append(marker.mark)

    conftest = next(p for p in request.config.pluginmanager.get_plugins()
                    if getattr(p, "__file__", "") == str(TESTS / "conftest.py"))
    items = [Item(pytest.mark.e2e), Item(pytest.mark.engine), Item()]
    conftest.pytest_collection_modifyitems(request.config, items)
    assert [[m.name for m in item.marks] for item in items] == [["e2e", "slow"], ["engine"], []]
    # and the files run heaviest first (a file with a slow test, then with an engine test), each file's tests
    # together in their order
    items = [Item(path="unit.py"), Item(pytest.mark.engine, path="engine.py"), Item(path="app.py"),
             Item(pytest.mark.e2e, path="app.py"), Item(path="engine.py")]
    before = list(items)
    conftest.pytest_collection_modifyitems(request.config, items)
    assert items == [before[2], before[3], before[1], before[4], before[0]]


def test_pyproject_lists_every_package_and_carries_the_top_level_assets():
    """pyproject.toml names its packages one by one (so the repository's top-level assets/ can be mapped into the
    package): the list is every folder of sdxl_engine/ with an __init__.py or with data files directly in it (if
    its name can be imported: setuptools warns of one left out), plus sdxl_engine.assets from assets/, where the
    checkout's tiny-shapes is found."""
    import tomllib

    from sdxl_engine.checkpoint.builtin import TINY_SHAPES_DIR

    setuptools = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {module_name(init) for init in PACKAGE.rglob("__init__.py")}
    data = {module_name(folder / "__init__.py") for folder in PACKAGE.rglob("*") if folder.is_dir()
            and folder.name != "__pycache__" and not (folder / "__init__.py").exists()
            and any(f.is_file() for f in folder.iterdir())
            and all(part.isidentifier() for part in folder.relative_to(PACKAGE.parent).parts)}
    assert data == {"sdxl_engine.checkpoint.configs", "sdxl_engine.serving.deploy.kuberay"}
    assert set(setuptools["packages"]) == folders | data | {"sdxl_engine.assets"}
    assert len(setuptools["packages"]) == len(set(setuptools["packages"]))
    assert setuptools["package-dir"] == {"sdxl_engine.assets": "assets"}
    assert setuptools["package-data"]["sdxl_engine.assets"] == ["**/*"]
    assert not (PACKAGE / "assets").exists()  # one copy, at the top level
    assert TINY_SHAPES_DIR == PACKAGE.parent / "assets" / "tiny-shapes" \
        and (TINY_SHAPES_DIR / "model_index.json").is_file()


@pytest.mark.slow  # builds a wheel (about 10 s)
def test_the_built_wheel_ships_the_package_and_tiny_shapes(tmp_path):
    """``pip install .``'s wheel, built from a copy of the package's sources: every module of sdxl_engine/, the
    configs and manifests, and every file of assets/ under sdxl_engine/assets/; nothing of tools/ or tests/."""
    import shutil
    import subprocess
    import sys
    import zipfile

    root = PACKAGE.parent
    source = tmp_path / "source"
    for name in ("pyproject.toml", "README.md", "requirements.txt"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / name, source / name)
    for name in ("sdxl_engine", "assets"):
        shutil.copytree(root / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, timeout=300)
    wheel, = (tmp_path / "dist").glob("sdxl_engine-*.whl")
    shipped = {name for name in zipfile.ZipFile(wheel).namelist() if not name.endswith("/")}
    expected = {path.relative_to(root).as_posix() for path in PACKAGE.rglob("*")
                if path.is_file() and "__pycache__" not in path.parts}
    expected |= {"sdxl_engine/" + path.relative_to(root).as_posix() for path in (root / "assets").rglob("*")
                 if path.is_file()}
    assert expected - shipped == set()
    package_files = {name for name in shipped if not name.startswith("sdxl_engine-")}
    assert package_files == expected
