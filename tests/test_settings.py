"""Typed settings (`moe_attrib.settings`): the command lines generated from them are 0.1.0's, their
defaults are the functions' and flags' of 0.1.0, and they load back from what they store."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import sys
from pathlib import Path

import pytest

from moe_attrib.app.cli import build_parser
from moe_attrib.settings import (
    CollectSettings,
    DataSettings,
    EkfacSettings,
    IndexSettings,
    RefineSettings,
    ScoreSettings,
    resolve,
)

HELP = Path(__file__).parent / "data" / "help-0.1.0"
CHANGED_DEFAULTS = {  # command: [(0.1.0's help text, today's)]
    "ekfac": [
        ("over --damping_scope (default: 1.0)", "over --damping_scope (default: 0.1)"),
        ("or the whole model (default: model)", "or the whole model (default: module)"),
        (
            "p x p (default 32, or the index's)",
            "p x p (default: the index's; without --index 128, the sketch of\n"
            "                        factors for eigenbasis builds: docs/build.md)",
        ),
    ],
    "build": [  # build's default became the eigenbasis index: bfloat16 rows, its factors fitted by the build
        (
            "docs/build.md) (default: float32)",
            "docs/build.md); default bfloat16 for an eigenbasis index, float32 for seeded projections",
        ),
        (
            "EK-FAC factors (moe-attrib ekfac --out DIR): store rows in their eigenbasis, columns allocated\n"
            "                        by --budget; the factors' sketch replaces --projection_dim/--seed "
            "(docs/build.md)\n"
            "  --budget BUDGET       bytes per example of an eigenbasis index (--ekfac), e.g. 256KiB or 1MiB (default "
            "1MiB; best\n                        with --index_dtype bfloat16: docs/build.md)",
            "EK-FAC factors fitted already (moe-attrib ekfac --out DIR): rows in their eigenbasis, not\n"
            "                        fitted again (default: fitted by this build, at --projection_dim 128 "
            "--output_projection_dim\n                        1024; docs/build.md)\n"
            "  --budget BUDGET       bytes per example of an eigenbasis index, e.g. 256KiB or 1MiB (default 1MiB: "
            "docs/build.md)",
        ),
    ],
}
ADDED_FLAGS = {  # command: flags added since 0.1.0 (each in CHANGELOG.md)
    "build": ["--output_projection_dim"],
    "ekfac": ["--output_projection_dim"],
}


def command_parser(command: str) -> argparse.ArgumentParser:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[command]


@pytest.mark.parametrize("command", ["build", "ekfac", "score"])
def test_help_is_0_1_0s(command, capsys, monkeypatch):
    """Every flag, default and help line as 0.1.0 printed them (tests/data/help-0.1.0, COLUMNS=120), but for the
    defaults changed since (`CHANGED_DEFAULTS`) and the flags added since (`ADDED_FLAGS`, left out of the
    comparison: each is there), each in CHANGELOG.md."""
    monkeypatch.setenv("COLUMNS", "120")
    parser = command_parser(command)
    added = [a for a in parser._actions if set(a.option_strings) & set(ADDED_FLAGS.get(command, []))]
    assert len(added) == len(ADDED_FLAGS.get(command, []))
    for action in added:
        monkeypatch.setattr(action, "help", argparse.SUPPRESS)
    with pytest.raises(SystemExit):
        parser.parse_args(["-h"])
    expected = (HELP / f"{command}.txt").read_text()
    for before, after in CHANGED_DEFAULTS.get(command, []):
        assert before in expected
        expected = expected.replace(before, after)
    assert capsys.readouterr().out == expected


def test_settings_module_needs_only_the_standard_library():
    """`moe-attrib --help` builds its parser from settings.py: it (and errors.py) import no torch."""
    package = Path(__file__).parent.parent / "moe_attrib"
    for name in ("settings.py", "errors.py"):
        for node in ast.walk(ast.parse((package / name).read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                for module in modules:
                    top = module.split(".")[0]
                    assert top in sys.stdlib_module_names or module == "moe_attrib.errors", (name, module)


def test_importing_the_settings_loads_no_torch():
    import subprocess

    code = "import sys, moe_attrib.settings; print(sorted({'torch', 'transformers', 'numpy'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_flags_give_0_1_0s_defaults():
    """The settings a bare command line gives are the values 0.1.0's commands passed on."""
    build = parse("build", "m", "d", "--index", "i")
    assert build.index_dtype is None  # resolved by `build`: bfloat16 for its default eigenbasis index
    build.index_dtype = "float32"
    assert CollectSettings.from_args(build, projection_dim=32) == CollectSettings(track_moe_experts=False)
    assert DataSettings.from_args(build) == DataSettings()
    ekfac = parse("ekfac", "m", "d", "--out", "o")
    assert EkfacSettings.from_args(ekfac) == EkfacSettings()
    assert EkfacSettings() == EkfacSettings(damping=0.1, damping_scope="module", sampled_labels=True, fold_bias=True)
    score = parse("score", "--index", "i", "m", "q", "--out", "o")
    assert ScoreSettings.from_args(score) == ScoreSettings()
    assert ScoreSettings().coupling == {"gamma": 30.0, "rank": 64, "sample": 512} and ScoreSettings().balanced
    assert RefineSettings.from_args(score).iterations == 0  # --refine is off unless asked


