"""moe-attrib: per-example gradient attribution for Mixture-of-Experts language models."""

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
from moe_attrib.version import __version__

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
