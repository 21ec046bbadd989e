"""Kills a worker started with PARCAE_TEST_KILLED_AT set (a path) in the middle of a
layout change's exchange: as it comes to its first point-to-point operation while it
applies a migration, it writes {"killed_at": <time.time()>} to that path and SIGKILLs
itself, while its peers are inside the exchange with it."""

import json
import os
import signal
import time

_KILLED_AT = os.environ.get("PARCAE_TEST_KILLED_AT")

if _KILLED_AT:
    import torch.distributed as dist

    from megatron_parcae.training.hooks import live

    _migrating = False

    def _dies_when_migrating(operation):
        def checked(*args, **kwargs):
            if _migrating:
                with open(_KILLED_AT, "w") as out:
                    json.dump({"killed_at": time.time()}, out)
                os.kill(os.getpid(), signal.SIGKILL)
            return operation(*args, **kwargs)
        return checked

    # Not isend and irecv: batch_isend_irecv's P2POp accepts only torch's own.
    for _name in ("send", "recv", "batch_isend_irecv"):
        setattr(dist, _name, _dies_when_migrating(getattr(dist, _name)))

    _migrate = live.migrate

    def _marked_migrate(*args, **kwargs):
        global _migrating
        _migrating = True
        try:
            return _migrate(*args, **kwargs)
        finally:
            _migrating = False

    live.migrate = _marked_migrate
