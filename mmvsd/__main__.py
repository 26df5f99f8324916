"""`python -m mmvsd`: the command line, as the `mmvsd` script runs it (e.g. under `accelerate launch -m mmvsd`)."""

import sys

# pyproject maps the checkout's adapters/ drafters/ data/ eval/ configs/ folders into the package when it is
# installed; `python -m mmvsd` in a checkout that is not installed editable finds mmvsd/ alone, so one of them
# (an mmvsd.* module) is missing. Any other missing module is a real error.
try:
    from mmvsd.cli import main
except ModuleNotFoundError as error:
    if not (error.name or "").startswith("mmvsd."):
        raise
    sys.exit(f"error: {error.name} is missing: this `mmvsd` is a source checkout's mmvsd/ folder, which holds only "
             "part of the package. Install the checkout (`pip install -e .`), or run `python -m mmvsd` outside it.")

sys.exit(main())
