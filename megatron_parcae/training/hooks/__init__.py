"""The training loop's layout hooks, one per way a run's layout is decided."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from megatron_parcae.control.etcd.client import EtcdClient
from megatron_parcae.training.hooks.base import LayoutHook
from megatron_parcae.training.hooks.fixed import FixedLayout
from megatron_parcae.training.hooks.live import LiveReconfiguration
from megatron_parcae.training.hooks.scheduled import ScheduledReconfiguration
from reconfig.execute import Runtime

__all__ = ["LayoutHook", "FixedLayout", "LiveReconfiguration", "ScheduledReconfiguration", "build_hook"]


def build_hook(args: argparse.Namespace, vocab_size: int, runtime_factory: Callable[[argparse.Namespace, int], Runtime],
               client: EtcdClient | None, before_change: Callable[[], None]) -> LayoutHook:
    """The hook the arguments ask for: live with an etcd `client`, scheduled with
    --parcae-layout-schedule, else fixed. Each sets up the process's device and WORLD."""
    if client is not None:
        return LiveReconfiguration(args, vocab_size, runtime_factory, client, before_change)
    if args.parcae_layout_schedule:
        return ScheduledReconfiguration(args, vocab_size, runtime_factory, before_change)
    return FixedLayout(args, vocab_size, runtime_factory)
