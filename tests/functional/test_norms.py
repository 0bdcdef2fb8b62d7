import math

import torch

from lightning_tfdebug.functional.norms import group_sums, grouped_sq_norms, per_tensor_norms


def test_per_tensor_norms_match_torch_in_fp32_for_mixed_dtypes():
    tensors = [torch.randn(3, 4), torch.randn(5, dtype=torch.float16), torch.randn(0)]
    norms = per_tensor_norms(tensors)
    expected = torch.stack([t.float().norm() for t in tensors])
    assert norms.dtype == torch.float32
    torch.testing.assert_close(norms, expected)


def test_grouped_sq_norms_sum_per_group_with_weights_and_flag_nonfinite():
    a, b, c = torch.full((4,), 1.0), torch.full((9,), 2.0), torch.tensor([1.0, float("inf")])
    index = torch.tensor([0, 1, 0])
    group_sq, flags = grouped_sq_norms([a, b, c], index, 2, weights=torch.tensor([0.5, 1.0, 1.0]))
    assert group_sq[1].item() == 36.0  # 9 * 2^2
    assert math.isinf(group_sq[0].item())
    assert flags.tolist() == [0.0, 0.0, 1.0]
    finite_sq, _ = grouped_sq_norms([a, b], torch.tensor([0, 0]), 1, weights=torch.tensor([0.5, 1.0]))
    assert finite_sq.item() == 0.5 * 4 + 36


def test_group_sums_buckets():
    out = group_sums(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2, 0, 2]), 3)
    assert out.tolist() == [2.0, 0.0, 4.0]
