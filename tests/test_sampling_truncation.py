"""Top-k and top-p (nucleus) truncation of seeded sampling, and their validation."""

from __future__ import annotations

import pytest
import torch

from common.model import sample
from common.request import BadRequest, SamplingParams, validate

# [1, 6]: probabilities after softmax about 0.43, 0.23, 0.16, 0.09, 0.06, 0.03
LOGITS = torch.log(torch.tensor([[0.43, 0.23, 0.16, 0.09, 0.06, 0.03]], dtype=torch.float64))


def draws(**kw) -> set[int]:
    p = SamplingParams(temperature=1.0, **kw)
    return {sample(LOGITS, [p], [f"r{i}"], [0])[0] for i in range(300)}


def test_without_truncation_every_token_is_drawn():
    assert draws() == {0, 1, 2, 3, 4, 5}


def test_top_k_keeps_the_k_most_likely():
    assert draws(top_k=1) == {0}
    assert draws(top_k=3) == {0, 1, 2}
    assert draws(top_k=0) == draws(top_k=-1) == {0, 1, 2, 3, 4, 5}


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    assert draws(top_p=1e-9) == {0}          # the most likely token always stays
    assert draws(top_p=0.4) == {0}           # 0.43 alone reaches 0.4
    assert draws(top_p=0.5) == {0, 1}        # 0.43 < 0.5 <= 0.66
    assert draws(top_p=0.8) == {0, 1, 2}     # 0.66 < 0.8 <= 0.82
    assert draws(top_k=2, top_p=0.99) == {0, 1}


def test_greedy_ignores_truncation():
    p = SamplingParams(temperature=0.0, top_k=3, top_p=0.5)
    assert sample(LOGITS, [p], ["r"], [0]) == [0]


@pytest.mark.parametrize("kw, name", [({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"),
                                      ({"top_p": 0.0}, "top_p"), ({"top_p": 1.01}, "top_p"),
                                      ({"top_p": float("nan")}, "top_p")])
def test_validation_names_the_bad_parameter(kw, name):
    with pytest.raises(BadRequest, match=name):
        validate([1], SamplingParams(**kw), vocab_size=8, max_tokens=64,
                 max_new_tokens_limit=16)


def test_params_round_trip_through_a_dict():
    p = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=4)
    assert SamplingParams.from_dict(p.to_dict()) == p
