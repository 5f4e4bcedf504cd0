"""Indexes and EK-FAC factors written by moe-attrib 0.1.0 (before typed settings) load and score
with the current code to the results recorded then (`tests/data/legacy-index-0.1.0/README.md`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from moe_attrib.app.cli import main

LEGACY = Path(__file__).parent / "data" / "legacy-index-0.1.0"
CASES = {  # expected file -> the score command's arguments (beyond the index, model and queries)
    "expected-index.jsonl": ("index", []),
    "expected-index-ekfac.jsonl": ("index", ["--ekfac", str(LEGACY / "ekfac"), "--per_module"]),
    "expected-index-tokens.jsonl": ("index-tokens", []),
    "expected-index-experts.jsonl": ("index-experts", []),
}


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def same(got, want, path: str = "") -> None:
    """Equal records, floats to 1e-5 relative (the same arithmetic on another CPU)."""
    if isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7), path
    elif isinstance(want, dict):
        assert sorted(got) == sorted(want), path
        for k in want:
            same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for n, (g, w) in enumerate(zip(got, want, strict=True)):
            same(g, w, f"{path}[{n}]")
    else:
        assert got == want, path


@pytest.mark.parametrize("expected", sorted(CASES))
def test_legacy_index_scores_as_recorded(expected, tmp_path):
    index, extra = CASES[expected]
    out = tmp_path / "scores.jsonl"
    argv = ["score", "--index", str(LEGACY / index), "tiny:mixtral", str(LEGACY / "queries.jsonl"), "--no_texts",
            "--top_k", "3", "--device", "cpu", "--out", str(out), *extra]  # fmt: skip
    assert main(argv) == 0
    same(read(out), read(LEGACY / expected))


@pytest.mark.parametrize("what", ["index", "ekfac"])
def test_settings_from_a_future_version_are_refused(what, tmp_path):
    from moe_attrib.curvature.ekfac import load_ekfac
    from moe_attrib.indexing.index import load_index
    from moe_attrib.settings import SettingsVersionError

    copy = tmp_path / what
    shutil.copytree(LEGACY / what, copy)
    described = copy / ("manifest.json" if what == "index" else "ekfac.json")
    info = json.loads(described.read_text())
    info["settings_version"] = 99
    described.write_text(json.dumps(info))
    with pytest.raises(SettingsVersionError, match=r"settings version 99, newer .* upgrade moe-attrib"):
        (load_index if what == "index" else load_ekfac)(copy)


def test_build_and_ekfac_write_what_0_1_0_wrote(tmp_path):
    """The same commands give the same rows, factors and manifest (only `settings_version` and `output_projection_dim`,
    None, are new); `--damping 1.0 --damping_scope model`
    is 0.1.0's default, named since the default changed (CHANGELOG.md)."""
    import numpy as np
    from safetensors.numpy import load_file

    train = str(LEGACY / "train.jsonl")
    common = ["tiny:mixtral", train, "--quiet", "--device", "cpu"]
    assert main(["build", *common, "--index", str(tmp_path / "index"), "--projection_dim", "4"]) == 0
    ekfac = ["ekfac", *common, "--out", str(tmp_path / "ekfac"), "--index", str(tmp_path / "index")]
    assert main([*ekfac, "--damping", "1.0", "--damping_scope", "model"]) == 0

    def close(got, want, err_msg=""):
        # float32 rounding differs between CPUs (the kernels' vector widths and blocking): entries near 0 get an
        # absolute tolerance of 1e-6 x the array's largest entry (rows went 2e-6 apart on 7.3 between two CPUs)
        scale = float(np.abs(want).max()) if want.size else 0.0
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * scale, err_msg=err_msg)

    for name in ("gradients.npy", "losses.npy", "expert_counts.npy"):
        close(np.load(tmp_path / "index" / name), np.load(LEGACY / "index" / name), name)
    new, old = (
        load_file(tmp_path / "ekfac" / "factors.safetensors"),
        load_file(LEGACY / "ekfac" / "factors.safetensors"),
    )
    assert sorted(new) == sorted(old)
    for key in old:
        close(new[key], old[key], key)
    for path in ("index/manifest.json", "ekfac/ekfac.json"):
        got, want = json.loads((tmp_path / path).read_text()), json.loads((LEGACY / path).read_text())
        assert got.pop("settings_version") == 1
        assert got["settings"].pop("output_projection_dim") is None  # new since: the output layer projected like all
        assert got["settings"].pop("data") == str(Path(train).resolve())  # recorded where it was built
        want["settings"].pop("data")
        assert got == want, path


def test_score_queries_from_python_gives_the_recorded_records():
    """The Python pipeline (`moe_attrib.workflows.attribution.score_queries`) is the command: the same records."""
    from moe_attrib.settings import ScoreSettings
    from moe_attrib.workflows.attribution import QueryReading, score_queries

    done = score_queries(
        LEGACY / "index", "tiny:mixtral", str(LEGACY / "queries.jsonl"), ScoreSettings(top_k=3, per_module=True),
        ekfac=str(LEGACY / "ekfac"), reading=QueryReading(texts=False), device="cpu", progress=False,
    )  # fmt: skip
    same(done.records, read(LEGACY / "expected-index-ekfac.jsonl"))
    assert done.coupling is not None and done.balance is not None


def test_build_without_projection_flags_projects_to_the_default(tmp_path):
    """No projection flag: an eigenbasis index whose factors the build fitted (sketch 128, bfloat16 rows), no
    longer 0.1.0's p = 32; a seeded flag (--expert_blocks sum) without --projection_dim: p = DEFAULT_PROJECTION_DIM
    (32), as 0.1.0 built; --no_projection: exact rows."""
    from moe_attrib.indexing.index import load_index

    train = str(LEGACY / "train.jsonl")
    assert main(["build", "tiny:mixtral", train, "--index", str(tmp_path / "a"), "--quiet", "--device", "cpu"]) == 0
    a = load_index(tmp_path / "a")
    assert "eigenbasis" in a.manifest["settings"] and a.settings.collect.projection_dim == 128 and a.dtype == "bfloat16"
    seeded = ["--expert_blocks", "sum"]
    assert (
        main(["build", "tiny:mixtral", train, "--index", str(tmp_path / "c"), "--quiet", "--device", "cpu", *seeded])
        == 0
    )
    c = load_index(tmp_path / "c")
    assert c.settings.collect.projection_dim == 32 and c.dtype == "float32"
    exact = ["--no_projection", "--filter_modules", "lm_head"]
    assert (
        main(["build", "tiny:mixtral", train, "--index", str(tmp_path / "b"), "--quiet", "--device", "cpu", *exact])
        == 0
    )
    assert load_index(tmp_path / "b").settings.collect.projection_dim is None
