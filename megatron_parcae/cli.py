"""The `parcae` console command.

Each sub-command lives in the module that owns its job; this file only maps names to
modules. A module named here exposes `add_arguments(parser)` and `run(args) -> int`.
Modules are imported only when their sub-command runs, so `parcae forecast` does not
pay for importing megatron-core and torch. Each sub-command's help shows its options'
defaults (HelpFormatter).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from megatron_parcae import __version__

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "preprocess": ("megatron_parcae.training.data.preprocess", "build megatron-core indexed datasets from text or JSONL"),
    "forecast": ("predictor.backtest", "back-test availability forecasters on a spot trace"),
    "simulate": ("megatron_parcae.tools.simulate", "replay a spot trace and compare layout policies"),
    "plan": ("megatron_parcae.tools.plan", "size a spot cluster for a deadline or a budget"),
    "profile": ("megatron_parcae.tools.profile", "measure per-layer costs of a model for the throughput model"),
    "coordinator": ("megatron_parcae.control.coordinator", "decide layouts live and publish plans in etcd (one leader per job)"),
    "replay": ("megatron_parcae.tools.replay", "replay a spot trace with real processes: --parcae against checkpoint-restart"),
    "status": ("megatron_parcae.control.status", "show a job's generation, layout, members, forecast and last migrations"),
    "compare": ("megatron_parcae.tools.compare", "how far apart two checkpoints' parameters and Adam moments are"),
    "notice-watch": ("megatron_parcae.tools.notice_watch", "print this instance's preemption notice from its cloud's metadata service"),
    "slurm": ("megatron_parcae.tools.slurm", "submit or cancel an elastic job on SLURM: one job array element per instance"),
}


class HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default after its help, unless the help already says it or
    there is none to show (a switch, an option that is off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if not action.option_strings or "default" in text or action.nargs == 0 \
                or default is None or default is False or default == argparse.SUPPRESS:
            return text
        values = default if isinstance(default, (list, tuple)) else [default]
        shown = " ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)
        return f"{text} (default: {shown.replace('%', '%%')})"


def command_parser(name: str) -> argparse.ArgumentParser:
    """The parser of sub-command `name`, its module's options added (imports the module)."""
    cmd_parser = argparse.ArgumentParser(prog=f"parcae {name}", description=COMMANDS[name][1],
                                         formatter_class=HelpFormatter)
    importlib.import_module(COMMANDS[name][0]).add_arguments(cmd_parser)
    for action in cmd_parser._actions:  # sub-commands of their own (parcae slurm submit) format alike
        if isinstance(action, argparse._SubParsersAction):
            for parser in action.choices.values():
                parser.formatter_class = HelpFormatter
    return cmd_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="parcae", description="megatron-parcae: spot-instance training for megatron-core")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # --version, --help, or an unknown command: argparse answers and exits
        parser.print_help(sys.stderr)
        return 2
    name = argv[0]
    return int(importlib.import_module(COMMANDS[name][0]).run(command_parser(name).parse_args(argv[1:])) or 0)


if __name__ == "__main__":
    sys.exit(main())
