"""Tests of AdaptiveDataParallel (adaptdl.torch.parallel)."""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist

import adaptdl.torch as adl
from adaptdl import checkpoint
from adaptdl.testing import run_elastic
from adaptdl.torch.data import AdaptiveDataLoader
from adaptdl.torch.gradient_noise_scale import AdamGradientNoiseScale, GradientNoiseScale
from adaptdl.torch.parallel import AdaptiveDataParallel
from adaptdl.torch.scaling_rules import AdamScale, AdaScale, SqrtScale
from tests.torch._adp_helpers import FakeLoader, fake_loader, local_group


def _regression_data(n: int = 1000) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 2, generator=generator)
    y = x @ torch.tensor([3.0, 4.0]) + 0.1 * torch.randn(n, generator=generator)
    return torch.utils.data.TensorDataset(x, y)


def _train_regression(epochs: int) -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[6], gamma=0.1)
    adp = AdaptiveDataParallel(model, optimizer, scheduler, name="regression")
    loader = AdaptiveDataLoader(_regression_data(), batch_size=32, shuffle=True)
    for _ in adl.remaining_epochs_until(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(adp(x).squeeze(-1), y)
            loss.backward()
            optimizer.step()
        scheduler.step()
    assert math.isfinite(adp.gns.sqr_avg()) and math.isfinite(adp.gns.var_avg())
    return model.weight.detach().squeeze(0)


def test_single_replica_linear_regression_converges() -> None:
    with local_group():
        weight = _train_regression(epochs=8)
    torch.testing.assert_close(weight, torch.tensor([3.0, 4.0]), atol=0.1, rtol=0)


def _train_with_closure(optimizer_class: type[torch.optim.Optimizer], epochs: int) -> Any:
    """Train like _train_regression, but through ``optimizer.step(closure)``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1, bias=False)
    optimizer = optimizer_class(model.parameters(), lr=0.1)
    adp = AdaptiveDataParallel(model, optimizer, name="closure")
    loader = AdaptiveDataLoader(_regression_data(), batch_size=32, shuffle=True)
    losses = []
    for _ in adl.remaining_epochs_until(epochs):
        for x, y in loader:

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(adp(x).squeeze(-1), y)
                loss.backward()
                return loss

            losses.append(float(optimizer.step(closure).detach()))
    return model.weight.detach().squeeze(0), losses, adp.gns._measurements


@pytest.mark.parametrize(
    ("optimizer_class", "epochs"), [(torch.optim.SGD, 3), (torch.optim.LBFGS, 1)]
)
def test_a_step_closure_trains_on_one_replica(
    optimizer_class: type[torch.optim.Optimizer], epochs: int
) -> None:
    # It failed with ZeroDivisionError: the step's statistics were folded in
    # before the closure had run its backward pass. And LBFGS's further
    # evaluations opened windows of their own, so no step was ever measured.
    with local_group():
        weight, losses, measurements = _train_with_closure(optimizer_class, epochs)
    assert len(losses) == epochs * math.ceil(1000 / 32)
    steps = len(losses)
    assert measurements >= steps // 8 - 1  # one step in measure_every=8, as without a closure
    assert losses[-1] < 0.05 < losses[0]  # each value is the loss the step began with
    torch.testing.assert_close(weight, torch.tensor([3.0, 4.0]), atol=0.1, rtol=0)


def test_a_step_closure_with_a_grad_scaler_is_refused() -> None:
    with local_group():
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        adp = AdaptiveDataParallel(model, optimizer, mp_scaler=scaler, name="scaled-closure")
        loader = AdaptiveDataLoader(_regression_data(64), batch_size=32)
        for x, y in loader:

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(adp(x).squeeze(-1), y)
                scaler.scale(loss).backward()
                return loss

            with pytest.raises(RuntimeError, match="not supported with an enabled GradScaler"):
                optimizer.step(closure)
            break


def _two_replica_regression() -> list[float]:
    adl.init_process_group("gloo")
    try:
        return _train_regression(epochs=8).tolist()
    finally:
        dist.destroy_process_group()


def test_two_replica_linear_regression_converges_identically() -> None:
    result = run_elastic(_two_replica_regression, 2, timeout=120)
    first, second = result.final.results
    assert first == second  # DDP keeps the replicas in lockstep
    torch.testing.assert_close(torch.tensor(first), torch.tensor([3.0, 4.0]), atol=0.1, rtol=0)


class _Twins(NamedTuple):
    """A DDP model and an ADP copy of it, their optimizers and one plain loader."""

    ddp: torch.nn.Module
    ddp_opt: torch.optim.Optimizer
    adp: AdaptiveDataParallel
    adp_opt: torch.optim.Optimizer
    loader: torch.utils.data.DataLoader[Any]

    def max_diff(self) -> float:
        """The largest difference between the two models' parameters."""
        pairs = zip(self.adp.module.parameters(), self.ddp.module.parameters())
        return max(float((a - b).abs().max()) for a, b in pairs)


def _twins(name: str, samples: int, momentum: float) -> _Twins:
    """Same weights, same optimizer settings, and this rank's own data (call in a group)."""
    torch.manual_seed(0)
    reference = torch.nn.Linear(4, 1)
    model = torch.nn.Linear(4, 1)
    model.load_state_dict(reference.state_dict())
    ddp_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=momentum)
    adp_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    generator = torch.Generator().manual_seed(dist.get_rank())
    data = torch.utils.data.TensorDataset(
        torch.randn(samples, 4, generator=generator), torch.randn(samples, generator=generator)
    )
    return _Twins(
        torch.nn.parallel.DistributedDataParallel(reference),
        ddp_opt,
        AdaptiveDataParallel(model, adp_opt, name=name),
        adp_opt,
        torch.utils.data.DataLoader(data, batch_size=8),
    )


