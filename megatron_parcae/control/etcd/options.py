"""Command-line options saying where etcd is and how to log in to it.

One definition serves every command that talks to etcd: `parcae coordinator`,
`parcae status` (flags `--etcd`, `--job`, `--etcd-ca`, ...) and the training scripts'
agents (the same flags behind `--parcae-`: `--parcae-etcd`, `--parcae-job`, ...).
Importing this module loads neither gRPC nor protobuf: argument parsing stays fast.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_parcae.control.etcd.client import EtcdClient

PASSWORD_ENV = "PARCAE_ETCD_PASSWORD"
DEFAULT_OUTAGE_S = 60.0  # several lease periods, more than an etcd restart takes


def add_etcd_arguments(parser: argparse.ArgumentParser, prefix: str = "", required: bool = True,
                       long_running: bool = False) -> None:
    """Add --{prefix}etcd, --{prefix}job and the TLS / user / timeout options; for a
    process that lives as long as the job, the bound on waiting out an etcd outage."""
    g = parser.add_argument_group(f"{prefix}etcd")
    g.add_argument(f"--{prefix}etcd", required=required, default=None, metavar="HOST:PORT", help="etcd endpoint")
    g.add_argument(f"--{prefix}job", required=required, default=None,
                   help="job name: its state lives under /parcae/JOB/ in etcd")
    g.add_argument(f"--{prefix}etcd-ca", default=None, metavar="PEM", help="CA certificate: connect with TLS")
    g.add_argument(f"--{prefix}etcd-cert", default=None, metavar="PEM", help="client certificate (TLS, with the key)")
    g.add_argument(f"--{prefix}etcd-key", default=None, metavar="PEM", help="client key (TLS, with the certificate)")
    g.add_argument(f"--{prefix}etcd-user", default=None,
                   help=f"etcd user; the password is read from --{prefix}etcd-password-file or ${PASSWORD_ENV}")
    g.add_argument(f"--{prefix}etcd-password-file", default=None, metavar="FILE", help="file holding the etcd password")
    g.add_argument(f"--{prefix}etcd-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="how long to wait for etcd to answer (default 5)")
    if long_running:
        g.add_argument(f"--{prefix}etcd-outage-seconds", type=float, default=DEFAULT_OUTAGE_S, metavar="SECONDS",
                       help=f"exit with an error once etcd has not answered for this long (default "
                            f"{DEFAULT_OUTAGE_S:g}: several lease periods, more than an etcd restart)")


def _option(args: argparse.Namespace, prefix: str, name: str):
    return getattr(args, (prefix + name).replace("-", "_"))


def check_etcd_arguments(args: argparse.Namespace, prefix: str = "") -> str | None:
    """The password the options name (read now), after checking they fit together.

    Raises ValueError naming the flag for a user error.
    """
    def get(name: str):
        return _option(args, prefix, name)

    flag = f"--{prefix}"
    if (get("etcd-cert") or get("etcd-key")) and not get("etcd-ca"):
        raise ValueError(f"{flag}etcd-cert and {flag}etcd-key need {flag}etcd-ca")
    password = None
    if get("etcd-password-file"):
        try:
            password = Path(get("etcd-password-file")).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{flag}etcd-password-file: cannot read {get('etcd-password-file')}: "
                             f"{getattr(exc, 'strerror', None) or exc}") from None
    elif get("etcd-user"):
        password = os.environ.get(PASSWORD_ENV)
    if (get("etcd-user") is None) != (password is None):
        raise ValueError(f"etcd authentication needs {flag}etcd-user and a password "
                         f"({flag}etcd-password-file or ${PASSWORD_ENV})")
    timeout = get("etcd-timeout")
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"{flag}etcd-timeout must be a positive number of seconds, got {timeout}")
    outage = _outage_seconds(args, prefix)
    if not (math.isfinite(outage) and outage > timeout):
        raise ValueError(f"{flag}etcd-outage-seconds must exceed {flag}etcd-timeout ({timeout:g}), got {outage}")
    from megatron_parcae.control.etcd.keys import JobKeys

    try:
        JobKeys(get("job"))
    except ValueError as exc:
        raise ValueError(f"{flag}job: {exc}") from None
    return password


def connect(args: argparse.Namespace, prefix: str = "") -> EtcdClient:
    """An etcd client from the options of `add_etcd_arguments(parser, prefix)`.

    Raises ValueError for bad options (a user error) and EtcdError when etcd cannot be
    reached or refuses the credentials.
    """
    from megatron_parcae.control.etcd.client import EtcdClient, TLSFiles

    password = check_etcd_arguments(args, prefix)

    def get(name: str):
        return _option(args, prefix, name)

    tls = TLSFiles(get("etcd-ca"), get("etcd-cert"), get("etcd-key")) if get("etcd-ca") else None
    return EtcdClient(get("etcd"), tls=tls, user=get("etcd-user"), password=password, timeout=get("etcd-timeout"),
                      outage_seconds=_outage_seconds(args, prefix))


def _outage_seconds(args: argparse.Namespace, prefix: str) -> float:
    """--{prefix}etcd-outage-seconds where the command has it (see `long_running`)."""
    return getattr(args, (prefix + "etcd-outage-seconds").replace("-", "_"), DEFAULT_OUTAGE_S)
