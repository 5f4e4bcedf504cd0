"""The one error type for layouts moe-attrib does not understand (imports only the leaf `moe_attrib.errors`)."""

from moe_attrib.errors import MoeAttribError


class LayoutError(MoeAttribError, ValueError):
    """An experts-like module, router or linear whose parameter layout or use moe-attrib does not understand."""