def test_flags_map_onto_fields():
    build = parse("build", "m", "d", "--index", "i", "--recompute_layers", "--cuda_graphs", "--attribute_tokens",
                  "--expert_blocks", "sum", "--token_batch_size", "64", "--track_moe_experts")  # fmt: skip
    st = CollectSettings.from_args(build)
    assert (st.recompute, st.cuda_graphs, st.attribute_tokens, st.expert_blocks) == (True, True, True, "sum")
    assert (st.token_batch_size, st.track_moe_experts) == (64, True)
    assert (
        CollectSettings.from_args(parse("build", "m", "d", "--index", "i", "--cuda_graphs", "off")).cuda_graphs is False
    )
    ekfac = parse("ekfac", "m", "d", "--out", "o", "--empirical_fisher", "--no_fold_bias", "--max_factor_memory", "2")
    ek = EkfacSettings.from_args(ekfac)
    assert (ek.sampled_labels, ek.fold_bias, ek.max_memory_gib) == (False, False, 2.0)
    score = parse("score", "--index", "i", "m", "q", "--out", "o", "--coupling_gamma", "0", "--modules", "lm_head.*",
                  "--refine", "3", "--refine_damping", "0.5", "--damping", "0.1")  # fmt: skip
    sc, refine = ScoreSettings.from_args(score), RefineSettings.from_args(score)
    assert sc.coupling is None and not sc.balanced and sc.damping == 0.1
    assert (refine.iterations, refine.damping, refine.examples) == (3, 0.5, None)


@pytest.mark.parametrize("kind", [CollectSettings, DataSettings, EkfacSettings, ScoreSettings, RefineSettings])
def test_to_dict_loads_back(kind):
    changed = {f.name: f"x{f.name}" for f in dataclasses.fields(kind)}
    st = kind(**changed)
    assert kind.from_dict({**st.to_dict(), "unrelated": 1}) == st
    assert kind.from_dict({}) == kind()


def test_a_manifest_loads_into_collection_settings():
    import json

    manifest = json.loads((Path(__file__).parent / "data/legacy-index-0.1.0/index-tokens/manifest.json").read_text())
    st = IndexSettings.from_dict(manifest["settings"]).collect
    assert st.attribute_tokens and st.projection_dim == 4 and st.seed == 0 and not st.track_moe_experts
    recorded = st.recorded()
    assert recorded.pop("output_projection_dim") is None  # added since: the output layer projected like every block
    assert recorded.items() <= manifest["settings"].items()


def test_keyword_shortcuts_and_their_errors():
    (st,) = resolve("build_index", {"projection_dim": 8}, None, kinds=(CollectSettings,))
    assert st == CollectSettings(projection_dim=8)
    ek, co = resolve("fit_ekfac", {"damping": 0.1, "seed": 3}, EkfacSettings(fold_bias=False), None,
                     kinds=(EkfacSettings, CollectSettings))  # fmt: skip
    assert ek == EkfacSettings(damping=0.1, fold_bias=False) and co == CollectSettings(seed=3)
    with pytest.raises(TypeError, match=r"build_index\(\) got unknown settings \['projection_dimm'\]"):
        resolve("build_index", {"projection_dimm": 8}, None, kinds=(CollectSettings,))
    with pytest.raises(TypeError, match="expected CollectSettings, got ScoreSettings"):
        resolve("build_index", {}, ScoreSettings(), kinds=(CollectSettings,))


def test_settings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CollectSettings().seed = 1


def test_index_settings_read_a_manifest_and_store_it_back():
    """`Index.settings`: the manifest's flat dict, typed, and the same dict again from `to_dict`; keys an
    older manifest lacks mean what they meant then."""
    import json

    from moe_attrib.indexing.index import load_index
    from moe_attrib.settings import LEGACY_PROJECTION, IndexSettings

    legacy = Path(__file__).parent / "data/legacy-index-0.1.0"
    index = load_index(legacy / "index-experts")
    st = index.settings
    assert (
        st.collect.track_moe_experts
        and st.collect.projection_dim == 4
        and st.collect.projection == "rademacher-hash-v2"
    )
    assert st.model == "tiny:mixtral" and st.dtype == "torch.float32" and st.torch_dtype_name == "float32"
    recorded = json.loads((legacy / "index-experts/manifest.json").read_text())["settings"]
    stored = st.to_dict()
    assert {k: stored[k] for k in recorded} == recorded
    old = IndexSettings.from_dict({"projection_dim": 8, "seed": 1, "projection": None})
    assert old.collect.projection == LEGACY_PROJECTION and not old.collect.track_moe_experts
    assert old.collect.index_dtype == "float32"
