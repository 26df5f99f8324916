"""`python -m mmvsd`: the command line, as the `mmvsd` script runs it (e.g. under `accelerate launch -m mmvsd`)."""

import sys

from mmvsd.cli import main

sys.exit(main())
