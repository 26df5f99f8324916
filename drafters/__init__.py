"""Drafter architectures, one file each; importing this package registers them."""

from mmvsd.drafters import eagle3  # noqa: F401
