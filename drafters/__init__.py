"""Drafter architectures, one file each; importing this package registers them and their layouts."""

from mmvsd.drafters import eagle3, eagle3_layout  # noqa: F401
