"""The engines mmvsd decodes with, one file each, registered into `mmvsd.decoding.engines` when this plugin package
is imported (entry point `mmvsd.plugins`): `mmvsd_loop.py` mmvsd's own loop, `llamacpp.py` llama.cpp's server (its
subprocess `llamacpp_server.py`, bench rows `llamacpp_bench.py`, `--chain auto` `llamacpp_plan.py`, regeneration
answers `llamacpp_answers.py`).

The top layer: an engine may import everything below it (the bench's methods in `mmvsd.eval`); nothing imports
this package but the plugin loader, so the commands find engines by name only (docs/architecture.md).
"""

from mmvsd.engines import llamacpp, mmvsd_loop

__all__ = ["llamacpp", "mmvsd_loop"]
