"""mmvsd's studies: experiments built on mmvsd's public API, installed beside it as a plugin (`pip install -e
./studies`), never imported by mmvsd itself.

What it holds: the CE-vs-VSD studies and their synthetic control (`vsd_study`, `vsd_control`, `control_world`,
`study_stats`, `study_report`), their follow-ups (`vsd_study_vs_start`, `chain_remeasure_smollm2*`,
`learning_curve`), a code-conversation generator (`python_source_conversations`), smol-llava's quality probes
(`smol_llava_quality`, `smol_llava_tower_probe`) and the lab (`mmvsd_studies.lab`: the smol-llava CPU target and its
projector training). Each study runs as `python -m mmvsd_studies.NAME`. mmvsd finds the plugin through its entry
points (studies/pyproject.toml): the target `smol-llava` (`mmvsd.targets`) and the command `mmvsd lab`
(`mmvsd.commands`).
"""

from pathlib import Path

# where the studies write their results by default: studies/results/ of the checkout (an editable install)
RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"
