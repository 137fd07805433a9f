"""Lets tests import the shared helper modules in this directory (e.g. `hf_oracle`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
