"""The one outlier rule (torchfill/rows.py outliers), judged through both of its callers: the runner's FillPlan (per
chunk, any prompt of the batch) and the vLLM plugin's outlier_tokens (per request of a step)."""

import torch

from ridgefill.torchfill import FillPlan, IdentityFiller
from ridgefill.torchfill.rows import outliers
from ridgefill.backends.vllm.plugin.rows import outlier_tokens


def states(norms: torch.Tensor) -> torch.Tensor:
    """[B, nF] norms -> [B, nF, 4] split states with exactly those norms."""
    return norms.unsqueeze(-1) * torch.tensor([0.6, 0.0, 0.8, 0.0])


def test_the_median_is_the_lower_middle_of_the_groups_filled_rows():
    norms = torch.tensor([1.0, 2.0, 3.0, 4.0, 100.0])
    groups = torch.tensor([0, 0, 0, 0, 1])
    filled = torch.tensor([True, True, True, True, False])
    # lower median 2 -> 4 > 1.6 * 2 is an outlier (the mean of the middle two, 2.5, would make none); the full
    # row of group 1 is never judged, and no group median counts it
    assert outliers(norms, groups, filled, 1.6).tolist() == [False, False, False, True, False]
    assert not outliers(norms, groups, filled, 0.0).any()


def test_the_engine_and_the_vllm_plugin_pick_the_same_outliers():
    """Two prompts of a chunk's filled rows with crafted norms: the runner runs a row in full when it is an outlier
    in any prompt of the batch; the plugin, given the same rows as two requests, marks the same rows."""
    norms = torch.tensor([[1.0, 2.0, 9.0, 1.0, 2.0, 1.0],
                          [3.0, 3.0, 3.0, 3.0, 3.0, 30.0]])
    plan = FillPlan(IdentityFiller(1, 4), tail=1, outlier_factor=3.0)
    runner = plan.outlier_rows(states(norms))
    request = torch.arange(2).repeat_interleave(6)
    full = torch.zeros(12, dtype=torch.bool)
    plugin = outlier_tokens(norms.flatten(), request, full, 3.0).view(2, 6)
    assert runner.tolist() == [False, False, True, False, False, True]
    assert plugin.any(dim=0).tolist() == runner.tolist()
    assert plugin.tolist() == [[False, False, True, False, False, False], [False] * 5 + [True]]
