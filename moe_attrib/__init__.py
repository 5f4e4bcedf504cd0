"""moe-attrib: per-example gradient attribution for Mixture-of-Experts language models.

`import moe_attrib` loads nothing but the version: each public name is imported from its module on
first use (`from moe_attrib import build_index`), so `moe-attrib --help` and a script that needs
one piece do not pay for torch and transformers up front.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import TYPE_CHECKING

from moe_attrib.version import __version__

if TYPE_CHECKING:  # the same names, for type checkers and editors
    from moe_attrib.balance import Balance, fit_balance
    from moe_attrib.build import build_index
    from moe_attrib.collector import GradientCollector, PerExampleGradients, per_example_gradients
    from moe_attrib.coupling import Coupling, fit_coupling
    from moe_attrib.data import DataError, Example, load_examples
    from moe_attrib.discovery import CoverageReport, discover
    from moe_attrib.ekfac import EKFAC, fit_ekfac, load_ekfac
    from moe_attrib.ensemble import EnsembleError, RunScores, score_run
    from moe_attrib.experts import ExpertLinear, LayoutError, expand_moe, restore_moe, track_moe_experts
    from moe_attrib.graphs import GraphedCollector
    from moe_attrib.ihvp import RefinedQueries, RefineError, refine_queries
    from moe_attrib.index import Index, IndexFileError, load_index
    from moe_attrib.score import (
        ScoreError,
        Scores,
        precondition_queries,
        prepare_queries,
        query_gradients,
        score,
        score_matrix,
    )
    from moe_attrib.trainer import AttributionCallback, AttributionCheckpointer

__all__ = [
    "AttributionCallback",
    "AttributionCheckpointer",
    "EnsembleError",
    "RunScores",
    "score_run",
    "GraphedCollector",
    "Balance",
    "Coupling",
    "CoverageReport",
    "DataError",
    "Example",
    "EKFAC",
    "ExpertLinear",
    "GradientCollector",
    "Index",
    "IndexFileError",
    "LayoutError",
    "PerExampleGradients",
    "RefineError",
    "RefinedQueries",
    "ScoreError",
    "Scores",
    "__version__",
    "build_index",
    "discover",
    "expand_moe",
    "fit_balance",
    "fit_coupling",
    "fit_ekfac",
    "load_ekfac",
    "load_examples",
    "load_index",
    "per_example_gradients",
    "precondition_queries",
    "prepare_queries",
    "query_gradients",
    "refine_queries",
    "restore_moe",
    "score",
    "score_matrix",
    "track_moe_experts",
]

_MODULES = {  # module: the public names it gives
    "moe_attrib.balance": "Balance fit_balance",
    "moe_attrib.build": "build_index",
    "moe_attrib.collector": "GradientCollector PerExampleGradients per_example_gradients",
    "moe_attrib.coupling": "Coupling fit_coupling",
    "moe_attrib.data": "DataError Example load_examples",
    "moe_attrib.discovery": "CoverageReport discover",
    "moe_attrib.ekfac": "EKFAC fit_ekfac load_ekfac",
    "moe_attrib.ensemble": "EnsembleError RunScores score_run",
    "moe_attrib.experts": "ExpertLinear LayoutError expand_moe restore_moe track_moe_experts",
    "moe_attrib.graphs": "GraphedCollector",
    "moe_attrib.ihvp": "RefinedQueries RefineError refine_queries",
    "moe_attrib.index": "Index IndexFileError load_index",
    "moe_attrib.score": "ScoreError Scores precondition_queries prepare_queries query_gradients score score_matrix",
    "moe_attrib.trainer": "AttributionCallback AttributionCheckpointer",
}
_HOME = {name: module for module, names in _MODULES.items() for name in names.split()}


def __getattr__(name: str) -> object:
    """A public name, imported from its module on first use; else a submodule (`moe_attrib.index`), as when
    this file imported every module. `__main__` is no attribute: importing it runs the command."""
    if name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
    elif name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    else:
        value = importlib.import_module(f"{__name__}.{name}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The names loaded so far and every public name (loaded or not)."""
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """The package module. Importing a submodule binds it on the package under its name; where a public
    name is that name (`score`, the function of `moe_attrib.score`), the public name wins, as before."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in _HOME and isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.{name}":
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
