"""The one error type for layouts moe-attrib does not understand (a leaf: imports nothing of the package)."""


class LayoutError(ValueError):
    """An experts-like module, router or linear whose parameter layout or use moe-attrib does not understand."""