def _plain_loader_vs_ddp() -> dict[str, object]:
    """Train ADP and DDP side by side on the same plain DataLoader batches."""
    adl.init_process_group("gloo")
    try:
        twins = _twins("plain", samples=40, momentum=0.9)
        adp = twins.adp
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x, y in twins.loader:
                for net, opt in ((twins.ddp, twins.ddp_opt), (adp, twins.adp_opt)):
                    opt.zero_grad()
                    torch.nn.functional.mse_loss(net(x).squeeze(-1), y).backward()
                    opt.step()
        plain_warnings = [
            w for w in caught if "outside an adaptdl.torch.AdaptiveDataLoader" in str(w.message)
        ]
        return {
            "max_diff": twins.max_diff(),
            "warnings": len(plain_warnings),
            "progress": adp.gns.get_progress(),
            "ema_untouched": bool((adp.gns._ema == 0).all()),
            "gain": adp.gain,
            "lr_factor": adp.lr_factor,
        }
    finally:
        dist.destroy_process_group()


def test_training_with_a_plain_dataloader_is_exactly_ddp() -> None:
    result = run_elastic(_plain_loader_vs_ddp, 2, timeout=120)
    for replica in result.final.results:
        assert replica["max_diff"] == 0.0  # same updates as DDP: scale 1, factor 1
        assert replica["warnings"] == 1  # once, not per step
        assert replica["progress"] == 5.0  # one iteration per step (gain 1)
        assert replica["ema_untouched"]  # no noise measured at an unknown scale
        assert replica["gain"] == 1.0 and replica["lr_factor"] == 1.0


