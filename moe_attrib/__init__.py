"""moe-attrib: per-example gradient attribution for Mixture-of-Experts language models.

`import moe_attrib` loads nothing but the version: each public name is imported from its module on
first use (`from moe_attrib import build_index`), so `moe-attrib --help` and a script that needs
one piece do not pay for torch and transformers up front.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

from moe_attrib.version import __version__

if TYPE_CHECKING:  # the same names, for type checkers and editors
    from moe_attrib.collect.collector import GradientCollector, PerExampleGradients, per_example_gradients
    from moe_attrib.collect.graphs import GraphedCollector
    from moe_attrib.curvature.ekfac import EKFAC, fit_ekfac, load_ekfac
    from moe_attrib.curvature.ihvp import RefinedQueries, RefineError, refine_queries
    from moe_attrib.data import DataError, Example, load_examples
    from moe_attrib.indexing.index import Index, IndexFileError, load_index
    from moe_attrib.model.discovery import CoverageReport, discover
    from moe_attrib.model.experts import ExpertLinear, LayoutError, expand_moe, restore_moe, track_moe_experts
    from moe_attrib.scoring.balance import Balance, fit_balance
    from moe_attrib.scoring.coupling import Coupling, fit_coupling
    from moe_attrib.scoring.score import (
        ScoreError,
        Scores,
        precondition_queries,
        prepare_queries,
        query_gradients,
        score,
        score_matrix,
    )
    from moe_attrib.settings import (
        CollectSettings,
        DataSettings,
        EkfacSettings,
        IndexSettings,
        RefineSettings,
        ScoreSettings,
        SettingsVersionError,
    )
    from moe_attrib.workflows.attribution import (
        QueryReading,
        ScoredQueries,
        build_from_files,
        fit_from_files,
        score_queries,
    )
    from moe_attrib.workflows.build import build_index
    from moe_attrib.workflows.ensemble import EnsembleError, RunScores, score_run
    from moe_attrib.workflows.trainer import AttributionCallback, AttributionCheckpointer

__all__ = [
    "CollectSettings",
    "DataSettings",
    "EkfacSettings",
    "IndexSettings",
    "RefineSettings",
    "ScoreSettings",
    "SettingsVersionError",
    "QueryReading",
    "ScoredQueries",
    "build_from_files",
    "fit_from_files",
    "score_queries",
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
    "moe_attrib.scoring.balance": "Balance fit_balance",
    "moe_attrib.workflows.build": "build_index",
    "moe_attrib.collect.collector": "GradientCollector PerExampleGradients per_example_gradients",
    "moe_attrib.scoring.coupling": "Coupling fit_coupling",
    "moe_attrib.data": "DataError Example load_examples",
    "moe_attrib.model.discovery": "CoverageReport discover",
    "moe_attrib.curvature.ekfac": "EKFAC fit_ekfac load_ekfac",
    "moe_attrib.workflows.ensemble": "EnsembleError RunScores score_run",
    "moe_attrib.model.experts": "ExpertLinear LayoutError expand_moe restore_moe track_moe_experts",
    "moe_attrib.collect.graphs": "GraphedCollector",
    "moe_attrib.curvature.ihvp": "RefinedQueries RefineError refine_queries",
    "moe_attrib.indexing.index": "Index IndexFileError load_index",
    "moe_attrib.scoring.score": (
        "ScoreError Scores precondition_queries prepare_queries query_gradients score score_matrix"
    ),
    "moe_attrib.workflows.trainer": "AttributionCallback AttributionCheckpointer",
    "moe_attrib.settings": (
        "CollectSettings DataSettings EkfacSettings IndexSettings RefineSettings ScoreSettings SettingsVersionError"
    ),
    "moe_attrib.workflows.attribution": "QueryReading ScoredQueries build_from_files fit_from_files score_queries",
}
_HOME = {name: module for module, names in _MODULES.items() for name in names.split()}


def __getattr__(name: str) -> object:
    """A public name, imported from its module on first use; else a subpackage or module (`moe_attrib.scoring`).
    `__main__` is no attribute: importing it runs the command."""
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
