"""Kronfluence 1.0.1 side by side with moe-attrib's default, on the cached LDS configurations.

Kronfluence's EK-FAC with its defaults (true Fisher from sampled labels, damping 1e-8, every
`nn.Linear` it finds: attention and `lm_head`; the fused experts are parameters of one module, not
`nn.Linear`s, so it skips them, and the routers with them) scores the same cached full model, the same
queries and training rows with the same loss as `lds.py` (the completion of a prompt/completion row,
every token of a plain-text row; summed over tokens). moe-attrib's default pipeline (p=32 index,
experts tracked, EK-FAC, its current defaults) is scored beside it and the paired bootstrap CI of
the difference is printed per configuration and over the tuning and held-out configurations:

    pip install -e .[bench]     # kronfluence==1.0.1
    python benchmarks/lds_peers.py cpu cpu-shared text-plain ...

Per-query LDS go to `benchmarks/results/lds-peers.npz` (`--out`; `--summary` reprints from it).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import lds  # noqa: E402
from lds_damping import means_by_set  # noqa: E402

import moe_attrib as ma  # noqa: E402
from moe_attrib.data import collate, labels_for  # noqa: E402
from moe_attrib.indexing.index import DEFAULT_PROJECTION_DIM  # noqa: E402

DEFAULT = "moe-attrib default"
KRONFLUENCE = "Kronfluence 1.0.1 EK-FAC, its defaults"
KRONFLUENCE_HEURISTIC = "Kronfluence, damping 0.1 x mean eigenvalue"
# where its defaults fail (an nn.Linear inside the MoE block sees tokens, not examples, as its batch: Qwen2-MoE's
# shared expert and router, GraniteMoE's router), what it tracks on every other family: attention and lm_head
KRONFLUENCE_OUTSIDE_MOE = "Kronfluence 1.0.1 EK-FAC, its defaults but attention + lm_head only (its defaults fail)"
KRONFLUENCE_OUTSIDE_MOE_HEURISTIC = "Kronfluence, attention + lm_head only, damping 0.1 x mean eigenvalue"


class Rows(torch.utils.data.Dataset):
    """Examples as `lds.py` trains on them; `collate` gives ids, mask and next-token labels (-100 where no loss)."""

    def __init__(self, examples):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int):
        return self.examples[i]

    @staticmethod
    def collate(examples: list) -> dict[str, torch.Tensor]:
        positions = list(range(len(examples)))
        ids, mask = collate(examples, positions)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels_for(examples, positions, ids, mask)}


def kronfluence_scores(model, examples, queries, tmp: Path, dampings=(1e-8,), tracked=None) -> list[np.ndarray]:
    """`[Q, N]` Kronfluence pairwise scores with its default factor and score arguments, one per score
    damping (`1e-8`: its default; `None`: its heuristic, 0.1 x the mean eigenvalue)."""
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import ScoreArguments
    from kronfluence.task import Task
    from kronfluence.utils.dataset import DataLoaderKwargs

    class LanguageModelling(Task):
        def get_influence_tracked_modules(self):
            return tracked

        def compute_train_loss(self, batch, model, sample: bool = False) -> torch.Tensor:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            logits, labels = logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten()
            if sample:  # the true Fisher: labels drawn from the model where the data has a loss
                with torch.no_grad():
                    drawn = torch.multinomial(logits.softmax(-1), 1).squeeze(-1)
                labels = torch.where(labels == -100, labels, drawn)
            return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")

        def compute_measurement(self, batch, model) -> torch.Tensor:
            return self.compute_train_loss(batch, model, sample=False)

        def get_attention_mask(self, batch):
            return batch["attention_mask"]

    task = LanguageModelling()
    model = prepare_model(model, task)
    analyzer = Analyzer("lds", model, task, cpu=True, disable_tqdm=True, output_dir=str(tmp))
    train, query = Rows(examples), Rows(queries)
    analyzer.set_dataloader_kwargs(DataLoaderKwargs(collate_fn=Rows.collate))
    analyzer.fit_all_factors("ekfac", dataset=train, per_device_batch_size=16)
    out = []
    for i, damping in enumerate(dampings):
        analyzer.compute_pairwise_scores(f"scores{i}", "ekfac", query_dataset=query, train_dataset=train,
                                         per_device_query_batch_size=16, per_device_train_batch_size=32,
                                         score_args=ScoreArguments(damping_factor=damping))  # fmt: skip
        out.append(analyzer.load_pairwise_scores(f"scores{i}")["all_modules"].double().numpy())
    return out


def run(name: str, root: Path) -> dict[str, np.ndarray]:
    cached = lds.load_cached(name, root)
    out: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = cached.model()
        p = DEFAULT_PROJECTION_DIM
        ma.build_index(model, cached.examples, Path(tmp) / "index", projection_dim=p, progress=False)
        index = ma.load_index(Path(tmp) / "index")
        q = ma.query_gradients(model, cached.queries, index)
        ek = ma.fit_ekfac(model, cached.examples, projection_dim=p, progress=False)
        out[DEFAULT] = lds.per_query_lds(ma.score_matrix(index, q, ekfac=ek), cached.subsets, cached.losses)
        labels = (KRONFLUENCE, KRONFLUENCE_HEURISTIC)
        try:
            scores = kronfluence_scores(cached.model(), cached.examples, cached.queries, Path(tmp) / "kf", (1e-8, None))
        except RuntimeError as err:  # its defaults cannot run on this family: say so, then track what it can
            print(f"  {name}: Kronfluence 1.0.1 with its defaults fails: {str(err)[:200]}")
            kept = linears_outside_moe(model)
            print(f"  {name}: tracking {len(kept)} nn.Linear modules outside the MoE blocks instead")
            labels = (KRONFLUENCE_OUTSIDE_MOE, KRONFLUENCE_OUTSIDE_MOE_HEURISTIC)
            scores = kronfluence_scores(cached.model(), cached.examples, cached.queries, Path(tmp) / "kf2",
                                        (1e-8, None), tracked=kept)  # fmt: skip
        for label, s in zip(labels, scores, strict=True):
            out[label] = lds.per_query_lds(s, cached.subsets, cached.losses)
    lds.print_variants(cached.title, out, cached.domains, "default", 40)
    return out


def linears_outside_moe(model) -> list[str]:
    """The `nn.Linear` modules not under a sparse MoE block (the parent of a discovered experts module)."""
    blocks = [e.name.rsplit(".", 1)[0] + "." for e in ma.discover(model, track_moe_experts=True, warn=False).experts]
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    return [n for n in linear if not any(n.startswith(b) for b in blocks)]


def main() -> None:
    parser = lds.cached_configs_parser(__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(lds.ROOT / "benchmarks" / "results" / "lds-peers.npz"))
    parser.add_argument("--summary", action="store_true", help="only the means, from --out")
    args = parser.parse_args()
    torch.set_num_threads(2)
    configs = [] if args.summary else args.configs
    per_config = lds.accumulate(Path(args.out), configs, lambda name: run(name, Path(args.cache)))
    sets = (("tuning", lds.TUNING), ("held out", lds.HELDOUT + ("cpu-heldout", "cpu-heldout2")))
    means_by_set(per_config, args.configs, sets, DEFAULT)


if __name__ == "__main__":
    main()
