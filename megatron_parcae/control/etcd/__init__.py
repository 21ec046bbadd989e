"""etcd between the coordinator and the agents: client, local server, key schema, leadership.

`etcd.store.EtcdStore` (torch.distributed's store over etcd) is not imported here: it
needs torch, which the coordinator and argument parsing do without.
"""

from megatron_parcae.control.etcd.client import (
    EtcdClient,
    EtcdAuthError,
    EtcdError,
    EtcdGone,
    EtcdUnavailable,
    KeptLease,
    LeaseExpired,
    TLSFiles,
)
from megatron_parcae.control.etcd.keys import JobKeys, JobStore, PlanEnvelope, SchemaError
from megatron_parcae.control.etcd.leadership import Leadership, NotLeader
from megatron_parcae.control.etcd.server import EtcdNotInstalled, EtcdServer, find_etcd_binary

__all__ = [
    "EtcdAuthError",
    "EtcdClient",
    "EtcdError",
    "EtcdGone",
    "EtcdNotInstalled",
    "EtcdServer",
    "EtcdUnavailable",
    "JobKeys",
    "JobStore",
    "KeptLease",
    "Leadership",
    "LeaseExpired",
    "NotLeader",
    "PlanEnvelope",
    "SchemaError",
    "TLSFiles",
    "find_etcd_binary",
]