def _plain_no_sync_accumulation_vs_ddp() -> float:
    """Accumulate two micro-batches under ``no_sync()`` in ADP and in DDP."""
    adl.init_process_group("gloo")
    try:
        twins = _twins("plain-accumulation", samples=48, momentum=0.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for index, (x, y) in enumerate(twins.loader):
                last = index % 2 == 1
                for net, opt in ((twins.ddp, twins.ddp_opt), (twins.adp, twins.adp_opt)):
                    if last:
                        torch.nn.functional.mse_loss(net(x).squeeze(-1), y).backward()
                        opt.step()
                        opt.zero_grad()
                    else:
                        with net.no_sync():
                            torch.nn.functional.mse_loss(net(x).squeeze(-1), y).backward()
        return twins.max_diff()
    finally:
        dist.destroy_process_group()


def test_no_sync_accumulation_with_a_plain_dataloader_sums_like_ddp() -> None:
    # It averaged the micro-batches (the adaptive loader's convention), so
    # every step moved half as far as DDP's.
    result = run_elastic(_plain_no_sync_accumulation_vs_ddp, 2, timeout=120)
    assert result.final.results == [0.0, 0.0]


def test_backprop_outside_a_loader_then_the_first_loader_trains() -> None:
    with local_group():
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        adp = AdaptiveDataParallel(model, optimizer, name="outside")
        with pytest.warns(UserWarning, match="Iterate over an AdaptiveDataLoader") as caught:
            adp(torch.randn(3, 2)).sum().backward()
        # Attributed to the line that called backward(), not to AdaptDL's hook.
        assert [w.filename for w in caught] == [__file__]
        optimizer.step()
        with torch.no_grad():
            adp(torch.randn(3, 2))  # evaluation outside a loader is fine
        loader = FakeLoader(batch_size=3, local_bsz=3)
        loader.training = False
        with fake_loader(loader):
            optimizer.zero_grad()
            adp(torch.randn(3, 2)).sum().backward()
            assert not adp._plain_step and adp.gns.measuring_enabled
        assert loader.training


def test_default_scaling_rule_and_estimator_per_optimizer() -> None:
    with local_group():
        cases = [
            (torch.optim.SGD, None, AdaScale, GradientNoiseScale),
            (torch.optim.Adam, None, AdamScale, AdamGradientNoiseScale),
            (torch.optim.AdamW, None, AdamScale, AdamGradientNoiseScale),
            (torch.optim.Adam, AdaScale(), AdaScale, GradientNoiseScale),
            (torch.optim.SGD, "adamscale", AdamScale, AdamGradientNoiseScale),
            (torch.optim.SGD, SqrtScale(), SqrtScale, GradientNoiseScale),
        ]
        for index, (opt_class, rule, rule_class, gns_class) in enumerate(cases):
            model = torch.nn.Linear(2, 1)
            optimizer = opt_class(model.parameters(), lr=0.01)
            adp = AdaptiveDataParallel(model, optimizer, scaling_rule=rule, name=f"rule-{index}")
            assert type(adp.scaling_rule) is rule_class
            assert type(adp.gns) is gns_class
        with pytest.raises(TypeError, match="scaling_rule"):
            AdaptiveDataParallel(model, optimizer, scaling_rule=3, name="bad")  # type: ignore[arg-type]
        # The docs' example passes the rule third, in the lr_scheduler slot.
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        third = AdaptiveDataParallel(model, optimizer, SqrtScale(), name="third")  # type: ignore[arg-type]
        assert type(third.scaling_rule) is SqrtScale and third.lr_scheduler is None
        with pytest.raises(TypeError, match="pass one rule"):
            AdaptiveDataParallel(model, optimizer, AdaScale(), scaling_rule="sqrt", name="two")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="unknown scaling rule 'lars'"):
            AdaptiveDataParallel(model, optimizer, scaling_rule="lars", name="bad")
        with pytest.raises(TypeError, match="optimizer"):
            AdaptiveDataParallel(model, "sgd", name="bad")  # type: ignore[arg-type]
        # It failed deep inside DDP ('NoneType' object has no attribute ...).
        with pytest.raises(TypeError, match="model must be a torch.nn.Module, got None"):
            AdaptiveDataParallel(None, optimizer, name="bad")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="already registered"):
            AdaptiveDataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1), name="rule-0")
        # A second wrap of one optimizer (or of the wrapped model) applied the
        # learning-rate factor twice, S squared, without a word.
        with pytest.raises(RuntimeError, match="already driven by a SqrtScale"):
            AdaptiveDataParallel(model, optimizer, name="again")
        with pytest.raises(ValueError, match="model is already an AdaptiveDataParallel"):
            AdaptiveDataParallel(third, torch.optim.SGD(third.parameters(), lr=0.1), name="outer")
        # The slot after the optimizer is the scheduler: a GradScaler there
        # was taken for one and never unscaled the gradients.
        scaler = torch.amp.GradScaler("cpu")
        plain = torch.nn.Linear(2, 1)
        plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
        with pytest.raises(TypeError, match="is a GradScaler; pass it as mp_scaler="):
            AdaptiveDataParallel(plain, plain_opt, scaler, name="scaler")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="lr_scheduler must be an LR scheduler"):
            AdaptiveDataParallel(plain, plain_opt, plain_opt, name="opt")  # type: ignore[arg-type]
        # A failed construction leaves the new model's optimizer untouched,
        # so a retry under another name works.
        fresh = torch.nn.Linear(2, 1)
        fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
        bound = adp.scaling_rule
        for kwargs in ({"name": "rule-0"}, {"name": "other", "scaling_rule": bound}):
            with pytest.raises((ValueError, RuntimeError), match="already"):
                AdaptiveDataParallel(fresh, fresh_opt, **kwargs)  # type: ignore[arg-type]
            assert "step" not in vars(fresh_opt) and "zero_grad" not in vars(fresh_opt)
        retry = AdaptiveDataParallel(fresh, fresh_opt, name="retry")
        loader = FakeLoader(batch_size=2, local_bsz=2)
        with fake_loader(loader):
            fresh_opt.zero_grad()
            retry(torch.randn(2, 2)).sum().backward()
            fresh_opt.step()


