"""Makes the first step of every layout slow on a worker started with
PARCAE_TEST_FIRST_STEP_SECONDS set: that many seconds pass before it trains it, as when
one GPU compiles kernels for longer than the others wait. Its peers wait in the step's
collectives."""

import os
import time

_SECONDS = float(os.environ.get("PARCAE_TEST_FIRST_STEP_SECONDS", "0"))

if _SECONDS > 0:
    from megatron_parcae.training.runtime import LayoutRuntime

    _train_step = LayoutRuntime.train_step

    def _slow_first_step(self, *args, **kwargs):
        if not getattr(self, "_slowed", False):
            self._slowed = True
            time.sleep(_SECONDS)
        return _train_step(self, *args, **kwargs)

    LayoutRuntime.train_step = _slow_first_step
