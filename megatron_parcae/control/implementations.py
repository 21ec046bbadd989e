"""One transformer implementation per layout.

Transformer Engine names its parameters differently from megatron-core's local layers
(`linear_qkv.layer_norm_weight`), so state cannot move between workers of the two and a
layout mixing them fails when it is assembled. Each worker states its --transformer-impl
in its member record; the coordinator keeps the members a layout may use to one of them.
"""

from __future__ import annotations

from typing import Mapping

from megatron_parcae.control.etcd.keys import MemberRecord


class MixedImplementations(ValueError):
    """The job's workers state different transformer implementations and no running layout
    says which one the job runs: the job is refused (the message names the instances)."""


def _names(instances: set[str], shown: int = 8) -> str:
    """'[a, b]', or '[a, b, ... 40 in all]' for many: the line stays short."""
    ordered = sorted(instances)
    more = f", ... {len(ordered)} in all" if len(ordered) > shown else ""
    return f"[{', '.join(ordered[:shown])}{more}]"


def one_implementation(members: Mapping[int, MemberRecord],
                       running: frozenset[int]) -> tuple[dict[int, MemberRecord], str]:
    """The members a layout may use, and why some were left out ("" if none were).

    Members that state the same implementation (or none: an older worker) are all kept.
    Otherwise the running layout's workers say which one the job runs and the members that
    state another are left out; with no layout running (the first plan, or a restart from
    a checkpoint), or one whose workers state none, MixedImplementations refuses the job.
    """
    instances: dict[str, set[str]] = {}
    for member in members.values():
        if member.transformer_impl is not None:
            instances.setdefault(member.transformer_impl, set()).add(member.instance)
    if len(instances) < 2:
        return dict(members), ""
    line = "workers state different transformer implementations: " + "; ".join(
        f"{impl} on instances {_names(names)}" for impl, names in sorted(instances.items()))
    kept = {members[w].transformer_impl for w in running & members.keys()} - {None}
    if len(kept) != 1:
        raise MixedImplementations(f"{line}; the job is refused: start every worker with the same --transformer-impl")
    impl = kept.pop()
    return ({w: m for w, m in members.items() if m.transformer_impl in (None, impl)},
            f"{line}; the layout runs {impl}, the others are left out")
