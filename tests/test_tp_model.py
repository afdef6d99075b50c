"""Tensor-parallel model shards on real gloo groups (one process per rank, loopback):
logits, greedy tokens and KV heads against the single-device model at float64; payload
collectives; a rank that dies or stalls makes the others raise within the deadline."""

from __future__ import annotations

import pytest
import torch

from common.model import Model, TpModel, generate_greedy, shard_config
from tests import tp_ranks
from tests.model_helpers import F64, prompt
from tests.tp_helpers import run_ranks

pytestmark = pytest.mark.timeout(240)


def test_tp2_shards_reproduce_the_single_device_model():
    """Built-in shapes and transformers-written checkpoints (each rank reads its slices);
    the fingerprint is the whole model's, whatever the group size."""
    from tests.checkpoint_helpers import hf_checkpoint

    cases = [
        ({}, ""),
        # vocabulary 513 does not split evenly: lm-head shards of 257 and 256 rows;
        # biases on q/k/v and o (o's added once, after the all-reduce)
        ({"vocab_size": 513, "qkv_bias": True, "o_bias": True}, ""),
        ({"tie_word_embeddings": True}, ""),  # the head is the replicated embedding
        *(({}, str(hf_checkpoint(kind))) for kind in ("llama-bias-headdim", "tied",
                                                      "sharded")),
    ]
    per_rank = run_ranks(tp_ranks.model_checks, 2, cases)
    for i, case in enumerate(cases):
        _check([per_rank[0][i], per_rank[1][i]], case)


def _check(results: list[dict], case) -> None:
    leader = results[0]
    assert leader["dense_err_False"] < 1e-10 and leader["dense_err_True"] < 1e-10, \
        (case, leader)
    for r in results:
        # greedy tokens identical on every rank, and equal to the single-device run
        assert r["tokens"] == r["reference"], (case, r["rank"])
        # this rank's pool holds exactly its heads of the whole model's KV
        assert r["kv_err"] < 1e-10, (case, r["rank"], r["kv_err"])
        assert r["same_fingerprint"], (case, r["rank"])
    # rank 1 holds no logits: it never samples
    assert results[1]["dense_shape_False"] == [21, 0]


def test_tp1_is_the_plain_model_bit_for_bit(model):
    tp = TpModel(F64)
    ids = prompt(17)
    assert torch.equal(tp.forward_dense(ids), model.forward_dense(ids))
    prompts = [prompt(9, seed=5)]
    assert generate_greedy(tp, prompts, 6) == generate_greedy(model, prompts, 6)


def test_payload_collectives_agree_on_shapes():
    r0, r1 = run_ranks(tp_ranks.payloads, 2)
    for r in (r0, r1):
        assert r["got"] == "from rank 0" * 100 and r["empty"] == "" and r["ids"] == [5, 6, 7]
    assert r0["gathered"] == ["", "xxx"] and r1["gathered"] is None


@pytest.mark.parametrize("how", ["kill", "stall"])
def test_a_rank_that_dies_or_stalls_fails_the_collective_by_its_deadline(how):
    results = run_ranks(tp_ranks.rank_dies, 2, how, killed=(1,) if how == "kill" else ())
    assert results[0].startswith("lost: tp rank 0/2: all_reduce failed"), results[0]
    assert results[1] == (None if how == "kill" else "stalled")


def test_a_rendezvous_that_a_rank_misses_times_out():
    (result,) = run_ranks(tp_ranks.lonely, 1)
    assert result.startswith("lost: tp rank 0/2: rendezvous"), result


def test_a_rank_that_starts_late_joins_within_the_rendezvous_deadline_only():
    """The rendezvous is a startup wait (rank 1 comes 3 s late, twice the 1.5 s collective
    deadline) and the group joins; the collectives keep their own, shorter deadline."""
    r0, r1 = run_ranks(tp_ranks.late_rank, 2)
    assert r1 == "stalled" and r0.startswith("lost after "), (r0, r1)
    assert float(r0.split()[2]) < 10, r0   # the 1.5 s deadline, far from the 20 s one


def test_shard_config_names_what_does_not_split():
    cfg = shard_config(F64, 2)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == (2, 1, 192)
    with pytest.raises(ValueError, match="num_kv_heads=2 does not split over "
                                         "tensor-parallel size 4"):
        shard_config(F64, 4)
    with pytest.raises(ValueError, match="num_heads=4 does not split over tensor-parallel "
                                         "size 3"):
        shard_config(F64, 3)
    assert shard_config(F64, 1) is F64
    assert Model(F64).greedy(torch.tensor([[0.0, 2.0, 1.0]])) == [1]


def test_a_stored_tensor_slice_reads_exactly_its_rows_or_columns(tmp_path):
    from safetensors.torch import save_file

    from common.model.checkpoint import stored_tensors
    from common.model.tp_weights import _slice

    w = torch.arange(6 * 10, dtype=torch.float64).reshape(6, 10)
    save_file({"w": w}, str(tmp_path / "m.safetensors"))
    (stored,) = stored_tensors(tmp_path / "m.safetensors")
    assert torch.equal(_slice(stored, 0, 2, 5).load(), w[2:5])
    assert torch.equal(_slice(stored, 1, 4, 9), w[:, 4:9])
