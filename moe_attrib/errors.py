"""The errors a user can act on, and the exit status of every way a `moe-attrib` command can fail.

Every error class of the package derives from `MoeAttribError` and keeps a builtin base beside it
(`ScoreError(MoeAttribError, ValueError)`), so a caller that catches `ValueError` still catches it.
`moe-attrib`'s `main()` asks `exit_code` how a command ends: a user error (a `MoeAttribError`, or an
`OSError`, whose message names the file) is one line, `moe-attrib <command>: error: <message>`, and
exit status 2; Ctrl-C is 130 and a closed pipe 141, as a shell reports those signals. Anything
else is a bug and keeps its traceback. A leaf module: it imports nothing of the package.
"""

from __future__ import annotations

USER_ERROR = 2  # what argparse exits with for a bad flag too
INTERRUPTED = 130  # 128 + SIGINT
BROKEN_PIPE = 141  # 128 + SIGPIPE
# builtin errors that are the user's to fix: a file missing, unreadable or unwritable (the message names it)
BUILTIN_USER_ERRORS: tuple[type[Exception], ...] = (OSError,)


class MoeAttribError(Exception):
    """An error whose message names the file, row or flag at fault and what to do; no traceback."""

    exit_code = USER_ERROR


def exit_code(err: BaseException) -> int | None:
    """The exit status a command ends with when `err` escapes it: `err.exit_code` for a `MoeAttribError`,
    2 for `BUILTIN_USER_ERRORS`, 130 for Ctrl-C, 141 for a closed pipe; None for a bug (keep the traceback)."""
    if isinstance(err, KeyboardInterrupt):
        return INTERRUPTED
    if isinstance(err, BrokenPipeError):
        return BROKEN_PIPE
    if isinstance(err, MoeAttribError):
        return err.exit_code
    if isinstance(err, BUILTIN_USER_ERRORS):
        return USER_ERROR
    return None


def error_text(err: BaseException) -> str:
    """The one-line message of a user error: its own text, or `FILE: reason` for an `OSError` that names a file
    (its `str()` would repeat the errno)."""
    if isinstance(err, OSError) and err.filename is not None:
        return f"{err.filename}: {err.strerror}"
    return str(err)
