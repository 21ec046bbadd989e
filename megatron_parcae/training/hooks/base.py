"""The training loop's one interface to whatever decides its layout.

`run_training` owns the steps, the logging and the checkpoints; a hook owns WORLD and
the layout. Every call speaks in consumed samples and returns the runtime to train with
next (None: this process is done with the job) and the samples the job has consumed,
which may differ from what this process trained when it joined or recovered.
"""

from __future__ import annotations

from typing import Protocol

from reconfig.execute import Runtime


class LayoutHook(Protocol):
    def start(self) -> tuple[Runtime | None, int]:
        """Form WORLD and build (or receive) the first layout this process trains in."""

    def advance(self, runtime: Runtime, consumed_samples: int) -> tuple[Runtime | None, int]:
        """At an iteration boundary: apply the layout change due here, if any."""

    def trained(self, consumed_samples: int) -> None:
        """A step was applied and rank 0 logged it; every rank calls it (it may be collective)."""

    def logs_again(self, consumed_samples: int) -> bool:
        """After `recover`: whether this process logs again the step that reached
        `consumed_samples`, its rank 0 maybe lost before logging it (the first of the new
        layout's ranks that trained it, where the job's record lacked the step when WORLD
        broke). Kept, trained again after a rollback or a restart, or skipped by neither,
        the step was trained once before: the change counts it among the lost steps."""

    def can_recover(self, error: BaseException) -> bool:
        """Whether `recover` can continue the job after `error` left a collective broken."""

    def recover(self, runtime: Runtime, consumed_samples: int, error: BaseException) -> tuple[Runtime | None, int]:
        """Continue after a failed collective of the running layout (see `can_recover`)."""

    def finish(self, consumed_samples: int | None) -> None:
        """This process is done; `consumed_samples` is None unless training reached its end."""


class TorchrunHook:
    """What the hooks of a torchrun job share: torchrun owns the processes, so there is
    nothing to record per step, a failed collective ends the run, and nobody needs
    telling at the end."""

    def trained(self, consumed_samples: int) -> None:
        pass

    def logs_again(self, consumed_samples: int) -> bool:
        return False

    def can_recover(self, error: BaseException) -> bool:
        return False

    def recover(self, runtime: Runtime, consumed_samples: int, error: BaseException) -> tuple[Runtime | None, int]:
        raise error

    def finish(self, consumed_samples: int | None) -> None:
        pass
