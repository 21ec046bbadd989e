"""Kills a worker started with PARCAE_TEST_LOST_BEFORE_MEETING=1 as it reaches its first
meeting point (reconfig.world.World.sync), before it says it came: its peers wait there
for a worker that never arrives, and must see that it is no longer a member."""

import os
import signal

if os.environ.get("PARCAE_TEST_LOST_BEFORE_MEETING") == "1":
    from reconfig.world import World

    def _die(self, key):
        os.kill(os.getpid(), signal.SIGKILL)

    World.sync = _die
