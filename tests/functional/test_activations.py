import math

import pytest
import torch
from torch import nn

from lightning_tfdebug.functional.activations import (
    ACTIVATION_KINDS,
    LayerCounts,
    apply_activation,
    dead_fraction,
    kind_of_module,
    layer_fractions,
    pack_counts,
    saturated_count,
    tail_cutoff,
    zeros_and_alive,
)


def zero_count(y):
    """A plain reference: the exact zeros (a signed zero is zero, nan is not)."""
    return (y == 0).sum()


def alive_units(y):
    """A plain reference: per unit (last dimension), non-zero for some token (nan included)."""
    return (y.reshape(-1, y.shape[-1]) != 0).any(dim=0)


@pytest.mark.parametrize(
    "module, kind",
    [
        (nn.ReLU(), "relu"),
        (nn.ReLU6(), "relu6"),
        (nn.LeakyReLU(), "leaky_relu"),
        (nn.PReLU(), "leaky_relu"),
        (nn.GELU(), "gelu"),
        (nn.SiLU(), "silu"),
        (nn.Mish(), "mish"),
        (nn.ELU(), "elu"),
        (nn.SELU(), "elu"),
        (nn.Tanh(), "tanh"),
        (nn.Sigmoid(), "sigmoid"),
        (nn.LogSigmoid(), None),
        (nn.Softmax(-1), None),
        (nn.Tanhshrink(), None),
        (nn.GLU(), None),
        (nn.PixelUnshuffle(2), None),  # 'pixELUnshuffle' is not an ELU
        (nn.Linear(2, 2), None),
        (nn.Sequential(nn.Linear(2, 2), nn.ReLU()), None),  # a block containing an activation is not one
    ],
)
def test_kind_from_class_name(module, kind):
    assert kind_of_module(module) == kind


def test_hugging_face_style_class_names():
    class NewGELUActivation(nn.Module):
        def forward(self, x):
            return x

    class ReLUSquaredActivation(nn.Module):
        def forward(self, x):
            return x

    assert kind_of_module(NewGELUActivation()) == "gelu"
    assert kind_of_module(ReLUSquaredActivation()) == "relu"


def test_zero_count_alive_units_and_dead_fraction():
    y = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]], [[0.0, 2.0, 0.0], [0.0, 0.0, 3.0]]])  # (2, 2, 3)
    assert zero_count(y).item() == 9
    zeros, alive = zeros_and_alive(y)
    assert zeros.item() == 9 and alive.tolist() == [False, True, True]
    assert alive_units(y).tolist() == [False, True, True]
    assert dead_fraction(alive_units(y)).item() == pytest.approx(1 / 3)
    assert dead_fraction(torch.zeros(0, dtype=torch.bool)).item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zeros_and_alive_equal_the_separate_readings_on_relu_and_gelu_outputs(dtype):
    # ReLU outputs (zeros at random positions), a dead unit, signed zeros, nan and inf: the same counts and units
    torch.manual_seed(0)
    for y in (torch.relu(torch.randn(3, 64, 257)), torch.nn.functional.gelu(torch.randn(3, 64, 257))):
        y = y.to(dtype)
        y[..., 7] = 0.0  # a dead unit
        y[0, 0, :4] = torch.tensor([-0.0, float("nan"), float("inf"), 0.0], dtype=dtype)
        zeros, alive = zeros_and_alive(y)
        assert zeros.item() == zero_count(y).item() == (y == 0).sum().item()
        assert torch.equal(alive, alive_units(y)) and not alive[7] and alive[1]


def test_saturation_of_tanh_and_sigmoid_is_read_from_the_output():
    x = torch.tensor([-10.0, -1.0, 0.0, 1.0, 10.0])
    # tanh'(x) = 1 - tanh(x)^2 < 0.01 only at +-10
    assert saturated_count("tanh", x, torch.tanh(x), 0.01).item() == 2
    assert saturated_count("sigmoid", x, torch.sigmoid(x), 0.01).item() == 2
    assert saturated_count("relu", x, torch.relu(x), 0.01) is None


