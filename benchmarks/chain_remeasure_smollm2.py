"""Re-measure the SmolLM2 study's chain metrics on the drafters that survive (the shipped start and seed-0 arms):
the unbiased sampled-chain estimate beside the teacher-forced product, same prompts, continuations and depth.

    python benchmarks/chain_remeasure_smollm2.py benchmarks/results/chain_remeasure_smollm2.json
"""
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import vsd_study as vs  # noqa: E402

from mmvsd.drafters.spec import neural_drafter_from_spec  # noqa: E402
from mmvsd.target_loader import load_target  # noqa: E402
from mmvsd.training.acceptance import expected_acceptance  # noqa: E402

study = json.loads((ROOT / "benchmarks/results/vsd_power_smollm2.json").read_text())
cfg = study["config"]
target = load_target(cfg["target"])
sets = vs.load_prompt_sets(target, cfg["eval_prompts"].split(","), cfg["eval_limit"], cfg["max_new_tokens"],
                           sample_seed=cfg["eval_seed"])
out = {"config": {k: cfg[k] for k in ("target", "eval_prompts", "eval_limit", "max_new_tokens", "accept_depth",
                                      "eval_seed")}, "drafters": {}}
root = str(ROOT / "mmvsd/shipped_drafters/smollm2-135m") + "/"
for name in ("eagle3-ce", "eagle3-accept", "eagle3-vsd"):
    start = time.time()
    drafter = neural_drafter_from_spec(root + name, target).eval()
    out["drafters"][name] = {}
    for ps in sets:
        chains = expected_acceptance(target, drafter, ps.prompts, ps.sampled, cfg["accept_depth"])
        out["drafters"][name][ps.name] = {"chain": [c.total for c in chains],
                                          "forced": [c.forced_total for c in chains],
                                          "anchors": [c.anchors for c in chains]}
    print(name, f"{time.time() - start:.0f} s", flush=True)
Path(sys.argv[1]).write_text(json.dumps(out))
