"""Attack stories against a real deployment (router, prefill and decode processes over
tcp, with keys), while a victim client's requests are in flight (docs/security.md).

One deployment serves the victim's seeded workload; an attacker with raw ZMQ sockets
tries everything below at once. Then: every attack was refused and counted, the victim's
outputs equal the reference token for token, and every free log replays clean.

    stranger   no keys (NULL)              shutdown, register, abort, status, a pickle
    foreigner  another deployment's keys   the same
    mallory    a client key of this one    shutdown, the victim's abort (by its label and
                                           by the router's id)/tokens/done,
                                           register, a pickle
    stale      a worker key, another id    register
    evil       a worker key (stand-in for  tokens/done/prefilled of the victim's requests;
               a compromised worker)       with the KV credentials it got: announces of the
                                           victim's rids under hostile shared-memory names
                                           (a path, the decode's own segment, a wrong size),
                                           out-of-range pages, a pickle
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from common.auth import Keys, PlaneAuth, add_key, create_keys
from common.config import ServeConfig
from common.freelog import replay_file
from common.model import Model, generate_greedy
from deploy.launch.launcher import Cluster
from deploy.loadgen.driver import drive
from deploy.loadgen.workload import WorkloadSpec, make_workload
from deploy.router.client import Client
from tests.attack_helpers import (
    SENTINEL,
    Sock,
    announce,
    control_types,
    curve_as,
    is_malformed_error,
    kv_answers,
    kv_hello,
    pickled_exploit,
    shm_segments,
)

# the reference (float64, ~2000 greedy tokens) and the victim are slow on a loaded machine:
# a hang guard, not a timing assertion
pytestmark = pytest.mark.timeout(900)

# The decode is stopped (SIGSTOP) while the attack runs (12 s on a quiet machine), so that
# the victim's requests are in flight for all of it however fast the machine is: the
# lease outlasts the attack.
CFG = ServeConfig(dtype="float64", page_size=4, prefill_pages=96, decode_pages=200,
                  chunk_size=24, max_prefill_tokens=48, max_running=1, heartbeat_s=0.2,
                  lease_s=30.0, transport="tcp", debug_integrity=True)
# one at a time and long: the victim's requests queue behind each other
SPEC = WorkloadSpec(requests=6, seed=11, rate=0.0, prompt_len=(8, 40),
                    output_len=(300, 360))


@pytest.fixture(scope="module")
def reference():
    reqs = make_workload(SPEC, CFG.model_config().vocab_size)
    model = Model(CFG.model_config())
    return {r.rid: generate_greedy(model, [r.prompt], r.max_new_tokens, page_size=4)[0]
            for r in reqs}


class Attack:
    """Everything the attackers saw, for the tests to check afterwards."""

    def __init__(self, cluster: Cluster, tmp: Path):
        self.cluster, self.tmp = cluster, tmp
        self.keys = Keys(cluster.keys_dir)
        self.router_public = self.keys.public("router")
        create_keys(tmp / "foreign")
        self.foreign = Keys(tmp / "foreign")
        self.marker = tmp / "unpickled"     # exists only if someone unpickled our frame
        self.precious = tmp / "precious"    # a file a hostile shm name points at
        self.precious.write_bytes(b"\x07" * (1 << 20))
        self.seen: dict[str, object] = {}
        self.ctx = zmq.Context()
        self.digest = Model(CFG.model_config()).fingerprint   # what a worker's Hello shows

    def labels(self) -> list[str]:
        """The victim's rids as it named them."""
        return [f"s{SPEC.seed}-r{i:05d}" for i in range(SPEC.requests)]

    def rids(self) -> list[str]:
        """The router's ids of the victim's requests, what workers and the KV plane see
        (``label#run-n``: the run tag is in any ``Pong``, the victim submitted in order):
        the attackers know them, as the strongest insider would."""
        ping = Client(self.cluster.router_addr, "mallory-ping", self.keys, "client-mallory")
        try:
            run = ping.ping(20)
        finally:
            ping.close()
        return [f"{label}#{run}-{i + 1}" for i, label in enumerate(self.labels())]

    def run(self) -> None:
        try:
            self.unauthenticated()
            self.client_mallory()
            self.stale_worker()
            self.evil_worker()
        finally:
            self.ctx.term()

    # -- no keys / wrong keys ------------------------------------------------------------
    def unauthenticated(self) -> None:
        router = self.cluster.router_addr
        for who, plane in (("stranger", None),
                           ("foreigner", curve_as(self.foreign.pair("operator"),
                                                  self.router_public))):
            s = Sock(self.ctx, router, plane)
            try:
                for body in ({"t": "Shutdown"}, {"t": "Register", "role": "decode",
                                                 "name": who, "pid": 1},
                             {"t": "Abort", "rid": self.rids()[0]}, {"t": "Status"}):
                    s.send_map(body)
                s.send(pickled_exploit(self.marker))
                self.seen[f"{who}.handshake"] = s.handshake()
                self.seen[f"{who}.got"] = s.recv_all(0.5)   # after a refused handshake
            finally:
                s.close()

    # -- a client of this deployment -------------------------------------------------------
    def client_mallory(self) -> None:
        s = Sock(self.ctx, self.cluster.router_addr,
                 curve_as(self.keys.pair("client-mallory"), self.router_public))
        try:
            victim, label = self.rids()[0], self.labels()[0]
            for body in ({"t": "Shutdown"}, {"t": "Abort", "rid": label},
                         {"t": "Abort", "rid": victim},
                         {"t": "Tokens", "rid": victim, "ids": [1]},
                         {"t": "Done", "rid": victim, "reason": "stop", "n": 1},
                         {"t": "Register", "role": "decode", "name": "m", "pid": 1,
                          "deployment": self.keys.deployment_id}):
                s.send_map(body)
            s.send(pickled_exploit(self.marker))   # answered malformed: the last answer
            self.seen["mallory.handshake"] = s.handshake()
            self.seen["mallory.got"] = control_types(s.recv_until(is_malformed_error))
        finally:
            s.close()

    def stale_worker(self) -> None:
        s = Sock(self.ctx, self.cluster.router_addr,
                 curve_as(self.keys.pair("worker"), self.router_public))
        try:
            s.send_map({"t": "Register", "role": "decode", "name": "stale", "pid": 1,
                        "deployment": "0" * 32})
            s.send(SENTINEL)
            self.seen["stale.got"] = control_types(s.recv_until(is_malformed_error))[:-1]
        finally:
            s.close()

    # -- a worker key of this deployment ---------------------------------------------------
    def evil_worker(self) -> None:
        s = Sock(self.ctx, self.cluster.router_addr,
                 curve_as(self.keys.pair("worker"), self.router_public))
        try:
            s.send_map({"t": "Register", "role": "decode", "name": "evil", "pid": 1,
                        "deployment": self.keys.deployment_id})
            s.send(SENTINEL)
            reg = s.recv_until(is_malformed_error)
            body = msgpack.unpackb(reg[0][-1], raw=False)
            self.seen["evil.registered"] = body["t"]
            kv_auth = PlaneAuth.kv_from_dict(body["kv_auth"])   # never Ready: gets no work
            for rid in self.rids():   # reports on rids it was never given
                s.send_map({"t": "Tokens", "rid": rid, "ids": [666]})
                s.send_map({"t": "Done", "rid": rid, "reason": "stop", "n": 1})
                s.send_map({"t": "Prefilled", "rid": rid, "reason": "sent"})
            s.send(SENTINEL)
            self.seen["evil.control"] = control_types(s.recv_until(is_malformed_error))[:-1]
            self.kv_attacks(kv_auth)
        finally:
            s.close()

    def kv_attacks(self, kv_auth: PlaneAuth) -> None:
        prefill = next(p for p in self.cluster.procs if p.role == "prefill")
        kv_addr = prefill.argv[prefill.argv.index("--kv-bind") + 1]
        decode = next(p for p in self.cluster.procs if p.role == "decode")
        segment = shm_segments(decode.popen.pid)[0]
        self.seen["kv.stranger"] = self._kv_stranger(kv_addr)
        hostile = {
            "plain": ("", 0),
            "path": (f"../..{self.precious}", 1),
            "victim_segment": (segment, CFG.decode_pages),
            "wrong_size": (segment, 1 << 30),
        }
        for name, (pool, pages) in hostile.items():
            self.seen[f"kv.{name}"] = self._kv_peer(kv_auth, kv_addr, name, pool, pages)

    def _kv_stranger(self, kv_addr: str) -> tuple[str, list]:
        s = Sock(self.ctx, kv_addr)    # no KV credentials
        try:
            s.send(kv_hello(CFG, "stranger", self.digest))
            return s.handshake(), s.recv_all(0.5)
        finally:
            s.close()

    def _kv_peer(self, kv_auth, kv_addr, name, pool, pages) -> list[tuple[str, str]]:
        s = Sock(self.ctx, kv_addr, kv_auth)
        try:
            s.send(kv_hello(CFG, f"evil-{name}", self.digest, pool, pages))  # same host
            rids = self.rids()
            for rid in rids:   # every victim rid, then pages out of range
                s.send(announce(rid, [1, 2, 3], CFG.page_size))
            s.send(announce(rids[0], [10**6, -5, 0], CFG.page_size, cap="x" * 32))
            s.send(pickled_exploit(self.marker))   # answered malformed: the last answer
            return kv_answers(s.recv_until(is_malformed_error))
        finally:
            s.close()