@pytest.mark.parametrize("kind", ["gelu", "silu", "mish"])
def test_tail_cutoff_is_where_the_gradient_falls_below_the_threshold(kind):
    cutoff = tail_cutoff(kind, 0.01)
    x = torch.tensor([cutoff - 0.05, cutoff + 0.05], dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(apply_activation(kind, x).sum(), x)
    assert abs(grad[0].item()) < 0.01 <= abs(grad[1].item())
    assert cutoff < -2.0  # a tail, not the zero of GELU's derivative near -0.75


def test_gelu_saturation_counts_the_negative_tail_only():
    pre = torch.tensor([-20.0, -5.0, -0.75, 0.0, 5.0])
    out = torch.nn.functional.gelu(pre)
    assert saturated_count("gelu", pre, out, 0.01).item() == 2  # -20 and -5; not -0.75 where f'(x) ~ 0
    assert saturated_count("gelu", None, out, 0.01) is None  # needs the pre-activation


def test_tail_cutoff_rejects_kinds_without_a_tail():
    with pytest.raises(ValueError, match="no negative saturation tail"):
        tail_cutoff("relu", 0.01)


@pytest.mark.parametrize("kind", ACTIVATION_KINDS)
def test_apply_activation_matches_torch(kind):
    x = torch.linspace(-4, 4, 17)
    modules = {
        "relu": nn.ReLU(),
        "relu6": nn.ReLU6(),
        "leaky_relu": nn.LeakyReLU(),
        "elu": nn.ELU(),
        "gelu": nn.GELU(),
        "silu": nn.SiLU(),
        "mish": nn.Mish(),
        "tanh": nn.Tanh(),
        "sigmoid": nn.Sigmoid(),
    }
    torch.testing.assert_close(apply_activation(kind, x), modules[kind](x))
    with pytest.raises(ValueError, match="unknown activation kind"):
        apply_activation("swoosh", x)


def test_gelu_cutoff_value():
    assert tail_cutoff("gelu", 0.01) == pytest.approx(-3.07, abs=0.02)
    assert math.isfinite(tail_cutoff("silu", 0.001))


def test_zeros_and_alive_count_nan_as_alive_signed_zero_as_dead_and_handle_no_tokens():
    y = torch.tensor([[0.0, -0.0, float("nan"), -1.0], [0.0, 0.0, 0.0, 0.0]])
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        zeros, alive = zeros_and_alive(y.to(dtype))
        assert alive.tolist() == [False, False, True, True] and zeros.item() == 6.0
    zeros, alive = zeros_and_alive(torch.zeros(0, 4))
    assert alive.tolist() == [False] * 4 and zeros.item() == 0.0


def test_layer_counts_add_calls_up_and_reset():
    relu = LayerCounts("fc.act", "relu")
    relu.add(None, torch.tensor([[0.0, 1.0, 0.0], [0.0, 2.0, 3.0]]), 0.01)
    relu.add(None, torch.tensor([[0.0, 0.0, 0.0], [4.0, 0.0, 0.0]]), 0.01)  # called again in the same forward
    assert (relu.calls, relu.numel, relu.zeros.item(), relu.saturated) == (2, 12, 8.0, None)
    assert relu.alive.tolist() == [True, True, True]  # alive in either call
    tanh = LayerCounts("t", "tanh")
    tanh.add(None, torch.tensor([0.9999, 0.1, -1.0]), 0.01)
    assert (tanh.zeros, tanh.alive, tanh.saturated.item()) == (None, None, 2.0)  # no zeros for tanh
    relu.reset()
    assert (relu.calls, relu.numel, relu.zeros, relu.alive) == (0, 0, None, None)


def test_packed_counts_become_fractions_per_layer():
    relu, tanh, silent = LayerCounts("r", "relu"), LayerCounts("t", "tanh"), LayerCounts("s", "gelu")
    relu.add(None, torch.tensor([[0.0, 1.0], [0.0, 0.0]]), 0.01)
    tanh.add(None, torch.tensor([[1.0, 0.0]]), 0.01)
    sums, alive = pack_counts([relu, tanh, silent], [2, 0, 3], torch.device("cpu"))
    assert {k: float(v) for k, v in sums.items()} == {
        **{"zeros/r": 3.0, "saturated/r": 0.0, "elements/r": 4.0, "calls/r": 1.0},
        **{"zeros/t": 0.0, "saturated/t": 1.0, "elements/t": 2.0, "calls/t": 1.0},
        **{"zeros/s": 0.0, "saturated/s": 0.0, "elements/s": 0.0, "calls/s": 0.0},
    }
    # the silent layer's 3 units: zeros (alive elsewhere, maybe)
    assert {k: v.tolist() for k, v in alive.items()} == {"alive/r": [0.0, 1.0], "alive/t": [], "alive/s": [0.0] * 3}
    named = {k: torch.as_tensor(v, dtype=torch.float64) for k, v in sums.items()}
    fractions = {k: v.item() for k, v in layer_fractions([relu, tanh, silent], named, alive).items()}
    assert fractions == {
        "zero_frac/r": 0.75,
        "dead_frac/r": 0.5,
        "calls/r": 1.0,
        "saturated_frac/t": 0.5,
        "calls/t": 1.0,
        "zero_frac/s": 0.0,
        "dead_frac/s": 1.0,
        "saturated_frac/s": 0.0,
        "calls/s": 0.0,
    }
