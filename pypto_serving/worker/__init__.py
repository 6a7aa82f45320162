"""The device worker's compute side: ModelRunner (prepare -> forward -> sample) and its state."""

import os

# Idle OpenMP threads sleep instead of spinning. The worker shares a few cores with the
# server's main process (and, on a busy machine, with everything else): a spinning thread
# steals the core its partner needs to reach the barrier, and a 30 ms decode step became
# seconds. Must be set before torch loads libgomp; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
