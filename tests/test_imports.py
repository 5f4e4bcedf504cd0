"""`import moe_attrib` is light and every name the package offered stays importable, whatever was imported
first; `python -m moe_attrib` and the `moe-attrib` script entry still run `cli.main`."""

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import moe_attrib

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

# `moe_attrib.__all__` at 3911cc1, when `__init__.py` imported every module.
RECORDED_ALL = {
    "AttributionCallback", "AttributionCheckpointer", "EnsembleError", "RunScores", "score_run", "GraphedCollector",
    "Balance", "Coupling", "CoverageReport", "DataError", "Example", "EKFAC", "ExpertLinear", "GradientCollector",
    "Index", "IndexFileError", "LayoutError", "PerExampleGradients", "RefineError", "RefinedQueries", "ScoreError",
    "Scores", "__version__", "build_index", "discover", "expand_moe", "fit_balance", "fit_coupling", "fit_ekfac",
    "load_ekfac", "load_examples", "load_index", "per_example_gradients", "precondition_queries", "prepare_queries",
    "query_gradients", "refine_queries", "restore_moe", "score", "score_matrix", "track_moe_experts",
}  # fmt: skip
# The subpackages and top-level modules, each reachable as an attribute after a bare `import moe_attrib`.
SUBPACKAGES = {
    "app", "collect", "curvature", "indexing", "model", "scoring", "workflows", "data", "errors", "fingerprint",
    "outputs", "settings", "synthetic", "version",
}  # fmt: skip


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=300)


def test_import_loads_no_other_module_nor_torch():
    res = python(
        "import sys; import moe_attrib; "
        "print(sorted(m for m in sys.modules if m.startswith(('moe_attrib', 'torch', 'transformers', 'numpy'))))"
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "['moe_attrib', 'moe_attrib.version']"


def test_every_recorded_name_imports_from_the_package():
    assert RECORDED_ALL <= set(moe_attrib.__all__)  # every 0.1.0 name stays; names were added since
    assert RECORDED_ALL <= set(dir(moe_attrib))
    namespace: dict = {}
    exec(f"from moe_attrib import {', '.join(sorted(RECORDED_ALL))}", namespace)
    exec("from moe_attrib import *", star := {})
    for name in RECORDED_ALL - {"__version__"}:
        assert namespace[name] is star[name] is getattr(moe_attrib, name), name
    for name in SUBPACKAGES:
        assert getattr(moe_attrib, name) is importlib.import_module(f"moe_attrib.{name}"), name


def test_lazy_names_are_the_type_checking_imports():
    """The names under `if TYPE_CHECKING:` (what type checkers see) are what the package gives at run time."""
    tree = ast.parse((ROOT / "moe_attrib" / "__init__.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    imported = {a.name: n.module for n in block.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert set(imported) | {"__version__"} == set(moe_attrib.__all__)
    table = next(n.value for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "_MODULES")
    assert {name: module for module, names in ast.literal_eval(table).items() for name in names.split()} == imported
    for name, module in imported.items():
        assert getattr(moe_attrib, name) is getattr(importlib.import_module(module), name), name


def test_score_is_the_function_whatever_was_imported_first():
    """`moe_attrib.score` is the public function; its module is `moe_attrib.scoring.score`, so importing that
    module first cannot rebind the package's name."""
    for first in ("import moe_attrib.app.cli", "import moe_attrib.scoring.score", "from moe_attrib import score"):
        res = python(f"{first}\nimport moe_attrib\nfrom moe_attrib import score\nprint(score, moe_attrib.score)")
        assert res.returncode == 0, res.stderr
        assert res.stdout.count("<function score at") == 2, (first, res.stdout)


def test_module_and_script_entry_run_main():
    res = subprocess.run(
        [sys.executable, "-m", "moe_attrib", "--help"], capture_output=True, text=True, env=ENV, timeout=300
    )
    assert res.returncode == 0 and res.stdout.startswith("usage: moe-attrib"), res.stderr
    entry = re.search(r'^moe-attrib = "([\w.]+):(\w+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert entry and entry.groups() == ("moe_attrib.app.cli", "main")
    res = python("import sys; from moe_attrib.app.cli import main; sys.argv = ['moe-attrib', '--version']; main()")
    assert res.returncode == 0 and moe_attrib.__version__ in res.stdout, res.stderr


def test_help_loads_no_torch():
    """`moe-attrib --help` and a command's `--help` are built from `moe_attrib.settings` alone: no torch, numpy
    or transformers, and only a handful of the package's modules."""
    res = python(
        "import contextlib, io, sys\n"
        "from moe_attrib.app.cli import main\n"
        "for argv in (['--help'], ['build', '--help'], ['ekfac', '--help'], ['score', '--help']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "        main(argv)\n"
        "print(sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules))\n"
        "print(len([m for m in sys.modules if m.startswith('moe_attrib')]))"
    )
    assert res.returncode == 0, res.stderr
    heavy, count = res.stdout.split("\n")[:2]
    assert heavy == "[]"
    assert int(count) <= 8
