"""Tests of the learning-rate scaling rules (adaptdl.torch.scaling_rules)."""

from __future__ import annotations

import math
import statistics
import warnings

import numpy as np
import pytest
import torch

from adaptdl.torch.parallel import AdaptiveDataParallel
from adaptdl.torch.scaling_rules import (
    AdamScale,
    AdaScale,
    LEGWScale,
    LinearScale,
    ScalingRuleBase,
    SqrtScale,
    available_scaling_rules,
    get_scaling_rule,
    register_scaling_rule,
)
from tests.torch._adp_helpers import FakeLoader, fake_loader, local_group

# Known statistics for two parameter groups: (sqr, var) = (1, 3) and (4, 0.5).
SQR = np.array([1.0, 4.0])
VAR = np.array([3.0, 0.5])


class TwoGroups(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(3))
        self.b = torch.nn.Parameter(torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :3] @ self.a + x[:, 3:] @ self.b


def _model_with_stats(rule: ScalingRuleBase, name: str) -> AdaptiveDataParallel:
    model = TwoGroups()
    optimizer = torch.optim.SGD([{"params": [model.a]}, {"params": [model.b], "lr": 0.5}], lr=0.1)
    adp = AdaptiveDataParallel(model, optimizer, scaling_rule=rule, name=name)
    state = adp.gns.state_dict()
    state["ema"] = [SQR.tolist(), [1.0, 1.0], VAR.tolist(), [1.0, 1.0]]
    adp.gns.load_state_dict(state)
    return adp


def test_every_rule_gives_exact_factors_for_known_statistics() -> None:
    scale = 4.0
    adascale = (VAR + SQR) / (VAR / scale + SQR)  # [4/1.75, 4.5/4.125]
    with local_group():
        ada = _model_with_stats(AdaScale(), "rules-ada").scaling_rule
        np.testing.assert_allclose(ada.scale_lr(scale), [4.0 / 1.75, 4.5 / 4.125])
        np.testing.assert_allclose(ada.scale_lr(1.0), [1.0, 1.0])
        adam = _model_with_stats(AdamScale(), "rules-adam").scaling_rule
        np.testing.assert_allclose(adam.scale_lr(scale), np.sqrt(adascale))
        assert _model_with_stats(LinearScale(), "rules-lin").scaling_rule.scale_lr(scale) == 4.0
        assert _model_with_stats(SqrtScale(), "rules-sqrt").scaling_rule.scale_lr(scale) == 2.0
        legw_adp = _model_with_stats(LEGWScale(2, 1000), "rules-legw")
        legw = legw_adp.scaling_rule
        # W = warmup epochs * S * data_size / B0 = 2 * 4 * 1000 / 100 = 80 iterations.
        with fake_loader(FakeLoader(batch_size=100, local_bsz=100)):
            legw_adp.gns.set_progress(20.0)
            assert legw.scale_lr(scale) == pytest.approx(2.0 * 20.0 / 80.0)
            legw_adp.gns.set_progress(200.0)
            assert legw.scale_lr(scale) == pytest.approx(2.0)
        with pytest.raises(RuntimeError, match="AdaptiveDataLoader"):
            legw.scale_lr(scale)
        # Variance floor 1e-6 and sqr clipped at 0 per group.
        state = legw_adp.gns.state_dict()
        state["ema"] = [[-1.0, 0.0], [1.0, 1.0], [-5.0, 2.0], [1.0, 1.0]]
        ada_adp = _model_with_stats(AdaScale(), "rules-ada-floor")
        ada_adp.gns.load_state_dict(state)
        np.testing.assert_allclose(ada_adp.scaling_rule.scale_lr(scale), [4.0, 4.0])