@pytest.fixture(scope="module")
def attacked(tmp_path_factory, reference):
    """Serve the victim's workload while the attack runs; stop; collect everything."""
    tmp = tmp_path_factory.mktemp("attacks")
    cluster = Cluster(CFG, "disagg", 1, 1, log_dir=str(tmp / "logs"))
    add_key(cluster.keys_dir, "client-mallory")   # before start: the router admits it
    cluster.start()
    attack = Attack(cluster, tmp)
    victim = Client(cluster.router_addr, "victim", Keys(cluster.keys_dir), "client")
    results: dict = {}
    try:
        requests = make_workload(SPEC, CFG.model_config().vocab_size)
        runner = threading.Thread(target=lambda: results.update(drive(victim, requests,
                                                                      timeout_s=240)))
        runner.start()
        _wait_in_flight(cluster, SPEC.requests)
        decode = next(p for p in cluster.procs if p.role == "decode").popen
        os.kill(decode.pid, signal.SIGSTOP)   # nothing of the victim's can finish now
        try:
            t0 = time.monotonic()
            attack.run()
            assert time.monotonic() - t0 < CFG.lease_s / 2, "the attack outlasts the lease"
            in_flight_after = _status(cluster).in_flight
        finally:
            os.kill(decode.pid, signal.SIGCONT)
        runner.join(240)
        status = _status(cluster)
        # the router waits for the final stats of the ready workers only: the attacker's
        # registration (never ready) held the shutdown up for a lease (30 s) before
        stats = cluster.stop()
    finally:
        victim.close()
        cluster.stop()
    return attack, results, status, stats, cluster, in_flight_after


