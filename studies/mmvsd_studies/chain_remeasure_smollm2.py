"""Re-measure the SmolLM2 study's chain metrics on the drafters that survive (the shipped start and seed-0 arms):
the unbiased sampled-chain estimate beside the teacher-forced product, same prompts, continuations and depth.

    python -m mmvsd_studies.chain_remeasure_smollm2 studies/results/chain_remeasure_smollm2.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from mmvsd.drafters.spec import neural_drafter_from_spec
from mmvsd.eval.acceptance import expected_acceptance
from mmvsd.target_loader import load_target
from mmvsd_studies import RESULTS_DIR
from mmvsd_studies import vsd_study as vs

DRAFTERS = ("eagle3-ce", "eagle3-accept", "eagle3-vsd")  # SmolLM2's shipped drafters, by their shipped names


def main(argv: list[str] | None = None) -> int:
    out_path = Path((sys.argv[1:] if argv is None else argv)[0])
    study = json.loads((RESULTS_DIR / "vsd_power_smollm2.json").read_text())
    cfg = study["config"]
    target = load_target(cfg["target"])
    sets = vs.load_prompt_sets(target, cfg["eval_prompts"].split(","), cfg["eval_limit"], cfg["max_new_tokens"],
                               sample_seed=cfg["eval_seed"])
    out = {"config": {k: cfg[k] for k in ("target", "eval_prompts", "eval_limit", "max_new_tokens", "accept_depth",
                                          "eval_seed")}, "drafters": {}}
    for name in DRAFTERS:
        start = time.time()
        drafter = neural_drafter_from_spec(name, target).eval()
        out["drafters"][name] = {}
        for ps in sets:
            chains = expected_acceptance(target, drafter, ps.prompts, ps.sampled, cfg["accept_depth"])
            out["drafters"][name][ps.name] = {"chain": [c.total for c in chains],
                                              "forced": [c.forced_total for c in chains],
                                              "anchors": [c.anchors for c in chains]}
        print(name, f"{time.time() - start:.0f} s", flush=True)
    out_path.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
