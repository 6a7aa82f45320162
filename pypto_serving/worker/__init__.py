"""The device worker's compute side: ModelRunner (prepare -> forward -> sample) and its state."""

import os

# OpenMP threads spin only briefly, then sleep. The worker shares a few cores with the
# server's main process (and, on a busy machine, with everything else): threads that spin
# without end steal the core their partner needs to reach the barrier, and a 30 ms decode
# step became seconds. Threads that never spin pay a futex wake-up at each of a decode
# step's ~250 parallel regions: the SmolLM2 batch-1 step took 21 ms instead of 7.6 ms.
# 200k spins bridge the gaps inside a step. A spin is one `pause`: ~26 ns on a Zen 3, so
# there the partner thread also spins through the ~2 ms between steps (10k spins halved
# that gap, but did not move serving throughput beyond the machine's noise).
# Must be set before torch loads libgomp; explicit settings win (GOMP_SPINCOUNT overrides
# the wait policy's spin count).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "200000")
