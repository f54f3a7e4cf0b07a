"""The one percentile: by rank an observed sample, interpolated numpy's own numbers; lists and tensors alike."""

import math

import numpy as np
import pytest
import torch

from policy_bundle.quantize.percentile import percentile


def test_rank_p99_of_fewer_than_100_samples_is_their_maximum_and_of_200_the_second_largest():
    assert percentile([0.1] * 39 + [5.0], 0.99) == 5.0
    assert percentile(list(range(200)), 0.99) == 198.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0


def test_linear_is_numpys_percentile_to_the_bit_and_torchs_quantile_to_an_ulp():
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 100, 1001):
        x = torch.rand(n, generator=g, dtype=torch.float64) ** 3
        for q in (0.0, 0.5, 0.95, 0.99, 1.0):
            ours = percentile(x.tolist(), q, method="linear")
            assert ours == float(np.percentile(x.tolist(), q * 100))
            assert ours == pytest.approx(float(torch.quantile(x, q)), rel=1e-15, abs=0.0)


def test_a_tensor_of_any_shape_gives_what_its_values_as_a_list_give():
    x = torch.rand(4, 5, generator=torch.Generator().manual_seed(1))
    for method in ("rank", "linear"):
        assert percentile(x, 0.9, method=method) == percentile(x.reshape(-1).tolist(), 0.9, method=method)


def test_no_samples_give_the_callers_empty_value_and_a_nan_sample_gives_nan():
    assert math.isnan(percentile([], 0.99))
    assert percentile([], 0.99, empty=None) is None
    assert percentile(torch.empty(0), 0.99, method="linear", empty=0.0) == 0.0
    assert math.isnan(percentile([1.0, float("nan")], 0.5, method="linear"))


def test_q_outside_0_1_and_an_unknown_method_are_refused_with_the_value():
    with pytest.raises(ValueError, match=r"q=99 is outside \[0, 1\]"):
        percentile([1.0], 99)
    with pytest.raises(ValueError, match="method='nearest'"):
        percentile([1.0], 0.5, method="nearest")
