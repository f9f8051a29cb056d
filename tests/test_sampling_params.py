"""SamplingParams validation and normalization."""

from __future__ import annotations

import math

import pytest

from epd.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"temperature": -0.01}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": -100}, "top_k"),
    ({"presence_penalty": 2.01}, "presence_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"frequency_penalty": 3.0}, "frequency_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": math.nan}, "frequency_penalty"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
])
def test_out_of_range_values_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {"max_tokens": 1},
    {"temperature": 0.0},
    {"temperature": 5.0},
    {"top_p": 1.0},
    {"top_p": 1e-9},
    {"top_k": 0},
    {"top_k": 1},
    {"top_k": 50},
    {"presence_penalty": 2.0, "frequency_penalty": -2.0},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0},
])
def test_boundary_values_are_accepted(kwargs):
    p = SamplingParams(**kwargs)
    for k, v in kwargs.items():
        assert getattr(p, k) == v


def test_defaults():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (1.0, 1.0, 0, 16)
    assert p.stop == [] and p.stop_token_ids == [] and p.seed is None
    assert not p.greedy


def test_stop_string_becomes_a_list():
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(stop=["a", "bc"]).stop == ["a", "bc"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop=("x", "y")).stop == ["x", "y"]


def test_stop_list_is_copied_not_shared():
    stops = ["a"]
    p = SamplingParams(stop=stops)
    stops.append("b")
    assert p.stop == ["a"]
    ids = [5]
    q = SamplingParams(stop_token_ids=ids)
    ids.append(6)
    assert q.stop_token_ids == [5]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []


def test_top_k_minus_one_means_off():
    assert SamplingParams(top_k=-1).top_k == 0


def test_greedy_only_at_zero_temperature():
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.5).greedy


def test_nan_temperature_is_rejected():
    """BUG: ``self.temperature < 0`` is False for NaN, so NaN passes; the sampler then
    divides logits by NaN and always returns token 0."""
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=math.nan)


def test_non_integer_top_k_is_rejected():
    """BUG: top_k=1.5 passes validation, then Sampler crashes the whole step with
    ``RuntimeError: gather(): Expected dtype int32/int64 for index``."""
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=1.5)


@pytest.mark.parametrize("kwargs, field", [
    ({"seed": "x"}, "seed"), ({"seed": 2**70}, "seed"), ({"seed": -1}, "seed"),
    ({"temperature": "0.5"}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"max_tokens": True}, "max_tokens"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"top_p": float("nan")}, "top_p"),
])
def test_type_and_range_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
