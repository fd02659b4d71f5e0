"""``python -m pasa_diffusers ...``: the ``pasa`` command line (``pasa_diffusers.cli.main``)."""
import sys

from pasa_diffusers.cli import main

sys.exit(main())
