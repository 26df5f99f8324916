"""Drafter architectures, one file each; importing this package registers them and their layouts."""

from mmvsd.drafters import eagle1_layout, eagle3, eagle3_layout, msd, vispec  # noqa: F401
