"""Sampling, validation at the door, workloads and the serving config."""

from __future__ import annotations

import pytest

from common.config import ServeConfig
from common.model import sample
from common.request import BadRequest, SamplingParams, validate
from deploy.loadgen.workload import WorkloadSpec, make_workload


@pytest.mark.parametrize("prompt, params, words", [
    ([], SamplingParams(), "empty prompt"),
    ([1, 600], SamplingParams(), "[0, 512)"),
    ([1], SamplingParams(max_new_tokens=0), "max_new_tokens"),
    ([1], SamplingParams(temperature=-1.0), "temperature"),
    ([1], SamplingParams(temperature=float("nan")), "temperature"),
    ([1], SamplingParams(stop_token=9999), "stop_token"),
    ([1] * 90, SamplingParams(max_new_tokens=20), "exceeds the largest pool row"),
])
def test_bad_requests_are_refused_with_a_message_that_names_the_problem(prompt, params,
                                                                         words):
    with pytest.raises(BadRequest, match=words.replace("[", r"\[").replace(")", r"\)")):
        validate(prompt, params, vocab_size=512, max_tokens=100, max_new_tokens_limit=64)


def test_unknown_sampling_parameter_is_refused():
    with pytest.raises(BadRequest, match="unknown sampling parameters"):
        SamplingParams.from_dict({"top_q": 1})




def test_temperature_sampling_is_a_pure_function_of_seed_or_label_and_step():
    import torch
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1))
    seeded, unseeded = SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=1.0)
    steps = list(range(64))
    a = sample(logits, [seeded] * 64, ["x"] * 64, steps)
    assert a == sample(logits, [seeded] * 64, ["y"] * 64, steps)  # the label plays no part
    assert a != sample(logits, [SamplingParams(temperature=1.0, seed=4)] * 64, ["x"] * 64,
                       steps)
    b = sample(logits, [unseeded] * 64, ["x"] * 64, steps)
    assert b == sample(logits, [unseeded] * 64, ["x"] * 64, steps)  # a rerun of label x
    assert b != sample(logits, [unseeded] * 64, ["y"] * 64, steps)
    assert sample(logits, [SamplingParams()] * 64, ["x"] * 64, steps) == \
        logits.argmax(-1).tolist()


def test_workload_is_a_pure_function_of_the_seed():
    spec = WorkloadSpec(requests=20, seed=7, rate=5.0)
    a, b = make_workload(spec, 512), make_workload(spec, 512)
    assert a == b and a[0].rid == "s7-r00000" and a[0].arrival_s == 0.0
    assert all(16 <= len(r.prompt) <= 256 and 8 <= r.max_new_tokens <= 48 for r in a)
    assert make_workload(WorkloadSpec(requests=20, seed=8), 512) != a


def test_config_validation_names_allowed_values():
    with pytest.raises(ValueError, match="allowed"):
        ServeConfig(model="huge")
    with pytest.raises(ValueError, match="allowed"):
        ServeConfig(transport="udp")
    with pytest.raises(ValueError, match="unknown config keys"):
        ServeConfig.from_dict({"pages": 3})
    assert ServeConfig.from_dict(ServeConfig().to_dict()) == ServeConfig()


