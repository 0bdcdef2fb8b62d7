import math

import pytest
import torch

from lightning_tfdebug.functional.finite import flagged_ranks, grads_nonfinite_flag, nonfinite_flag


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_flag_sees_nan_and_inf(value):
    assert nonfinite_flag(torch.tensor(value)).item() == 1.0
    assert nonfinite_flag(torch.tensor([1.0, value, 2.0])).item() == 1.0


def test_nonfinite_flag_is_zero_for_finite_values():
    flag = nonfinite_flag(torch.tensor([0.0, -3.0, 1e30]))
    assert flag.dtype == torch.float32 and flag.ndim == 0 and flag.item() == 0.0


def test_grads_nonfinite_flag_none_without_gradients():
    assert grads_nonfinite_flag([]) is None


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_grads_nonfinite_flag_finds_one_bad_element_among_many_tensors(bad):
    grads = [torch.randn(7, 5) for _ in range(20)]
    assert grads_nonfinite_flag(grads).item() == 0.0
    grads[13][4, 2] = bad
    assert grads_nonfinite_flag(grads).item() == 1.0


def test_grads_nonfinite_flag_fp16_large_but_finite_gradients_are_finite():
    # each element fits fp16, but the norm (about 3.2e5) would overflow if it were accumulated in fp16
    grads = [torch.full((1000,), 1e4, dtype=torch.float16)]
    assert math.isfinite(float(torch.stack([g.float().norm() for g in grads]).sum()))
    assert grads_nonfinite_flag(grads).item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grads_nonfinite_flag_leaves_every_gradient_bit_for_bit_unchanged(dtype):
    # the CPU check writes each gradient back times exactly 1.0: the values (signed zeros, subnormals, the largest
    # finite value, inf) must come back identical
    info = torch.finfo(dtype)
    special = torch.tensor([0.0, -0.0, info.tiny / 4, -info.max, info.max, 1.0 / 3.0], dtype=torch.float32).to(dtype)
    grads = [torch.randn(33, 7).to(dtype), special.clone(), torch.randn(5, 4).t().to(dtype)]  # one not contiguous
    before = [g.clone() for g in grads]
    assert grads_nonfinite_flag(grads).item() == 0.0
    for g, b in zip(grads, before):
        assert torch.equal(
            g.view(torch.int16 if dtype != torch.float32 else torch.int32),
            b.view(torch.int16 if dtype != torch.float32 else torch.int32),
        )
    grads[1][2] = float("inf")
    assert grads_nonfinite_flag(grads).item() == 1.0
    assert grads[1][2].item() == float("inf")


def test_grads_nonfinite_flag_mixed_dtypes_and_gradients_that_require_grad():
    mixed = [torch.randn(4), torch.randn(4).to(torch.bfloat16), torch.randn(4).to(torch.float16)]
    mixed[2][1] = float("nan")
    assert grads_nonfinite_flag(mixed).item() == 1.0
    # backward(create_graph=True): the gradient is part of a graph and must not be written in place
    w = torch.randn(3, requires_grad=True)
    (w**3).sum().backward(create_graph=True)
    assert w.grad is not None and w.grad.requires_grad
    version = w.grad._version
    assert grads_nonfinite_flag([w.grad]).item() == 0.0
    assert w.grad._version == version
    w.grad.sum().backward()  # the gradient of the gradient still works


def test_flagged_ranks_prefers_the_ranks_whose_loss_was_bad():
    # rank 1's loss went nan; its gradients reached every rank through the all-reduce
    assert flagged_ranks([_row(0, 1, 0), _row(1, 1, 0), _row(0, 1, 0)]) == ([1], [])


def test_flagged_ranks_falls_back_to_gradients_and_reports_frames_apart():
    assert flagged_ranks([_row(0, 1, 0), _row(0, 0, 1)]) == ([0], [1])
    assert flagged_ranks([_row(0.0, 0.0, 0.0)]) == ([], [])


def _row(loss: float, grad: float, frame: float) -> dict[str, float]:
    return {"loss": loss, "grad": grad, "frame": frame}


def test_step_finite_folds_many_losses_and_reads_gradients_only_when_asked():
    from lightning_tfdebug.functional.finite import StepFinite, any_flag, flag_fields

    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    check = StepFinite(params, check_gradients=True)
    assert not check.sharded and check.loss_flag() is None and check.grad_flag() is None  # no gradient yet
    for i in range(20):  # long gradient accumulation: the first 16 are folded into one flag on the way
        check.add_loss(torch.tensor(float("nan") if i == 3 else 1.0))
    assert check.folded is not None and len(check.losses) == 4 and bool(check.loss_flag())
    assert check.one_pass() is None  # folded losses: the separate flags decide
    check.reset()
    params[1].grad = torch.tensor([0.0, float("inf")])
    check.add_loss(torch.tensor(2.0))
    assert not bool(check.loss_flag()) and float(check.grad_flag()) == 1.0 and float(check.one_pass()) == 1.0
    assert StepFinite(params, check_gradients=False).grad_flag() is None
    row = flag_fields(torch.device("cpu"), check.loss_flag(), None, torch.tensor(1.0))
    assert {k: float(v) for k, v in row.items()} == {"loss": 0.0, "grad": 0.0, "frame": 1.0}
    assert any_flag(None, None, None, torch.device("cpu")) is None
    assert float(any_flag(torch.tensor(False), torch.tensor(1.0), None, torch.device("cpu"))) == 1.0
    assert float(any_flag(torch.tensor(False), torch.tensor(0.0), torch.tensor(0.0), torch.device("cpu"))) == 0.0
