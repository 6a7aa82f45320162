"""The device worker's compute side: ModelRunner (prepare -> forward -> sample) and its state."""

import os

# OpenMP threads spin only briefly, then sleep. The worker shares a few cores with the
# server's main process (and, on a busy machine, with everything else): threads that spin
# without end steal the core their partner needs to reach the barrier, and a 30 ms decode
# step became seconds. Threads that never spin pay a futex wake-up at each of a decode
# step's ~250 parallel regions: the SmolLM2 batch-1 step took 21 ms instead of 7.6 ms.
# 10k spins (one `pause` each, ~26 ns on a Zen 3: ~0.3 ms) bridge the gaps inside a step
# but not the gap between steps: with 200k, the partner thread spun on one core through
# that gap while the main process sent the next step and streamed the last one's tokens on
# the other, and the worker waited for a core to receive the step (plan sent -> forward
# begun, c16 512/128: 1.5 ms median with 200k, 0.25 ms with 10k; batch 1: 0.65 -> 0.17 ms).
# Must be set before torch loads libgomp; explicit settings win (GOMP_SPINCOUNT overrides
# the wait policy's spin count).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
