"""Entry point of scripts/pretrain_gpt.py and scripts/pretrain_bert.py.

Arguments are parsed and checked before torch, megatron-core or any process group is
loaded, so a bad flag fails in a fraction of a second with one line, on every rank alike.
"""

from __future__ import annotations

import os
import sys

from megatron_parcae.training.arguments import ArgumentError, exit_on_argument_error, parse_args


def pretrain(model: str, argv: list[str] | None = None) -> int:
    prog = os.path.basename(sys.argv[0]) if argv is None else f"pretrain_{model}.py"
    try:
        args = parse_args(argv, prog=prog, model=model)
    except ArgumentError as exc:
        exit_on_argument_error(prog, exc)
    client = None
    if args.parcae_etcd is not None:  # before torch loads: a wrong endpoint or password fails in seconds
        from megatron_parcae.control.etcd import EtcdError
        from megatron_parcae.control.etcd.options import connect

        try:
            client = connect(args, prefix="parcae-")
        except (ValueError, EtcdError) as exc:
            print(f"{prog}: error: --parcae-etcd {args.parcae_etcd}: {exc}", file=sys.stderr, flush=True)
            return 1
    from megatron_parcae.training.cpu import import_megatron_core
    from megatron_parcae.training.fallback_warnings import show_first_missing_kernel_warning

    show_first_missing_kernel_warning()
    import_megatron_core()
    from megatron_parcae.training.loop import run_training

    return run_training(args, prog, client)
