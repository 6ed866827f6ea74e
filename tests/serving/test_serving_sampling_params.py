"""SamplingParams validation: every bad field raises ValueError naming it."""

from __future__ import annotations

import pytest

from serving.sample.sampling_params import SamplingParams


def test_defaults_are_valid_and_vllm_like() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (1.0, -1, 1.0, 0.0)
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.logprobs is None
    assert p.stop == () and p.stop_token_ids == () and not p.ignore_eos
    assert not p.is_greedy and SamplingParams(temperature=0).is_greedy


def test_lists_become_tuples_and_object_is_hashable() -> None:
    p = SamplingParams(stop=["a", "bc"], stop_token_ids=[3, 4])
    assert p.stop == ("a", "bc") and p.stop_token_ids == (3, 4)
    assert SamplingParams(stop="###").stop == ("###",)
    assert hash(p) == hash(SamplingParams(stop=("a", "bc"), stop_token_ids=(3, 4)))
    with pytest.raises(AttributeError):
        p.temperature = 0.5  # type: ignore[misc]


def test_top_k_zero_means_off() -> None:
    assert SamplingParams(top_k=0).top_k == -1
    assert SamplingParams(top_k=5).top_k == 5


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"seed": 1.0}, "seed"),
        ({"seed": True}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": ["x"]}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_invalid_field_raises_value_error_naming_it(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0},
        {"top_k": 1},
        {"top_p": 1.0},
        {"min_p": 1.0},
        {"presence_penalty": -2, "frequency_penalty": 2},
        {"seed": -7},
        {"min_tokens": 16, "max_tokens": 16},
        {"logprobs": 0},
        {"logprobs": 20},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)
