"""The one base class of the errors a user can act on.

Every command's failure a user can fix (bad input, refused output, mismatched files) is a
`MoeAttribError` (or one of the older classes the CLI lists beside it): `moe-attrib`'s `main()`
prints it as one line, `moe-attrib <command>: error: <message>`, and exits with `exit_code`.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class MoeAttribError(Exception):
    """An error whose message names the file, row or flag at fault and what to do; no traceback."""

    exit_code = 2