@pytest.mark.parametrize("rule", [AdaScale, AdamScale, LinearScale, SqrtScale, LEGWScale])
def test_scale_lr_names_a_bad_scale_and_takes_numpy_numbers(rule: type[ScalingRuleBase]) -> None:
    # They returned 1.000002 for S=-1, 0 with a warning for S=0, NaN for NaN,
    # or "math domain error"; gns.gain already named the scale.
    with local_group():
        made = rule(2, 1000) if rule is LEGWScale else rule()  # type: ignore[call-arg]
        adp = _model_with_stats(made, f"rules-bad-{rule.__name__}")
        with fake_loader(FakeLoader(batch_size=100, local_bsz=100)):
            for bad in (-1.0, 0.0, float("nan"), float("inf"), "2", True):
                with pytest.raises(ValueError, match=f"scale must be a finite number > 0.*{bad!r}"):
                    adp.scaling_rule.scale_lr(bad)  # type: ignore[arg-type]
            expected = np.asarray(adp.scaling_rule.scale_lr(4.0))
            for number in (np.float32(4.0), np.int64(4)):
                np.testing.assert_allclose(adp.scaling_rule.scale_lr(number), expected)  # type: ignore[arg-type]
        assert adp.gns.gain(np.float32(2.0)) == adp.gns.gain(2.0)
        adp.gns.set_progress(np.float32(3.0))  # type: ignore[arg-type]
        assert adp.gns.get_progress() == 3.0


def test_registry_by_name() -> None:
    assert available_scaling_rules() == ["adamscale", "adascale", "legw", "linear", "sqrt"]
    assert isinstance(get_scaling_rule("AdaScale"), AdaScale)
    assert isinstance(get_scaling_rule("sqrt"), SqrtScale)
    legw = get_scaling_rule("legw", base_warmup_epochs=1, data_size=10)
    assert isinstance(legw, LEGWScale) and legw.data_size == 10
    with pytest.raises(ValueError, match="adascale, legw, linear, sqrt"):
        get_scaling_rule("lars")
    # A rule that needs arguments says which, instead of Python's bare
    # "missing 2 required positional arguments" (scaling_rule="legw").
    expected = r"'legw' \(LEGWScale\(base_warmup_epochs, data_size\)\): missing"
    with pytest.raises(TypeError, match=expected):
        get_scaling_rule("legw")
    with pytest.raises(TypeError, match="missing a required argument: .base_warmup_epochs."):
        get_scaling_rule("legw", warmup=1, data_size=10)
    register_scaling_rule("linear", LinearScale)  # the same class again: harmless
    with pytest.raises(ValueError, match="scaling rule 'Linear' is built in"):
        register_scaling_rule("Linear", SqrtScale)
    with pytest.raises(ValueError, match="scaling rule name 'a b': expected a non-empty"):
        register_scaling_rule("a b", SqrtScale)
    with pytest.raises(TypeError, match="ScalingRuleBase"):
        register_scaling_rule("bogus", int)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="data_size"):
        LEGWScale(1, 0)
    with pytest.raises(TypeError, match="data_size must be an int, got float: 10.0"):
        LEGWScale(1, 10.0)  # type: ignore[arg-type]
    # numpy scalars, as from len() of some datasets or arithmetic on them
    assert LEGWScale(np.float64(1.5), np.int64(100)).data_size == 100
    with pytest.raises(ValueError, match="base_warmup_epochs"):
        LEGWScale(-1, 10)


def test_step_skips_accumulation_scales_lr_for_one_step_and_counts_progress() -> None:
    with local_group():
        adp = _model_with_stats(LinearScale(), "rules-step")
        optimizer = adp.optimizer
        loader = FakeLoader(batch_size=2, local_bsz=2, accumulation_steps=1)  # S = 2
        x = torch.ones(2, 5)
        with fake_loader(loader):
            optimizer.zero_grad()
            adp(x).mean().backward()
            optimizer.step()  # accumulation micro-batch: no update
            loader.advance()
            assert torch.count_nonzero(adp.module.a.detach()) == 0
            optimizer.zero_grad()  # kept: accumulation in progress
            assert adp.module.a.grad is not None
            adp(x).mean().backward()
            optimizer.step()
            loader.advance()
        # The mean gradient over both micro-batches is 1 per element (not their
        # sum, 2); the learning rates 0.1 and 0.5 are doubled by LinearScale.
        torch.testing.assert_close(adp.module.a.detach(), torch.full((3,), -0.2))
        torch.testing.assert_close(adp.module.b.detach(), torch.full((2,), -1.0))
        assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.5]
        assert adp.lr_factor == 2.0
        assert adp.gns.get_progress() == pytest.approx(adp.gain)
        assert adp.gain > 1.0


