"""Registry of fused-experts layouts: detection, collection forwards, parameter enumeration.

Importing the package registers the built-in families (`routed`: the experts contract and
zero-compute experts; `prerouted`: llama4). Add a family with `@register_layout`.
"""

from moe_attrib.model.layouts import prerouted, routed  # noqa: F401  (registers the built-in families)
from moe_attrib.model.layouts.base import (
    ExpertsLayout,
    LayoutFamily,
    RoutedRows,
    RowSink,
    experts_layout,
    looks_like_experts,
    null_sink,
    register_layout,
    registered_families,
)
from moe_attrib.model.layouts.errors import LayoutError
from moe_attrib.model.layouts.kernels import Kernels, is_out_of_memory

__all__ = [
    "ExpertsLayout",
    "Kernels",
    "LayoutError",
    "LayoutFamily",
    "RoutedRows",
    "RowSink",
    "experts_layout",
    "is_out_of_memory",
    "looks_like_experts",
    "null_sink",
    "register_layout",
    "registered_families",
]