def _status(cluster: Cluster):
    """A fresh operator connection's status (the launcher's may hold stale answers)."""
    client = Client(cluster.router_addr, "ops", Keys(cluster.keys_dir), "operator")
    try:
        return client.status(20)
    finally:
        client.close()


def _wait_in_flight(cluster: Cluster, n: int) -> None:
    deadline = time.monotonic() + 60
    while _status(cluster).in_flight < n and time.monotonic() < deadline:
        time.sleep(0.05)


# -- the victim -------------------------------------------------------------------------
def test_the_victims_outputs_are_untouched_and_the_logs_clean(attacked, reference):
    attack, results, _, _, cluster, in_flight_after = attacked
    assert in_flight_after > 0, "the victim finished before the attack ended: no story"
    assert {rid: r.reason for rid, r in results.items()} == {r: "length" for r in reference}
    assert {rid: r.output_ids for rid, r in results.items()} == reference
    logs = cluster.freelogs()
    assert len(logs) >= 2
    for log in logs:
        report = replay_file(log)
        assert report.ok, report.format()
    assert not attack.marker.exists(), "someone unpickled a frame off the wire"
    assert attack.precious.read_bytes() == b"\x07" * (1 << 20)


# -- the control plane -------------------------------------------------------------------
def test_an_unauthenticated_socket_gets_nothing(attacked):
    seen = attacked[0].seen
    assert seen["stranger.handshake"].startswith("HANDSHAKE_FAILED")   # no CURVE at all
    assert seen["foreigner.handshake"] == "HANDSHAKE_FAILED_AUTH"
    assert seen["stranger.got"] == [] and seen["foreigner.got"] == []
    assert attacked[2].errors["unauthenticated"] >= 1   # the foreigner's key, counted


