"""Routes megatron-core's collectives of CPU tensors through host copies, one at a time, as
PARCAE_ONE_GPU does with CUDA ones (reconfig/one_gpu.py), so that a CPU test runs that
path. Where PARCAE_TEST_ROUTED names a folder, each rank writes there (rank-N) how many
collectives took it."""

import atexit
import os

_FOLDER = os.environ.get("PARCAE_TEST_ROUTED")

if _FOLDER:
    import torch

    from reconfig import one_gpu

    _routed = [0]
    _through_host = one_gpu._through_host

    def _counted(collective):
        staged = _through_host(collective)

        def counted(*args, **kwargs):
            _routed[0] += any(torch.is_tensor(a) for a in (*args, *kwargs.values()))
            return staged(*args, **kwargs)

        counted.through_host = True
        return counted

    def _write() -> None:
        if "RANK" in os.environ and _routed[0]:
            with open(os.path.join(_FOLDER, f"rank-{os.environ['RANK']}"), "w") as out:
                out.write(str(_routed[0]))

    one_gpu._through_host = _counted
    one_gpu.STAGED_DEVICE_TYPES = ("cpu",)
    one_gpu.route_collectives_through_host()
    atexit.register(_write)
