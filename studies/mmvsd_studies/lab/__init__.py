"""The lab: smol-llava's projector training (`mmvsd lab build-target smol-llava`, `mmvsd_studies.lab_cli`), its
question sets and easy-vqa's data.

smol-llava itself is product (`mmvsd.targets`: the target, its tower, its adapters and the shipped projector); the
lab trains the projector that ships there, through mmvsd's public names.
"""
