"""`lm_head` alone and the whole model under stronger scoring damping, on the eigenbasis default and exact rows.

Per configuration: the eigenbasis index (1 MiB as on Qwen3-30B-A3B, the library's floors) and exact rows, each
scored through `lm_head` alone and whole at 0.01 (the default before session 19) / 0.1 / 1 / 10 x the model-wide
mean eigenvalue, and `lm_head` alone without EK-FAC. It showed that the output layer, left almost undamped by a
model-wide damping, ranks better with more (session 19, docs/quality.md#damping):

    python benchmarks/probes/lm_head_damping.py heldout-qa --cache CACHE
"""

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
import lds  # noqa: E402
import lds_budget  # noqa: E402

import moe_attrib as ma  # noqa: E402


def main() -> None:
    parser = lds.cached_configs_parser(__doc__.splitlines()[0])
    args = parser.parse_args()
    torch.set_num_threads(2)
    for name in args.configs:
        c = lds.load_cached(name, Path(args.cache))
        model = c.model()
        exact = ma.fit_ekfac(model, c.examples, projection_dim=None, progress=False)
        with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as tmpx:
            ek = lds_budget.build_default_index(model, c.examples, tmp, shape="area")
            ma.build_index(model, c.examples, tmpx, progress=False, projection_dim=None)
            for label, path, factors in (("eigenbasis", tmp, ek), ("exact", tmpx, exact)):
                index = ma.load_index(path)
                q = ma.query_gradients(model, c.queries, index)
                out = []
                for damping in (0.01, 0.1, 1.0, 10.0):
                    for modules in ("lm_head.*", None):
                        kw = {"damping": damping, "damping_scope": "model"}
                        kw.update({"modules": modules} if modules else {})
                        s = ma.score_matrix(index, q, ekfac=factors, device="cpu", **kw)
                        value = lds.per_query_lds(np.asarray(s), c.subsets, c.losses).mean()
                        out.append(f"{'lm_head' if modules else 'whole'}@{damping:g}: {value:.3f}")
                s = ma.score_matrix(index, q, ekfac=None, device="cpu", modules="lm_head.*")
                value = lds.per_query_lds(np.asarray(s), c.subsets, c.losses).mean()
                out.append(f"lm_head without EK-FAC: {value:.3f}")
                print(name, label, "; ".join(out), flush=True)


if __name__ == "__main__":
    main()
