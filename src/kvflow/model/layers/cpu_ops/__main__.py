"""scripts/setup.sh: `python -m kvflow.model.layers.cpu_ops` builds the kernels now, so that no
start pays for it."""

import logging

from kvflow.model.layers import cpu_ops

logging.basicConfig(level=logging.INFO, format="%(message)s")
print("fused CPU elementwise kernels:", "ready" if cpu_ops.load() is not None else "unavailable (torch path)")
