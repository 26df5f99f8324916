"""The built-in proposers, one file each, behind the core's interfaces (`mmvsd.decoding.proposer.Proposer`,
`mmvsd.drafter_base.Drafter`): the neural architectures EAGLE-3 (`eagle3.py`), MSD and ViSpec (`msd.py`,
`vispec.py`, on the EAGLE-1 layers of `eagle1.py`), the n-gram lookup (`ngram.py`) and the hybrid of a neural
drafter with n-gram branches (`hybrid.py`), a draft model (`draft_model.py`: a smaller LM with the target's
tokenizer); their released checkpoint layouts (`*_layout.py`) and llama.cpp's GGUF file (`eagle3_gguf.py`); and what
`--drafter` names (`spec.py`).

Importing this package registers the architectures and layouts into the core's registries
(`mmvsd.drafter_base.DRAFTERS`, `mmvsd.layouts.registry.LAYOUTS`); the core imports it as a plugin
(pyproject's `mmvsd.plugins` entry points), never by name. A new architecture is a file here plus its
registration below.
"""

from __future__ import annotations

from mmvsd.drafter_base import register_drafter
from mmvsd.drafters.eagle1_layout import MSDLayout, ViSpecLayout
from mmvsd.drafters.eagle3 import Eagle3Drafter
from mmvsd.drafters.eagle3_gguf import Eagle3GGUFLayout
from mmvsd.drafters.eagle3_layout import Eagle3Layout, SpeculatorsLayout
from mmvsd.drafters.msd import MSDDrafter
from mmvsd.drafters.vispec import ViSpecDrafter
from mmvsd.layouts.registry import register_layout

for _architecture in (Eagle3Drafter, MSDDrafter, ViSpecDrafter):
    register_drafter(_architecture)
for _layout in (Eagle3Layout(), SpeculatorsLayout(), Eagle3GGUFLayout(), MSDLayout(), ViSpecLayout()):
    register_layout(_layout)
