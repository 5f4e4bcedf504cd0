"""moe-attrib: per-example gradient attribution for Mixture-of-Experts language models."""

from moe_attrib.build import build_index
from moe_attrib.collector import GradientCollector, PerExampleGradients, per_example_gradients
from moe_attrib.discovery import CoverageReport, discover
from moe_attrib.ekfac import EKFAC, fit_ekfac, load_ekfac
from moe_attrib.experts import ExpertLinear, LayoutError, expand_moe, restore_moe, track_moe_experts
from moe_attrib.index import Index, IndexFileError, load_index
from moe_attrib.version import __version__

__all__ = [
    "CoverageReport",
    "EKFAC",
    "ExpertLinear",
    "GradientCollector",
    "Index",
    "IndexFileError",
    "LayoutError",
    "PerExampleGradients",
    "__version__",
    "build_index",
    "discover",
    "expand_moe",
    "fit_ekfac",
    "load_ekfac",
    "load_index",
    "per_example_gradients",
    "restore_moe",
    "track_moe_experts",
]