def test_requires_a_process_group() -> None:
    model = torch.nn.Linear(2, 1)
    with pytest.raises(RuntimeError, match="init_process_group"):
        AdaptiveDataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_accumulation_skips_sync_and_averages_micro_batches() -> None:
    with local_group():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        reference = torch.nn.Linear(4, 1)
        reference.load_state_dict(model.state_dict())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        adp = AdaptiveDataParallel(model, optimizer, name="accumulate")
        loader = FakeLoader(batch_size=4, local_bsz=4, accumulation_steps=2)
        batches = [torch.randn(4, 4) for _ in range(3)]
        syncs = []
        with fake_loader(loader):
            optimizer.zero_grad()
            for batch in batches:
                adp(batch).square().mean().backward()
                syncs.append(adp.require_backward_grad_sync)
                optimizer.step()
                optimizer.zero_grad()  # ignored until the last micro-batch stepped
                loader.advance()
                if len(syncs) < 3:
                    assert adp.gns.accum_count == len(syncs)
        assert syncs == [False, False, True]
        # After the optimizer step zero_grad cleared the gradients; recompute the
        # expectation: the mean gradient over all 12 samples.
        reference(torch.cat(batches)).square().mean().backward()
        with fake_loader(loader):
            for batch in batches:
                adp(batch).square().mean().backward()
                loader.advance()
        for param, expected in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad, expected.grad)


@pytest.mark.parametrize(
    ("every_micro_batch", "enabled", "warns"),
    [(True, True, True), (False, True, False), (True, False, False)],
)
def test_scaler_stepping_on_accumulation_micro_batches_warns_once(
    every_micro_batch: bool, enabled: bool, warns: bool
) -> None:
    with local_group():
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        # GradScaler(enabled=use_amp) is the usual idiom: disabled, it scales nothing.
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0, enabled=enabled)
        name = f"amp-{every_micro_batch}-{enabled}"
        adp = AdaptiveDataParallel(model, optimizer, mp_scaler=scaler, name=name)
        loader = FakeLoader(batch_size=4, local_bsz=4, accumulation_steps=2)
        with fake_loader(loader), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(6):
                scaler.scale(adp(torch.randn(4, 3)).mean()).backward()
                if every_micro_batch or loader.is_optim_step():
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad()
                loader.advance()
        found = [w for w in caught if "is_optim_step()" in str(w.message)]
        assert len(found) == (1 if warns else 0)
        if found:
            assert "GradScaler is enabled" in str(found[0].message)
            assert found[0].filename == __file__  # the user's line, not adaptdl's


def test_checkpoint_round_trip_restores_everything(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path))

    def build() -> AdaptiveDataParallel:
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        return AdaptiveDataParallel(model, optimizer, scheduler, scaler, name="round-trip")

    with local_group():
        torch.manual_seed(1)
        adp = build()
        loader = FakeLoader(batch_size=4, local_bsz=8)  # scale 2, gain > 1
        with fake_loader(loader):
            for _ in range(12):
                adp.optimizer.zero_grad()
                loss = adp(torch.randn(8, 3) + 1.0).mean()
                adp.mp_scaler.scale(loss).backward()
                adp.mp_scaler.step(adp.optimizer)
                adp.mp_scaler.update()
                adp.lr_scheduler.step()
        saved = {
            "weight": adp.module.weight.detach().clone(),
            "exp_avg_sq": adp.optimizer.state[adp.module.weight]["exp_avg_sq"].clone(),
            "lr": adp.optimizer.param_groups[0]["lr"],
            "scale": adp.mp_scaler.get_scale(),
            "gns": adp.gns.state_dict(),
            "gain": adp.gain,
        }
        assert saved["gain"] > 1.0
        checkpoint.save_all_states()
        checkpoint.clear_registry()
        monkeypatch.setenv("ADAPTDL_NUM_RESTARTS", "1")
        torch.manual_seed(2)
        restored = build()
        torch.testing.assert_close(restored.module.weight.detach(), saved["weight"])
        state = restored.optimizer.state[restored.module.weight]
        torch.testing.assert_close(state["exp_avg_sq"], saved["exp_avg_sq"])
        assert restored.optimizer.param_groups[0]["lr"] == pytest.approx(saved["lr"])
        assert restored.mp_scaler.get_scale() == saved["scale"]
        restored_gns = restored.gns.state_dict()
        assert restored_gns.pop("prev_step") is None is saved["gns"].pop("prev_step")
        assert restored_gns == saved["gns"]
        assert restored.gns.sqr_avg() == adp.gns.sqr_avg()
        assert restored.gns.var_avg() == adp.gns.var_avg()
        assert restored.gns.get_progress() == adp.gns.get_progress() > 0
        assert restored.gain == saved["gain"]