def test_a_client_cannot_shut_down_or_touch_anothers_request(attacked):
    seen, status = attacked[0].seen, attacked[2]
    assert seen["mallory.handshake"] == "HANDSHAKE_SUCCEEDED"
    # the victim's label and the router's id name no request of mallory's: she learns
    # nothing of the victim's; the rest her role may not send at all
    assert seen["mallory.got"] == [("Error", "forbidden")] + [("Error", "unknown_rid")] * 2 \
        + [("Error", "forbidden")] * 3 + [("Error", "malformed")]
    for kind in ("Shutdown", "Tokens", "Done", "Register"):
        assert status.errors[f"forbidden.{kind}"] >= 1, kind
    assert status.errors["unknown_rid"] >= 2


def test_only_workers_of_this_deployment_register_and_only_about_their_requests(attacked):
    seen, status = attacked[0].seen, attacked[2]
    assert seen["stale.got"] == [("Error", "forbidden")]
    assert seen["evil.registered"] == "Registered"
    n = SPEC.requests
    forbidden = [t for t in seen["evil.control"] if t == ("Error", "forbidden")]
    assert len(forbidden) >= 1   # the victim's requests still in flight at the time
    assert status.errors["forbidden.Tokens"] + status.errors["forbidden.Done"] + \
        status.errors["forbidden.Prefilled"] >= len(forbidden)
    replies = [t for t in seen["evil.control"] if t[0] != "Ping"]   # the router's heartbeat
    assert len(replies) <= 3 * n and not any(t[0] == "Req" for t in replies)   # no prompts


# -- the KV plane ------------------------------------------------------------------------
def test_a_kv_peer_without_this_runs_credentials_gets_nothing(attacked):
    handshake, got = attacked[0].seen["kv.stranger"]
    assert handshake.startswith("HANDSHAKE_FAILED") and got == []


@pytest.mark.parametrize("variant", ["plain", "path", "victim_segment", "wrong_size"])
def test_forged_announces_get_no_kv_whatever_the_hello_says(attacked, variant):
    answers = attacked[0].seen[f"kv.{variant}"]
    types = {t for t, _ in answers}
    assert not types & {"KvChunk", "KvWritten", "Done", "Accepted"}, answers
    refused = [a for a in answers if a[0] == "Error"]
    # every announce (victim rids, out-of-range pages) and the pickle: an Error each,
    # unless the prefill refused the hostile Hello outright; a Hello without shared memory
    # is a valid one, so there the capability check itself refuses the announces
    if variant == "plain":
        assert ("Hello", "") in answers and ("Error", "handshake") not in answers, answers
    assert len(refused) >= SPEC.requests + 2 or ("Error", "handshake") in answers or \
        not any(t == "Hello" for t, _ in answers), answers


def test_the_prefill_counted_every_refusal(attacked):
    stats = attacked[3]
    prefill = next(s for s in stats.values() if s["role"] == "prefill")
    assert prefill["refused_announces"] >= SPEC.requests + 1   # at least the plain Hello's
    assert prefill["kv_errors"] >= 4 * (SPEC.requests + 2)
