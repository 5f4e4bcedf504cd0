"""One error base and one exit-code mapping: every error class of the package is a `MoeAttribError` and
keeps the builtin base it had, and `moe-attrib` ends each way as it did before the base existed
(the codes, lines and tracebacks below were recorded from `cli.main()` at 3911cc1)."""

import contextlib
import errno
import importlib
import inspect
import io
import pkgutil

import moe_attrib
from moe_attrib.app import cli
from moe_attrib.errors import MoeAttribError, error_text, exit_code

# Every error class at 3911cc1 with the builtin (or project) base it had then; callers that catch those keep working.
RECORDED = {
    "moe_attrib.workflows.build.NonFiniteGradientError": ValueError,
    "moe_attrib.workflows.checks.UsageError": ValueError,
    "moe_attrib.data.DataError": ValueError,
    "moe_attrib.app.demo.DemoError": ValueError,
    "moe_attrib.curvature.eigenbasis.EigenbasisError": ValueError,
    "moe_attrib.curvature.ekfac.FactorMemoryError": MemoryError,
    "moe_attrib.workflows.ensemble.EnsembleError": ValueError,
    "moe_attrib.fingerprint.FingerprintError": ValueError,
    "moe_attrib.curvature.ihvp.RefineError": ValueError,  # a ScoreError
    "moe_attrib.indexing.index.IndexDtypeError": ValueError,
    "moe_attrib.indexing.index.IndexFileError": RuntimeError,
    "moe_attrib.app.info.InfoError": ValueError,
    "moe_attrib.model.layouts.errors.LayoutError": ValueError,
    "moe_attrib.collect.normalizers.OptimizerStateError": ValueError,
    "moe_attrib.outputs.OutputError": ValueError,
    "moe_attrib.curvature.precondition.ScoreError": ValueError,
    "moe_attrib.scoring.results.ResultsError": ValueError,
    "moe_attrib.model.sharding.ShardingError": ValueError,
    "moe_attrib.workflows.trainer.TrainerAttributionError": ValueError,
}


def package_exceptions() -> dict[str, type[BaseException]]:
    """Every exception class defined in a module of the package, by `module.Name` (imports each module)."""
    found = {}
    for info in pkgutil.walk_packages(moe_attrib.__path__, prefix="moe_attrib."):
        if info.name == "moe_attrib.__main__":  # running it is running the command
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == info.name:
                found[f"{info.name}.{name}"] = obj
    return found


def test_every_error_class_derives_from_the_base_and_keeps_its_builtin_base():
    found = package_exceptions()
    assert set(RECORDED) <= set(found), set(RECORDED) - set(found)  # the walk sees every module
    for name, cls in found.items():
        assert cls is MoeAttribError or issubclass(cls, MoeAttribError), f"{name} does not derive from MoeAttribError"
        assert not issubclass(cls, Warning), name
    for name, base in RECORDED.items():
        assert issubclass(found[name], base), f"{name} lost its base {base.__name__}"
    assert issubclass(
        found["moe_attrib.curvature.ihvp.RefineError"], found["moe_attrib.curvature.precondition.ScoreError"]
    )


def test_exit_codes_are_the_ones_main_returned():
    for cls in package_exceptions().values():
        assert exit_code(cls("x")) == 2, cls
    assert exit_code(KeyboardInterrupt()) == 130
    assert exit_code(BrokenPipeError(errno.EPIPE, "Broken pipe")) == 141
    missing = FileNotFoundError(errno.ENOENT, "No such file or directory", "/x/y")
    for err in (missing, PermissionError("no"), OSError()):
        assert exit_code(err) == 2, err
    for bug in (ValueError("v"), RuntimeError("r"), MemoryError(), TypeError(), KeyError("k"), SystemExit(3)):
        assert exit_code(bug) is None, bug  # a bug: the traceback shows
    assert error_text(missing) == "/x/y: No such file or directory"
    assert error_text(PermissionError("no")) == "no" and error_text(MoeAttribError("fix --top")) == "fix --top"


def failing_show(monkeypatch, err: BaseException):
    """`moe-attrib show x.jsonl` in this process with `cmd_show` raising `err`: (status, stderr), or the exception
    that escaped `main()`."""

    def boom(args):
        raise err

    monkeypatch.setattr(cli, "cmd_show", boom)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            return cli.main(["show", "x.jsonl"]), stderr.getvalue()
        except BaseException as escaped:  # what escaped is the result
            return escaped, stderr.getvalue()


def test_main_prints_one_line_and_the_recorded_status(monkeypatch):
    monkeypatch.delenv("MOE_ATTRIB_TRACEBACK", raising=False)
    # as recorded, except EigenbasisError, ShardingError and TrainerAttributionError: they escaped main() then
    for name, cls in package_exceptions().items():
        assert failing_show(monkeypatch, cls("what to do")) == (2, "moe-attrib show: error: what to do\n"), name
    missing = FileNotFoundError(errno.ENOENT, "No such file or directory", "/x/y")
    assert failing_show(monkeypatch, missing) == (2, "moe-attrib show: error: /x/y: No such file or directory\n")
    interrupted = "\nmoe-attrib show: interrupted; files it writes are left as they were.\n"
    assert failing_show(monkeypatch, KeyboardInterrupt()) == (130, interrupted)
    for bug in (ValueError("v"), RuntimeError("r"), MemoryError("m")):
        escaped, stderr = failing_show(monkeypatch, bug)
        assert escaped is bug and stderr == ""


def test_traceback_variable_lets_errors_escape(monkeypatch):
    monkeypatch.setenv("MOE_ATTRIB_TRACEBACK", "1")
    for err in (MoeAttribError("m"), KeyboardInterrupt(), FileNotFoundError(errno.ENOENT, "gone", "f")):
        assert failing_show(monkeypatch, err) == (err, "")