class _Writer:
    def __init__(self) -> None:
        self.scalars: dict[str, tuple[float, int]] = {}

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars[tag] = (value, step)


def test_to_tensorboard_zero_grad_and_bf16_autocast() -> None:
    with local_group():
        model = torch.nn.Linear(8, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        adp = AdaptiveDataParallel(model, optimizer, name="tensorboard")
        adp.gns.measure_every = 1  # four steps only: measure each of them
        loader = FakeLoader(batch_size=4, local_bsz=4)
        with fake_loader(loader):
            for _ in range(4):
                optimizer.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = adp(torch.randn(4, 8)).float().square().mean()
                loss.backward()
                optimizer.step()
        assert math.isfinite(adp.gns.sqr_avg()) and adp.gns.var_avg() > 1e-6
        writer = _Writer()
        adp.to_tensorboard(writer, 7, tag_prefix="Train")  # "/" added, as the original did
        assert "Train/Gain" in writer.scalars and "TrainGain" not in writer.scalars
        writer = _Writer()
        adp.to_tensorboard(writer, 7, tag_prefix="Train/")
        assert set(writer.scalars) == {
            f"Train/{name}"
            for name in (
                "Gradient_Norm_Sqr",
                "Gradient_Variance",
                "Gain",
                "Learning_Rate_Factor",
                "Accum_Scale",
                "Accum_Count",
                "Progress",
            )
        }
        assert writer.scalars["Train/Progress"] == (pytest.approx(4.0), 7)
        with pytest.warns(UserWarning, match="optimizer.zero_grad"):
            adp.zero_grad()
        assert model.weight.grad is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            adp.gns.sqr_avg()


class _Branchy(torch.nn.Module):
    """A model with a parameter that gets no gradient (an unused branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(4, 1)
        self.unused = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_unused_parameters_do_not_merge_accumulation_micro_batches() -> None:
    with local_group():
        model = _Branchy()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        adp = AdaptiveDataParallel(model, optimizer, name="branchy", find_unused_parameters=True)
        loader = FakeLoader(batch_size=4, local_bsz=4, accumulation_steps=2)
        with fake_loader(loader):
            for step in range(6):
                optimizer.zero_grad()
                adp(torch.randn(4, 4)).square().mean().backward()
                # Each micro-batch is counted, although 2 of 4 parameters
                # never receive a gradient.
                assert adp.gns.accum_count == step % 3 + 1
                optimizer.step()
                loader.advance()


_Frozen = tuple[
    torch.nn.Linear, torch.optim.SGD, AdaptiveDataParallel, torch.Tensor, AdaptiveDataLoader
]


def _frozen_linear(name: str) -> _Frozen:
    """A 2-to-1 linear model whose SGD step keeps the weights (lr 0), and 5 samples."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    adp = AdaptiveDataParallel(model, optimizer, name=name)
    inputs = torch.randn(5, 2)
    loader = AdaptiveDataLoader(torch.utils.data.TensorDataset(inputs), batch_size=1)
    return model, optimizer, adp, inputs, loader


def _step_collecting_grads(
    model: torch.nn.Linear,
    optimizer: Any,
    adp: Any,
    helper: Any,
    batch: torch.Tensor,
    grads: list[torch.Tensor],
) -> None:
    """One training step; on an optimizer step, append the weight gradient it applies."""
    optimizer.zero_grad()
    adp(batch).square().sum().backward()
    if helper.is_optim_step():
        assert model.weight.grad is not None
        grads.append(model.weight.grad.clone())
    optimizer.step()


def _mean_grad(model: torch.nn.Linear, samples: torch.Tensor) -> torch.Tensor:
    """The gradient of the mean squared output over ``samples``, on a copy of ``model``."""
    reference = torch.nn.Linear(2, 1, bias=False)
    reference.load_state_dict(model.state_dict())
    (reference(samples).square().sum() / len(samples)).backward()
    assert reference.weight.grad is not None
    return reference.weight.grad


class _LoopError(Exception):
    """Leaves a training loop by an exception, carrying what it saw."""

    def __init__(self, grads: list[torch.Tensor]) -> None:
        super().__init__("leaving the loop")
        self.grads = grads


def test_incomplete_accumulation_is_discarded_when_a_loop_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with local_group():
        model, optimizer, adp, inputs, loader = _frozen_linear("leftover")
        helper = loader._elastic
        # Two micro-batches of one sample per optimizer step: a pass of five
        # samples ends in the middle of its third step.
        monkeypatch.setattr(helper, "_decide", lambda: (1, 1))
        helper.train()

        def run_loop(stop_after: int | None = None, fail: bool = False) -> list[torch.Tensor]:
            grads: list[torch.Tensor] = []
            for i, (batch,) in enumerate(loader):
                _step_collecting_grads(model, optimizer, adp, helper, batch, grads)
                if i + 1 == stop_after:
                    if fail:
                        raise _LoopError(grads)
                    break
            return grads

        def expected(first: int) -> torch.Tensor:
            return _mean_grad(model, inputs[first : first + 2])

        # The pass ends after the first micro-batch of a step; the break and
        # the exception leave after the first micro-batch of the second step.
        for stop_after, fail in ((None, False), (3, False), (3, True)):
            try:
                grads = run_loop(stop_after, fail)
            except _LoopError as exc:
                grads = exc.grads
            assert len(grads) == (2 if stop_after is None else 1)
            torch.testing.assert_close(grads[0], expected(0))
            # The incomplete step's gradients are gone, nothing is pending.
            assert model.weight.grad is None
            assert adp.gns.accum_count == 0 and adp.gns.should_zero_grad
            assert adp.require_backward_grad_sync
        # The next loop's first step averages its own two micro-batches only.
        grads = run_loop(2)
        assert len(grads) == 1
        torch.testing.assert_close(grads[0], expected(0))


def test_a_new_accumulation_count_at_a_pass_start_discards_the_incomplete_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with local_group():
        model, optimizer, adp, inputs, loader = _frozen_linear("switch-accumulation")
        loader.autoscale_batch_size(8, gradient_accumulation=True)
        helper = loader._elastic
        # Two micro-batches per step in the first pass (which ends in the
        # middle of its third step), three in the second; same local size.
        monkeypatch.setattr(
            helper, "_decide", lambda: (1, 1) if helper._state.current_index < 5 else (1, 2)
        )
        grads: list[torch.Tensor] = []
        for (batch,) in loader:
            _step_collecting_grads(model, optimizer, adp, helper, batch, grads)
            if len(grads) == 3:
                break
        assert helper.accumulation_steps == 2
        # The second pass's first step: samples 0, 1 and 2 of the next cycle,
        # without the leftover micro-batch of the first pass.
        torch.testing.assert_close(grads[2], _mean_grad(model, inputs[:3]))


@pytest.mark.parametrize("unused", [False, True])
def test_sync_time_is_measured_with_parameters_that_get_no_gradient(
    unused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, one parameter without a gradient meant no sync time was ever
    # reported, and the performance model saw no network time at all.
    from adaptdl.torch import parallel

    reported: list[float] = []
    monkeypatch.setattr(parallel._metrics, "profile_sync_time", reported.append)
    with local_group():
        torch.manual_seed(0)
        model = _Branchy()
        if not unused:
            model.unused.requires_grad_(False)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=0.1)
        adp = AdaptiveDataParallel(model, opt, name=f"heads{unused}", find_unused_parameters=unused)
        loader = FakeLoader(batch_size=4, local_bsz=4)
        with fake_loader(loader):
            for _ in range(5):
                opt.zero_grad()
                adp(torch.randn(4, 4)).pow(2).mean().backward()
                opt.step()
                loader.advance()
    assert len(reported) == 5 and all(t >= 0 for t in reported)


def test_a_step_before_any_backward_is_a_no_op() -> None:
    # It divided by zero in the noise estimator (one replica); plain PyTorch
    # skips parameters without gradients.
    with local_group():
        model = torch.nn.Linear(4, 1)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        adp = AdaptiveDataParallel(model, optimizer, name="empty-step")
        fresh = (adp.gns.sqr_avg(), adp.gns.var_avg())
        optimizer.step()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert (adp.gns.sqr_avg(), adp.gns.var_avg()) == fresh


def test_an_optimizer_or_scheduler_of_something_else_is_refused() -> None:
    with local_group():
        model, other = torch.nn.Linear(4, 1), torch.nn.Linear(4, 2)
        wrong = torch.optim.SGD(other.parameters(), lr=0.1)
        with pytest.raises(
            ValueError,
            match=r"optimizer updates 2 tensor\(s\) that are not parameters of the model "
            r"\(group 0 shape \[2, 4\], group 0 shape \[2\]\)",
        ):
            AdaptiveDataParallel(model, wrong, name="wrong-opt")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(wrong, 1)
        with pytest.raises(ValueError, match="schedules another optimizer"):
            AdaptiveDataParallel(model, optimizer, scheduler, name="wrong-sched")
        # A subset of the model's parameters (frozen layers) is fine.
        part = torch.optim.SGD([model.weight], lr=0.1)
        AdaptiveDataParallel(model, part, name="subset")


def test_a_parameter_group_added_after_wrapping_is_named_at_the_first_step() -> None:
    # The default rule failed with "AdaScale.scale_lr returned 1 factors for 2
    # parameter groups", and the first restart could never load the optimizer.
    with local_group():
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1)
        adp = AdaptiveDataParallel(model, optimizer, name="late-group")
        optimizer.add_param_group({"params": model[1].parameters(), "lr": 0.05})
        with fake_loader(FakeLoader(batch_size=4, local_bsz=4)):
            optimizer.zero_grad()
            adp(torch.randn(4, 4)).sum().backward()
            with pytest.raises(RuntimeError, match="has 2 parameter groups but had 1 when"):
                optimizer.step()


