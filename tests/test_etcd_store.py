"""EtcdStore against a real etcd: Store semantics, and gloo WORLDs formed over it by real processes.

Run as a script, this file is one worker of the multi-process test (see `_worker`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_parcae.control.etcd import (
    EtcdAuthError, EtcdClient, EtcdError, EtcdGone, EtcdServer, EtcdUnavailable)
from megatron_parcae.control.etcd.client import KeyValue
from megatron_parcae.control.etcd.store import EtcdStore
from helpers import REPO


def _store(client: EtcdClient, timeout: timedelta = timedelta(seconds=5)) -> EtcdStore:
    """A store on a prefix no other test uses."""
    return EtcdStore(client, f"test-store/{uuid.uuid4().hex}/", timeout)


def test_set_get_bytes_and_str(client):
    store = _store(client)
    store.set("k", b"\x00\xffraw")
    store.set("s", "text")
    assert store.get("k") == b"\x00\xffraw"
    assert store.get("s") == b"text"
    store.set("k", b"")
    assert store.get("k") == b""


def test_add_counts_from_zero_in_decimal_ascii(client):
    store = _store(client)
    assert store.add("n", 0) == 0
    assert store.add("n", 5) == 5
    assert store.add("n", -7) == -2
    assert store.get("n") == b"-2"
    store.set("m", b"40")
    assert store.add("m", 2) == 42
    store.set("e", b"")  # empty counts as 0, as in torch's HashStore
    assert store.add("e", 1) == 1


def test_add_on_a_non_counter_is_a_clear_error(client):
    store = _store(client)
    store.set("n", b"abc")
    with pytest.raises(ValueError, match="holds b'abc', not a decimal counter"):
        store.add("n", 1)


def test_concurrent_adds_from_two_threads_give_exact_totals(client):
    store = _store(client)
    seen: list[int] = []

    def adder() -> None:
        seen.extend(store.add("n", 1) for _ in range(40))

    threads = [threading.Thread(target=adder) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.get("n") == b"80"
    assert sorted(seen) == list(range(1, 81))  # every add saw a distinct total


def test_compare_set_both_outcomes_and_absent_keys(client):
    store = _store(client)
    assert store.compare_set("a", b"", b"x") == b"x"  # absent, expected empty: created
    assert store.compare_set("b", b"q", b"x") == b"q"  # absent, expected not empty: untouched
    assert not store.check(["b"])
    assert store.compare_set("a", b"y", b"z") == b"x"  # mismatch: current value back
    assert store.compare_set("a", b"x", b"z") == b"z"  # match: swapped
    assert store.get("a") == b"z"


def test_get_of_a_missing_key_times_out_with_the_store_error(client):
    store = _store(client, timeout=timedelta(milliseconds=200))
    with pytest.raises(dist.DistStoreError, match="get 'missing' timed out after 0.2 s"):  # as TCPStore
        store.get("missing")
    # Through a C++ wrapper, as gloo calls it, and with wait's own timeout.
    prefixed = dist.PrefixStore("p", store)
    with pytest.raises(dist.DistStoreError, match="p/missing"):
        prefixed.get("missing")
    with pytest.raises(dist.DistStoreError, match=r"wait for \['p/missing'\] timed out after 0.05 s"):
        prefixed.wait(["missing"], timedelta(milliseconds=50))


def test_get_and_wait_block_until_the_key_is_set(client):
    store = _store(client)
    timer = threading.Timer(0.1, store.set, ("late", b"v"))
    timer.start()
    store.wait(["late"])
    assert store.check(["late"])
    assert store.get("late") == b"v"
    timer.join()


def test_check_num_keys_delete_key_also_through_prefix_store(client):
    store = _store(client)
    prefixed = dist.PrefixStore("p", store)  # the trampoline calls deleteKey/getNumKeys
    assert store.num_keys() == 0
    store.set("a", b"1")
    prefixed.set("b", b"2")
    assert store.check(["a", "p/b"]) and prefixed.check(["b"])
    assert not store.check(["a", "nope"])
    assert store.num_keys() == 2 and prefixed.num_keys() == 2
    assert prefixed.delete_key("b") and not prefixed.delete_key("b")
    assert store.delete_key("a")
    assert store.num_keys() == 0


def test_delete_prefix_drops_only_that_generation(client):
    store = _store(client)
    for generation in ("g3", "g31", "g4"):
        dist.PrefixStore(f"parcae/{generation}/", store).set("k", b"v")
    assert store.delete_prefix("parcae/g3/") == 1
    assert store.check(["parcae/g31//k", "parcae/g4//k"]) and not store.check(["parcae/g3//k"])
    assert store.delete_prefix("parcae/g3/") == 0


_KEYS = st.sampled_from(["a", "b"])
_VALUES = st.sampled_from([b"", b"0", b"7", b"-3", b"x", b"\xff"])
_OPS = st.one_of(
    st.tuples(st.just("set"), _KEYS, _VALUES),
    st.tuples(st.just("add"), _KEYS, st.integers(-5, 5)),
    st.tuples(st.just("compare_set"), _KEYS, _VALUES, _VALUES),
    st.tuples(st.just("delete_key"), _KEYS),
    st.tuples(st.just("check"), st.lists(_KEYS, max_size=2)),
    st.tuples(st.just("num_keys")),
)


@settings(max_examples=25, deadline=None)
@given(st.lists(_OPS, max_size=12))
def test_same_answers_as_torch_hash_store(etcd_server, ops):
    """Every call answers as torch's own in-memory store does (its semantics are TCPStore's)."""
    with EtcdClient(etcd_server.endpoint, timeout=3) as own:
        _check_same_answers(_store(own), dist.HashStore(), ops)


def _check_same_answers(ours: EtcdStore, reference: dist.Store, ops: list[tuple]) -> None:

    def outcome(store, name, *args):
        try:
            return getattr(store, name)(*args)
        except ValueError:  # add to a value that is not a decimal counter
            return ValueError

    for name, *args in ops:
        assert outcome(ours, name, *args) == outcome(reference, name, *args), (name, args)
    for key in ("a", "b"):
        assert ours.check([key]) == reference.check([key])
        if reference.check([key]):
            assert ours.get(key) == reference.get(key)


class _FlakyClient:
    """An EtcdClient whose first `failures` reads raise `error`."""

    def __init__(self, client: EtcdClient, failures: int, error: EtcdError) -> None:
        self._client, self.failures, self._error = client, failures, error
        self.endpoint = client.endpoint

    def get(self, key: str):
        if self.failures:
            self.failures -= 1
            raise self._error
        return self._client.get(key)

    def check_reachable(self) -> None:
        self._client.check_reachable()


def test_transient_etcd_errors_are_retried_refused_credentials_are_not(client):
    store = _store(client)
    store.set("k", b"v")
    flaky = _FlakyClient(client, 3, EtcdUnavailable("etcd get at test failed: down"))
    assert EtcdStore(flaky, store._prefix).get("k") == b"v" and flaky.failures == 0
    refused = _FlakyClient(client, 3, EtcdAuthError("etcd get at test refused: bad password"))
    with pytest.raises(EtcdAuthError):
        EtcdStore(refused, store._prefix).get("k")
    assert refused.failures == 2
    down = _FlakyClient(client, 10**9, EtcdUnavailable("etcd get at test failed: down"))
    with pytest.raises(dist.DistStoreError, match="last etcd error: etcd get at test failed: down"):
        EtcdStore(down, store._prefix, timedelta(milliseconds=100)).get("k")


class _Scripted:
    """A client without etcd: each read gives the next of `answers` (an error is raised,
    None is an absent key), the last one for good; gone after `gone_after` errors."""

    endpoint = "scripted:2379"

    def __init__(self, *answers, gone_after: int | None = None) -> None:
        self._answers, self._gone_after, self.reads, self.errors = answers, gone_after, 0, 0

    def get(self, key: str):
        answer = self._answers[min(self.reads, len(self._answers) - 1)]
        self.reads += 1
        if isinstance(answer, Exception):
            self.errors += 1
            raise answer
        return answer

    def check_reachable(self) -> None:
        if self.errors == self._gone_after:
            raise EtcdGone("etcd at scripted:2379 has not answered: giving up")


def test_polls_back_off_and_time_out_naming_the_last_etcd_error_even_after_later_answers():
    client = _Scripted(EtcdUnavailable("etcd get at test failed: down"), None)
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match=r"get 'k' timed out after 0.2 s; last etcd error: etcd get at test failed: down$"):
        EtcdStore(client, "p/", timedelta(milliseconds=200)).get("k")
    assert time.monotonic() - started >= 0.2
    assert 5 < client.reads < 30  # 1 ms doubling to 20 ms between reads: neither a busy loop nor a slow one


def test_refused_credentials_other_errors_and_an_etcd_gone_are_not_waited_out():
    for error in (EtcdAuthError("etcd get at test refused: bad password"), KeyError("not an etcd error")):
        client = _Scripted(error)
        with pytest.raises(type(error)):
            EtcdStore(client, "p/").get("k")
        assert client.reads == 1
    client = _Scripted(EtcdUnavailable("etcd get at test failed: down"), gone_after=3)
    with pytest.raises(EtcdGone, match="giving up"):
        EtcdStore(client, "p/").get("k")
    assert client.reads == 3


def test_a_zero_timeout_never_times_out():
    client = _Scripted(None, EtcdUnavailable("etcd get at test failed: down"), None, KeyValue("p/k", b"v", 1, 1, 1, 0))
    assert EtcdStore(client, "p/", timedelta(0)).get("k") == b"v" and client.reads == 4


@pytest.mark.slow
def test_get_waits_through_an_etcd_restart():
    with EtcdServer() as server, EtcdClient(server.endpoint, timeout=1) as own:
        store = _store(own, timeout=timedelta(seconds=30))
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(store.get("k")))
        reader.start()
        server.restart()
        store.set("k", b"after")
        reader.join(timeout=30)
        assert got == [b"after"]


# -- real processes forming WORLDs over the store ------------------------------------

def _worker(endpoint: str, prefix: str, rank: int) -> dict:
    """Rank `rank` of 3: WORLD g1 (all-reduce, a subgroup, megatron-core's groups), then
    WORLD g2 without rank 1. Returns the sums it saw."""
    from megatron.core import parallel_state as ps

    from megatron_parcae.training.cpu import enable_cpu_support
    from reconfig.world import release_parallel_state

    enable_cpu_support()
    store = EtcdStore(EtcdClient(endpoint), prefix, timedelta(seconds=60))
    timeout = timedelta(seconds=60)

    def summed(group=None) -> float:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=group)
        return t.item()

    dist.init_process_group("gloo", store=dist.PrefixStore("parcae/g1/", store), rank=rank, world_size=3, timeout=timeout)
    seen = {"g1": summed()}
    pair = dist.new_group([0, 2])  # every rank of WORLD calls it
    if rank != 1:
        seen["g1 pair"] = summed(pair)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    seen["g1 megatron dp"] = summed(ps.get_data_parallel_group())
    release_parallel_state()
    dist.destroy_process_group()
    if rank != 1:  # rank 1 leaves; ranks 0 and 2 form WORLD g2 as ranks 0 and 1
        dist.init_process_group("gloo", store=dist.PrefixStore("parcae/g2/", store), rank=rank // 2, world_size=2, timeout=timeout)
        seen["g2"] = summed()
        dist.destroy_process_group()
    return seen


def test_three_processes_form_two_generations_of_worlds(etcd_server, client):
    prefix = f"test-store/{uuid.uuid4().hex}/"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    workers = [subprocess.Popen([sys.executable, __file__, etcd_server.endpoint, prefix, str(rank)], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(3)]
    try:
        outputs = [w.communicate(timeout=150) for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    for rank, (w, (out, err)) in enumerate(zip(workers, outputs)):
        assert w.returncode == 0, f"rank {rank} failed ({w.returncode}):\n{out[-2000:]}\n{err[-3000:]}"
    seen = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert seen[0] == seen[2] == {"g1": 6.0, "g1 pair": 4.0, "g1 megatron dp": 6.0, "g2": 4.0}
    assert seen[1] == {"g1": 6.0, "g1 megatron dp": 6.0}
    store = EtcdStore(client, prefix)
    g1_keys = len(client.get_prefix(prefix + "parcae/g1/"))
    assert g1_keys > 0 and store.delete_prefix("parcae/g1/") == g1_keys
    assert store.num_keys() == len(client.get_prefix(prefix + "parcae/g2/")) > 0


if __name__ == "__main__":
    endpoint_arg, prefix_arg, rank_arg = sys.argv[1:4]
    print(json.dumps(_worker(endpoint_arg, prefix_arg, int(rank_arg))), flush=True)


# -- meeting peers before WORLD exists (reconfig.world.World.sync) ---------------------

def test_waiting_for_peers_ends_when_abandoned_or_too_slow(client):
    from reconfig.world import World, WorldBroken

    store = _store(client)
    asked = []

    def abandon(peers, waited):
        asked.append(waited)
        return "worker 1 is gone" if waited > 0.3 and 1 in peers else ""

    world = World(0, (0, 1), store, "gloo", meet_timeout=timedelta(seconds=30), abandon=abandon)
    with pytest.raises(WorldBroken, match="worker 0 stopped waiting at g1/built: worker 1 is gone"):
        world.sync("g1/built")  # worker 1 never comes
    assert asked[0] < 0.3 < asked[-1] < 5 and asked == sorted(asked)
    slow = World(0, (0, 1), store, "gloo", meet_timeout=timedelta(seconds=0.3))
    with pytest.raises(WorldBroken, match="workers 1 did not reach g2/built within 0.3 s"):
        slow.sync("g2/built")
    waiting = World(0, (0, 1, 2), store, "gloo", meet_timeout=timedelta(seconds=30))
    threading.Timer(0.3, World(1, (), store, "gloo").break_generation, args=(4,)).start()
    with pytest.raises(WorldBroken, match="a peer broke in g4"):
        waiting.sync("g4/layout/built")  # worker 2 died; worker 1 saw it and gave up
    both = [World(w, (0, 1), store, "gloo", meet_timeout=timedelta(seconds=30)) for w in (0, 1)]
    late = threading.Timer(0.3, both[1].sync, args=("g3/built",))
    late.start()
    both[0].sync("g3/built")  # returns once worker 1 has come too
    late.join()


def test_a_world_that_failed_to_form_leaves_group_names_as_its_peers_count_them(client):
    """A peer that arrived and died before WORLD formed makes init_process_group time out
    here; the next WORLD must still name its groups from 0 as every fresh peer does (the
    store keys of a group start with its name), or the two never meet."""
    from reconfig.world import World

    store = _store(client)
    world = World(0, (), store, "gloo", collective_timeout=timedelta(seconds=1))
    dist.PrefixStore("parcae/g1/arrived/", store).add("count", 1)  # worker 1 arrived, then died
    with pytest.raises(RuntimeError):
        world.reform((0, 1), "g1")
    assert not dist.is_initialized()
    world.reform((0,), "g2")
    try:
        assert dist.group.WORLD.group_name == "0"
    finally:
        world.leave()


def test_etcd_gone_past_the_outage_bound_is_given_up_and_back_within_it_is_not():
    with EtcdServer() as server, \
            EtcdClient(server.endpoint, timeout=0.5, outage_seconds=2) as client:
        store = _store(client)
        store.set("k", b"v")
        client.check_reachable()
        server.restart()  # an outage shorter than the bound: nothing is given up
        assert store.get("k") == b"v" and client.unreachable_seconds == 0
        server.stop()
        with pytest.raises(EtcdUnavailable):
            client.get("/nothing")
        assert 0 < client.unreachable_seconds < 2
        client.check_reachable()
        with pytest.raises(EtcdGone, match="more than the outage bound of 2 s"):
            store.get("k")  # retried until the bound, then given up
        with pytest.raises(EtcdGone):
            client.check_reachable()
