"""Built-in modality adapters, one file each; importing this package registers them."""

from mmvsd.adapters import llava, text  # noqa: F401