def test_a_failed_construction_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    # A checkpoint of another model made load_state raise after the name was
    # registered and the optimizer patched: a retry was refused ("already
    # registered"), and the next save wrote the failed model over the trained one.
    import adaptdl.torch.parallel as parallel_module

    def mismatched(state: object) -> bool:
        raise RuntimeError("size mismatch for weight")

    created: list[GradientNoiseScale] = []

    class Recorded(GradientNoiseScale):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            created.append(self)

    with local_group():
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        rule = AdaScale()
        monkeypatch.setattr(parallel_module, "GradientNoiseScale", Recorded)
        monkeypatch.setattr(parallel_module.checkpoint, "load_state", mismatched)
        with pytest.raises(RuntimeError, match="size mismatch"):
            AdaptiveDataParallel(model, optimizer, scaling_rule=rule, name="retry")
        assert "retry" not in [state.name for state in checkpoint.registered_states()]
        assert "step" not in optimizer.__dict__ and not hasattr(optimizer, "_adaptdl_rule")
        model(torch.ones(1, 4)).sum().backward()
        assert created and created[0]._fired == 0  # its gradient hooks are gone
        model.zero_grad()
        monkeypatch.undo()
        adp = AdaptiveDataParallel(model, optimizer, scaling_rule=rule, name="retry")
        assert rule.adp is adp and adp.gns._num_hooked == 2


def test_a_rule_subclass_that_skips_the_base_init_still_binds() -> None:
    # Rules written for the original library may not call super().__init__():
    # AttributeError: 'MyRule' object has no attribute '_adp'.
    class MyRule(AdaScale):
        def __init__(self, k: float) -> None:
            self.k = k

    with local_group():
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        adp = AdaptiveDataParallel(model, optimizer, scaling_rule=MyRule(1.0), name="subclass")
        assert adp.scaling_rule.adp is adp


def test_a_scaling_rule_passed_as_a_class_or_as_the_scheduler_is_named() -> None:
    with local_group():
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(TypeError, match=r"scaling_rule=AdaScale is a class; pass an instance"):
            AdaptiveDataParallel(model, optimizer, scaling_rule=AdaScale, name="cls")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"lr_scheduler=AdaScale is a scaling-rule class"):
            AdaptiveDataParallel(model, optimizer, AdaScale, name="pos")  # type: ignore[arg-type]
