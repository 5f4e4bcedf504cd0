"""The `moe-attrib` command, run as users run it."""

import subprocess
import sys


def run(*args):
    return subprocess.run([sys.executable, "-m", "moe_attrib", *args], capture_output=True, text=True, timeout=300)


def test_inspect_with_and_without_tracking():
    off = run("inspect", "tiny:qwen3_moe")
    assert off.returncode == 0, off.stderr
    assert "--track_moe_experts" in off.stderr and "will NOT be attributed" in off.stderr
    on = run("inspect", "tiny:qwen3_moe", "--track_moe_experts")
    assert on.returncode == 0, on.stderr
    assert "NOT be attributed" not in on.stderr
    assert "model.layers.0.mlp.experts: 8 experts" in on.stdout
    pct = float(on.stdout.split("coverage: ")[1].split("%")[0])
    assert pct >= 99.0


def test_inspect_bad_model_is_a_clear_error(tmp_path):
    res = run("inspect", str(tmp_path / "no-such-model"))
    assert res.returncode != 0
    assert "cannot load model" in res.stderr