def test_lr_scheduler_before_or_after_adp_still_works() -> None:
    with local_group(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no "optimizer.step() overridden" warning
        for order in ("before", "after"):
            model = torch.nn.Linear(2, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
            if order == "before":
                scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
                adp = AdaptiveDataParallel(model, optimizer, scheduler, name=f"sched-{order}")
            else:
                adp = AdaptiveDataParallel(model, optimizer, name=f"sched-{order}")
                scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
            loader = FakeLoader(batch_size=4, local_bsz=4)
            with fake_loader(loader):
                for _ in range(3):
                    optimizer.zero_grad()
                    adp(torch.randn(4, 2)).sum().backward()
                    optimizer.step()
                    scheduler.step()
            assert optimizer.param_groups[0]["lr"] == pytest.approx(0.125), order
            assert adp.gns.get_progress() == pytest.approx(3.0, rel=1e-3), order


class NoisyQuadratic(torch.nn.Module):
    """Per-sample loss ``|w - xi|^2 / 2`` with ``xi ~ N(0, sigma^2 I)``; true loss ``|w|^2 / 2``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(10))

    def forward(self, xi: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((self.w - xi) ** 2).sum(dim=1)


def _steps_to_target(scale: int, target: float, seed: int) -> tuple[int, float]:
    """Optimizer steps (and progress) AdaScale needs at ``scale`` to reach ``target``."""
    torch.manual_seed(seed)
    model = NoisyQuadratic()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    adp = AdaptiveDataParallel(model, optimizer, name=f"quad-{scale}-{seed}")
    # Scale S as S accumulated micro-batches of B0 = 2 (an unbiased estimator).
    loader = FakeLoader(batch_size=2, local_bsz=2, accumulation_steps=scale - 1)
    steps = 0
    with fake_loader(loader):
        while steps < 1000:
            optimizer.zero_grad()
            adp(2.0 * torch.randn(2, 10)).mean().backward()
            optimizer.step()
            loader.advance()
            if not adp.gns.should_zero_grad:
                continue  # an accumulation micro-batch, not an optimizer step
            steps += 1
            if 0.5 * float(model.w.detach().square().sum()) <= target:
                break
    return steps, adp.gns.get_progress()


def test_adascale_reaches_the_same_loss_in_about_one_over_gain_the_steps() -> None:
    # Stationary loss of SGD at S = 1: lr * sigma^2 * d / (2 * B0 * (2 - lr)).
    floor = 0.1 * 4.0 * 10 / (2 * 2 * 1.9)
    target = 1.5 * floor
    scale = 4
    with local_group():
        base = [_steps_to_target(1, target, seed)[0] for seed in range(6)]
        scaled = [_steps_to_target(scale, target, seed) for seed in range(6)]
    base_steps = statistics.mean(base)
    scaled_steps = statistics.mean(steps for steps, _ in scaled)
    progress = statistics.mean(p for _, p in scaled)
    # Progress is the sum of gains: reaching the loss after T1 progress means
    # the number of steps was T1 / (mean gain).
    assert 0.7 * base_steps <= progress <= 1.3 * base_steps
    assert base_steps / scale <= scaled_steps < 0.6 * base_steps
    assert math.isfinite(progress)


def test_a_rule_written_for_the_original_base_class_may_assign_adp() -> None:
    # adp was a read-only property: "property 'adp' has no setter".
    class OriginalStyle(LinearScale):
        def __init__(self) -> None:
            self.adp = None
            super().__init__()

    rule = OriginalStyle()
    assert rule.adp is None
    assert rule.scale_lr(4.0) == 4.0
