"""End to end: a long text is encoded off the router's loop (real router and workers).

The model is the built-in tiny one written as a checkpoint whose context is 262,144
positions, so a text of 3 MiB passes the door's size check (context x the longest
token) and is really encoded: seconds of tokenizer work, after which its 1.8 M tokens are
refused for the context. Token-id requests submitted
after it must be served, token-identical to the reference, before its own answer comes;
the heartbeats meanwhile keep every worker registered (the lease is 3 s), and every free
log replays clean."""

from __future__ import annotations

import json

import pytest

from common.config import ServeConfig
from common.control import Done, Error, Tokens
from common.freelog import replay_file
from common.model import Model, Tokenizer, export_builtin, generate_greedy
from deploy.launch.launcher import Cluster

pytestmark = pytest.mark.timeout(300)

CONTEXT = 262_144
LONG_TEXT = "hello world " * ((3 << 20) // 12)   # 3 MiB, 1.8 M tokens: seconds to encode


@pytest.fixture(scope="module")
def long_context_checkpoint(tmp_path_factory):
    path = export_builtin("tiny", tmp_path_factory.mktemp("ckpt") / "tiny-long", "float64")
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (path / "config.json").write_text(json.dumps(config))
    return path


def _finals(client, want: set[str], timeout_s: float) -> tuple[list[str], dict, dict]:
    """Poll until every rid in ``want`` got its final message: (rids in the order their
    finals came, finals by rid, output ids by rid)."""
    import time

    order, finals, ids = [], {}, {rid: [] for rid in want}
    deadline = time.monotonic() + timeout_s
    while set(finals) != want and time.monotonic() < deadline:
        for msg in client.poll(0.1):
            if isinstance(msg, Tokens) and msg.rid in ids:
                ids[msg.rid].extend(msg.ids)
            elif isinstance(msg, (Done, Error)) and msg.rid in want and msg.rid not in finals:
                order.append(msg.rid)
                finals[msg.rid] = msg
    assert set(finals) == want, f"no answer for {want - set(finals)} in {timeout_s}s"
    return order, finals, ids


def test_a_long_text_being_encoded_holds_up_no_other_request(tmp_path,
                                                              long_context_checkpoint):
    cfg = ServeConfig(model_path=str(long_context_checkpoint), dtype="float64",
                      page_size=4, prefill_pages=96, decode_pages=160, chunk_size=24,
                      max_prefill_tokens=48, heartbeat_s=0.2, lease_s=3.0,
                      debug_integrity=True)
    tok = Tokenizer.for_model(cfg.model_config())
    assert len(LONG_TEXT) <= CONTEXT * tok.max_token_chars   # the door lets it in
    model = Model(cfg.model_config())
    shorts = {f"s{i}": [(7 * i + 3 * j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(4)}
    reference = {rid: generate_greedy(model, [p], 6, page_size=4)[0]
                 for rid, p in shorts.items()}
    cluster = Cluster(cfg, "disagg", 1, 1, log_dir=str(tmp_path)).start()
    try:
        client = cluster.client
        client.submit("long", [], {"max_new_tokens": 4}, text=LONG_TEXT)
        client.submit("dropped", [], {"max_new_tokens": 4}, text=LONG_TEXT[:1 << 20])
        client.abort("dropped")            # while its text is being encoded
        for rid, prompt in shorts.items():
            client.submit(rid, prompt, {"max_new_tokens": 6})
        order, finals, ids = _finals(client, {"long", "dropped", *shorts}, 240)
        status = client.status(timeout_s=5)
    finally:
        cluster.stop()
    cluster.check_exit_codes()
    # every short request was served, exactly, before the long text's own answer came
    assert order.index("long") > max(order.index(rid) for rid in shorts), order
    for rid, want in reference.items():
        assert isinstance(finals[rid], Done) and finals[rid].reason == "length", finals[rid]
        assert ids[rid] == want, rid
    # the long text was encoded (its token count is in the answer), and then refused as
    # too long in tokens for any row: its own error, nothing routed
    long = finals["long"]
    assert isinstance(long, Error) and long.code == "context_length_exceeded", long
    n_tokens = len(tok.encode(LONG_TEXT))
    assert f"prompt of {n_tokens} tokens is longer than any pool row" in long.error, \
        (n_tokens, long.error)
    dropped = finals["dropped"]
    assert isinstance(dropped, Done) and dropped.reason == "aborted", dropped
    assert "being encoded" in dropped.error
    # heartbeats kept flowing: no worker was ever declared lost
    assert all(not w["lost"] for w in status.workers.values()), status.workers
    assert " lost: " not in (tmp_path / "router.log").read_text()   # not even for a while
    for name in ("prefill0", "decode0"):   # neither text ever reached a worker
        log = (tmp_path / f"{name}.log").read_text()
        assert "long#" not in log and "dropped#" not in log
    logs = cluster.freelogs()   # device pools and host tiers
    assert len([p for p in logs if not p.name.endswith(".host.freelog")]) == 2, logs
    for log in logs:
        report = replay_file(log)
        assert report.ok and not report.warnings, report.format()
