"""Plots of a suite result into docs/benchmarks/: `python benchmarks/plot.py benchmarks/results/suite-h200.json`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(path: str, out: str = "docs/benchmarks") -> None:
    data = json.loads(Path(path).read_text())
    sweep = data["sweep"]
    Path(out).mkdir(parents=True, exist_ok=True)

    experts = [r for r in sweep if r["tokens"] == 4096 and r["projection_dim"] == 16]
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["experts"] for r in experts]
    ax.plot(xs, [r["time_ratio"] for r in experts], "o-", label="moe-attrib (grouped)")
    ax.plot(xs, [r["loop_ratio"] for r in experts], "s--", label="per-expert Python loop")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="experts (top-8)", ylabel="collection / plain fwd+bwd step",
           title="4 layers, 8x512 tokens, p=16, H200 bf16")  # fmt: skip
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.legend()
    fig.tight_layout()
    fig.savefig(f"{out}/ratio_vs_experts.png", dpi=120)

    tokens = sorted((r for r in sweep if r["experts"] == 128 and r["projection_dim"] == 16), key=lambda r: r["tokens"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["tokens"] for r in tokens], [r["time_ratio"] for r in tokens], "o-", label="time")
    ax.plot([r["tokens"] for r in tokens], [r["memory_ratio"] for r in tokens], "s--", label="peak memory")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xscale="log", xlabel="tokens per batch", ylabel="collection / plain step",
           title="128 experts, top-8, p=16 (H200 bf16)")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(f"{out}/ratio_vs_tokens.png", dpi=120)
    print(f"plots written to {out}/")


if __name__ == "__main__":
    main(*sys.argv[1:])
