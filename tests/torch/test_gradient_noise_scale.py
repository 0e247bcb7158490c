"""Tests of the gradient noise scale estimator (adaptdl.torch.gradient_noise_scale).

The accuracy tests use a model whose per-sample gradient does not depend on
the parameters: the output is ``x @ w`` and the loss its mean, so each
sample's gradient is ``x`` itself. Drawing ``x = mu + s * z`` with ``z``
standard normal gives a gradient with known mean ``mu`` and covariance
``s^2 I``, hence known ``|G|^2 = |mu|^2`` and ``tr(Sigma) = d s^2 / B0``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from adaptdl import checkpoint, env
from adaptdl.testing import run_elastic
from adaptdl.torch import _metrics
from adaptdl.torch.gradient_noise_scale import (
    AdamGradientNoiseScale,
    GradientNoiseScale,
    _GroupSums,
)
from adaptdl.torch.parallel import AdaptiveDataParallel
from tests.torch._adp_helpers import FakeLoader, fake_loader, local_group, train_step

DIM = 500
MU = 0.5
SIGMA = 1.0
LOCAL_BSZ = 4
STEPS = 400


class LinearProbe(torch.nn.Module):
    """``x @ w``: the per-sample gradient of the mean output is the sample itself."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


def _mean(output: torch.Tensor) -> torch.Tensor:
    return output.mean()


def _measure(
    replicas: int, accumulation: int, rank: int, steps: int = STEPS, clip: float | None = None
) -> tuple[float, float, int]:
    """Train the probe and return the estimates (sqr, var) and the micro-batch count.

    With ``clip``, the averaged gradient is clipped to that norm before each
    optimizer step, as users do with ``clip_grad_norm_``; the estimates must
    not change (the probe's gradients do not depend on the weights).
    """
    torch.manual_seed(1000 + rank)
    model = LinearProbe(DIM)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    adp = AdaptiveDataParallel(
        model, optimizer, name=f"gns-probe-{replicas}-{accumulation}", scaling_rule="adascale"
    )
    loader = FakeLoader(
        batch_size=LOCAL_BSZ * replicas, local_bsz=LOCAL_BSZ, accumulation_steps=accumulation - 1
    )
    mu = torch.full((DIM,), MU)
    seen_count = 0
    with fake_loader(loader):
        for _ in range(steps * accumulation):
            x = mu + SIGMA * torch.randn(LOCAL_BSZ, DIM)
            if clip is None:
                train_step(adp, optimizer, loader, x, _mean)
            else:
                optimizer.zero_grad()
                _mean(adp(x)).backward()
                if loader.is_optim_step():
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                loader.advance()
            seen_count = max(seen_count, adp.gns.accum_count)
    return adp.gns.sqr_avg(), adp.gns.var_avg(), seen_count


def _expected(replicas: int) -> tuple[float, float]:
    b0 = LOCAL_BSZ * replicas
    return DIM * MU**2, DIM * SIGMA**2 / b0


@pytest.mark.parametrize("accumulation", [1, 4])
def test_single_replica_estimates_within_5_percent(accumulation: int) -> None:
    with local_group():
        sqr, var, count = _measure(1, accumulation, rank=0)
    true_sqr, true_var = _expected(1)
    assert count == accumulation
    assert sqr == pytest.approx(true_sqr, rel=0.05)
    assert var == pytest.approx(true_var, rel=0.05)


def _replica_estimates(
    accumulations: list[int], clip: float | None = None
) -> list[tuple[float, float]]:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{env.master_port()}",
        rank=env.replica_rank(),
        world_size=env.num_replicas(),
    )
    try:
        results = []
        for accumulation in accumulations:
            sqr, var, _ = _measure(env.num_replicas(), accumulation, env.replica_rank(), clip=clip)
            results.append((sqr, var))
        return results
    finally:
        dist.destroy_process_group()


def test_four_replica_estimates_within_5_percent() -> None:
    result = run_elastic(_replica_estimates, 4, args=([1, 2],), timeout=150)
    per_rank = result.final.results
    true_sqr, true_var = _expected(4)
    for accumulation_results in per_rank:
        for sqr, var in accumulation_results:
            assert sqr == pytest.approx(true_sqr, rel=0.05)
            assert var == pytest.approx(true_var, rel=0.05)
    # Every replica holds the same statistics (they come from all-reduced values).
    flat = [[value for pair in rank_results for value in pair] for rank_results in per_rank]
    assert flat[0] == pytest.approx(flat[3], rel=1e-9)


def test_gradient_clipping_before_the_step_does_not_bias_the_estimates() -> None:
    # |G| is about 11 here: clipping to 0.1 rescales every step's gradient.
    result = run_elastic(_replica_estimates, 2, args=([1, 2], 0.1), timeout=150)
    true_sqr, true_var = _expected(2)
    for rank_results in result.final.results:
        for sqr, var in rank_results:
            assert sqr == pytest.approx(true_sqr, rel=0.05)
            assert var == pytest.approx(true_var, rel=0.05)
    with local_group():
        sqr, var, count = _measure(1, 4, rank=0, clip=0.1)
    assert count == 4
    assert sqr == pytest.approx(_expected(1)[0], rel=0.05)
    assert var == pytest.approx(_expected(1)[1], rel=0.05)


def test_accum_scale_change_resets_accumulation_and_gain_values() -> None:
    with local_group():
        model = LinearProbe(8)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        adp = AdaptiveDataParallel(model, optimizer, name="gns-accum-scale")
        gns = adp.gns
        assert gns.accum_scale == 1.0  # defaults to the number of replicas
        assert gns.gain(4.0) == pytest.approx(1.0, abs=1e-4)  # no statistics yet
        loader = FakeLoader(batch_size=4, local_bsz=4, accumulation_steps=1)
        with fake_loader(loader):
            adp(torch.randn(4, 8)).mean().backward()
            loader.advance()
            assert gns.accum_count == 1
            assert not gns.should_zero_grad
            assert model.w.grad is not None
            loader.current_local_bsz = 8  # the scale changes mid-accumulation
            adp(torch.randn(8, 8)).mean().backward()
            assert gns.accum_scale == 2.0
            assert gns.accum_count == 1  # the earlier micro-batch was discarded
        with pytest.raises(ValueError, match="accum_scale"):
            gns.set_accum_scale(0.0)
        with pytest.raises(ValueError, match="scale"):
            gns.gain(-1.0)
        # Known statistics: sqr = 1, var = 3 give r = (3 + 1) / (3 / S + 1).
        state = gns.state_dict()
        state["ema"] = [[1.0], [1.0], [3.0], [1.0]]
        gns.load_state_dict(state)
        assert gns.sqr_avg() == pytest.approx(1.0)
        assert gns.var_avg() == pytest.approx(3.0)
        assert gns.gain(4.0) == pytest.approx(4.0 / 1.75)
        assert gns.gain(1.0) == pytest.approx(1.0)
        gns.set_progress(12.5)
        assert gns.get_progress() == 12.5
        with pytest.raises(ValueError, match="progress"):
            gns.set_progress(math.nan)
        assert not gns.raw_sqr_avg.flags.writeable


def test_group_sums_add_per_group_in_float64() -> None:
    cpu = torch.device("cpu")
    empty = _GroupSums().total(3, cpu)
    assert empty.dtype == torch.float64 and empty.tolist() == [0.0, 0.0, 0.0]
    sums = _GroupSums()
    sums.add(2, torch.tensor(1.5))
    sums.add(0, torch.tensor(2.0))
    sums.add(2, torch.tensor(0.25, dtype=torch.float64))  # mixed dtypes
    total = sums.total(3, cpu)
    assert total.dtype == torch.float64 and total.tolist() == [2.0, 0.0, 1.75]
    one = _GroupSums()
    for value in (1e8, 1.0, -1e8):  # summed in float64, not float32
        one.add(0, torch.tensor(value, dtype=torch.float32))
    assert one.total(1, cpu).tolist() == [1.0]


def test_nan_loss_skips_update_and_keeps_hints_finite() -> None:
    with local_group():
        model = LinearProbe(16)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        adp = AdaptiveDataParallel(model, optimizer, name="gns-nan")
        adp.gns.measure_every = 1  # make the NaN step a measured one
        adp.gns.min_measurements = 1  # report the statistics from the start
        loader = FakeLoader(batch_size=4, local_bsz=4, max_batch_size=64)  # autoscaling on
        with fake_loader(loader):
            for _ in range(5):
                train_step(adp, optimizer, loader, 1.0 + torch.randn(4, 16), _mean)
            before = (adp.gns.sqr_avg(), adp.gns.var_avg())
            with pytest.warns(RuntimeWarning, match="non-finite"):
                train_step(adp, optimizer, loader, torch.full((4, 16), math.nan), _mean)
            assert (adp.gns.sqr_avg(), adp.gns.var_avg()) == before
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for _ in range(3):  # the differenced pair with the NaN step is skipped too
                    train_step(adp, optimizer, loader, 1.0 + torch.randn(4, 16), _mean)
        assert math.isfinite(adp.gns.sqr_avg()) and math.isfinite(adp.gns.var_avg())
        assert math.isfinite(adp.gain) and math.isfinite(adp.gns.get_progress())
        sqr, var = _metrics._state().grad_params["gns-nan"]
        assert math.isfinite(sqr) and math.isfinite(var)


@pytest.mark.parametrize("accumulation_steps", [0, 2])
def test_a_sparse_gradient_is_refused_with_what_to_change(accumulation_steps: int) -> None:
    # It failed deep inside a reshape ("reshape is not implemented for sparse tensors").
    class Embedded(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = torch.nn.Embedding(10, 3, sparse=True)

        def forward(self, index: torch.Tensor) -> torch.Tensor:
            return self.embedding(index)

    with local_group():
        model = Embedded()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        adp = AdaptiveDataParallel(model, optimizer, name=f"gns-sparse-{accumulation_steps}")
        adp.gns.measure_every = 1
        loader = FakeLoader(4, 4, accumulation_steps=accumulation_steps, max_batch_size=64)
        with (
            fake_loader(loader),
            pytest.raises(
                TypeError,
                match=r"shape \(10, 3\) got a torch.sparse_coo gradient.*use sparse=False",
            ),
        ):
            for _ in range(3):
                train_step(adp, optimizer, loader, torch.randint(0, 10, (4,)), _mean)


def test_statistics_reach_the_goodput_model_only_after_min_measurements() -> None:
    with local_group():
        model = LinearProbe(16)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        adp = AdaptiveDataParallel(model, optimizer, name="gns-ready")
        adp.gns.measure_every = 1
        adp.gns.min_measurements = 4
        loader = FakeLoader(batch_size=4, local_bsz=4, max_batch_size=64)  # autoscaling on
        measured = []
        with fake_loader(loader):
            for _ in range(12):
                train_step(adp, optimizer, loader, 1.0 + torch.randn(4, 16), _mean)
                measured.append(adp.gns.ready)
                if not adp.gns.ready:
                    assert "gns-ready" not in _metrics._state().grad_params
        # One replica, measuring every step: each step after the first is
        # paired with its predecessor, so the fourth measurement is step 5.
        assert measured.index(True) == 4
        assert "gns-ready" in _metrics._state().grad_params
        # The count survives a checkpoint; older checkpoints count as settled.
        state = adp.gns.state_dict()
        assert state["measurements"] >= 4
        adp.gns.load_state_dict({**state, "measurements": 2})
        assert not adp.gns.ready
        del state["measurements"]
        adp.gns.min_measurements = 100
        adp.gns.load_state_dict(state)
        assert adp.gns.ready


def test_the_gradient_one_replica_stored_for_the_next_step_survives_a_checkpoint() -> None:
    with local_group():
        model = LinearProbe(16)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        adp = AdaptiveDataParallel(model, optimizer, name="gns-prev")
        adp.gns.measure_every = 2  # store on odd steps, measure on even ones
        loader = FakeLoader(batch_size=4, local_bsz=4)
        with fake_loader(loader):
            for _ in range(3):  # measure (no partner yet), store, measure
                train_step(adp, optimizer, loader, 1.0 + torch.randn(4, 16), _mean)
            train_step(adp, optimizer, loader, 1.0 + torch.randn(4, 16), _mean)  # store
            state = adp.gns.state_dict()
            count = state["measurements"]
            assert state["prev_step"] is not None
            fresh = {**state, "prev_step": None}  # as a checkpoint without it

            def measured_after_load(saved: dict[str, Any]) -> int:
                adp.gns.load_state_dict(saved)
                train_step(adp, optimizer, loader, 1.0 + torch.randn(4, 16), _mean)
                return int(adp.gns.state_dict()["measurements"]) - count

            kept = [grad.clone() for grad in state["prev_step"]["grads"]]
            assert measured_after_load(state) == 1
            train_step(adp, optimizer, loader, 1.0 + torch.randn(4, 16), _mean)  # store again
            # Training did not write into the loaded state dict's tensors.
            assert all(torch.equal(a, b) for a, b in zip(kept, state["prev_step"]["grads"]))
            assert measured_after_load(fresh) == 0  # no partner: that measurement is lost
            # A stored gradient of another shape (another model) is dropped.
            other = {**state["prev_step"], "grads": [torch.zeros(3)]}
            assert measured_after_load({**state, "prev_step": other}) == 0


@pytest.mark.parametrize("accumulation_steps", [0, 1])
def test_grad_scaler_statistics_match_unscaled_and_zero_scale_is_harmless(
    accumulation_steps: int,
) -> None:
    # Without accumulation one replica uses the differenced estimator (all
    # from .grad, after unscaling); with it, the local terms come from the
    # gradient hooks, which see scaled gradients.
    def run(scaler: torch.amp.GradScaler | None, name: str) -> tuple[float, float]:
        torch.manual_seed(7)
        model = LinearProbe(32)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        adp = AdaptiveDataParallel(model, optimizer, mp_scaler=scaler, name=name)
        loader = FakeLoader(batch_size=4, local_bsz=4, accumulation_steps=accumulation_steps)
        with fake_loader(loader):
            for _ in range(40):
                optimizer.zero_grad()
                loss = adp(1.0 + torch.randn(4, 32)).mean()
                if scaler is None:
                    loss.backward()
                    optimizer.step()
                else:
                    scaler.scale(loss).backward()
                    if loader.is_optim_step():  # unscaling must wait for the last micro-batch
                        scaler.step(optimizer)
                        scaler.update()
                loader.advance()
        return adp.gns.sqr_avg(), adp.gns.var_avg()

    with local_group():
        plain = run(None, "gns-plain")
        scaled = run(torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=10**6), "s")
        assert scaled == pytest.approx(plain, rel=1e-6)
        assert plain[0] > 0 and plain[1] > 1e-3  # measured, not left at the defaults
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            zero = run(torch.amp.GradScaler("cpu", init_scale=0.0), "gns-zero-scale")
        assert all(math.isfinite(v) for v in zero)


def test_adam_noise_scale_preconditions_and_keeps_moments_on_scale_change() -> None:
    with local_group():
        torch.manual_seed(3)
        model = LinearProbe(16)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        adp = AdaptiveDataParallel(model, optimizer, name="gns-adam")
        assert isinstance(adp.gns, AdamGradientNoiseScale)
        loader = FakeLoader(batch_size=4, local_bsz=4)
        with fake_loader(loader):
            for _ in range(8):
                train_step(adp, optimizer, loader, 1.0 + torch.randn(4, 16), _mean)
            state = optimizer.state[model.w]
            moments = {k: v.clone() for k, v in state.items()}
            assert float(moments["step"]) == 8
            # The batch doubles: the scale changes and accumulation restarts ...
            loader.current_local_bsz = 8
            optimizer.zero_grad()
            adp(1.0 + torch.randn(8, 16)).mean().backward()
            assert adp.gns.accum_scale == 2.0
            # ... but Adam's moments are untouched (the original zeroed them).
            for key, value in moments.items():
                assert torch.equal(optimizer.state[model.w][key], value), key
            optimizer.step()
        assert float(optimizer.state[model.w]["step"]) == 9
        assert np.all(np.isfinite(adp.gns.raw_var_avg))
        # The preconditioner is sqrt(v_hat) + eps once Adam has taken 5 steps.
        precond = adp.gns._preconditioner(model.w)
        assert precond is not None
        v_hat = optimizer.state[model.w]["exp_avg_sq"] / (1 - 0.999**9)
        torch.testing.assert_close(precond, v_hat.sqrt() + 1e-8)


def test_adam_one_replica_pairs_both_gradients_in_this_steps_geometry() -> None:
    # The previous step's |p|^2 was taken with the previous step's
    # preconditioner, while |g|^2 and g.p used this step's: var came out ~9%
    # too high early in training.
    dim, steps = 20, 40
    rng = np.random.RandomState(0)
    mean = np.linspace(0.5, 2.0, dim)
    with local_group():
        model = torch.nn.Linear(dim, 1, bias=False).double()
        torch.nn.init.zeros_(model.weight)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        gns = AdamGradientNoiseScale(ddp, optimizer)
        gns.measure_every = 1
        biased, unbias, previous = 0.0, 0.0, None
        for _ in range(steps):
            grad = mean + 3.0 * rng.randn(dim)
            ddp(torch.tensor(grad)[None]).sum().backward()  # d/dw of w . grad
            precond = gns._preconditioner(model.weight)
            scale = np.ones(dim) if precond is None else precond.reshape(-1).numpy()
            gns._finalize()
            optimizer.step()
            gns.reset_accumulation()
            if previous is not None:
                a, b = previous / scale, grad / scale
                local = (a @ a + b @ b) / 2
                total = ((a + b) / 2) @ ((a + b) / 2)
                theta = 0.999**2.0  # S = 2: two B0-sized batches
                biased = theta * biased + (1 - theta) * 2 * (local - total)
                unbias = theta * unbias + (1 - theta)
            previous = grad
        assert gns.raw_var_avg[0] == pytest.approx(biased / unbias, rel=1e-9)
    checkpoint.clear_registry()


def test_on_a_gpu_every_replica_takes_up_the_averages_at_the_same_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The host read-outs used to change whenever a non-blocking copy happened
    # to be done, so replicas could scale one step by different factors; and
    # a copy still in flight dropped the newer updates (15 of every 16 with
    # several replicas). The GPU path is driven here with a stand-in copy.
    import adaptdl.torch.gradient_noise_scale as gns_module

    synced: list[int] = []

    class Event:
        def __init__(self, step: int) -> None:
            self.step = step

        def synchronize(self) -> None:
            synced.append(self.step)

    with local_group():
        ddp = torch.nn.parallel.DistributedDataParallel(LinearProbe(2))
        gns = GradientNoiseScale(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
        gns._on_cuda = True
        monkeypatch.setattr(
            gns_module,
            "_copy_to_host",
            lambda packed: (packed.clone(), Event(gns._window_index)),
        )

        def update(var: float) -> None:
            gns._ema.copy_(torch.tensor([[1.0], [1.0], [var], [1.0]], dtype=torch.float64))
            gns._start_copy()

        gns._window_index = 10
        for var in range(1, 17):  # one flush folding in 16 observations
            gns._measurements += 1
            update(float(var))
        before = float(gns.raw_var_avg[0])
        gns._window_index = 11
        assert float(gns.raw_var_avg[0]) == before and synced == []
        assert not gns.ready  # "ready" waits for the values it vouches for
        gns._window_index = 12  # HOST_LAG steps later: the newest state, waited for
        assert gns_module.HOST_LAG == 2
        assert float(gns.raw_var_avg[0]) == 16.0 and synced == [10]
        assert gns.ready
        update(20.0)
        gns._window_index = 13
        update(30.0)
        gns._window_index = 15  # both due: the newer one counts
        assert float(gns.raw_var_avg[0]) == 30.0 and synced == [10, 13]
        assert not gns._copies
        for step in range(16, 116):  # updates nobody reads do not pile up
            gns._window_index = step
            update(float(step))
            assert len(gns._copies) <= gns_module.HOST_LAG + 1
        assert float(gns.raw_var_avg[0]) == 113.0
    checkpoint.clear_registry()


def test_plain_gns_on_ddp_and_argument_errors() -> None:
    with local_group():
        model = LinearProbe(4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(TypeError, match="DistributedDataParallel"):
            GradientNoiseScale(model, optimizer)  # type: ignore[arg-type]
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        with pytest.raises(ValueError, match="num_replicas"):
            GradientNoiseScale(ddp, optimizer, num_replicas=0)
        # numpy numbers are numbers (they were refused as "not positive").
        gns = GradientNoiseScale(
            ddp,
            optimizer,
            num_replicas=np.int64(1),  # type: ignore[arg-type]
            accum_scale=np.float32(2.0),  # type: ignore[arg-type]
        )
        assert gns.accum_scale == 2.0 and type(gns.accum_scale) is float
        assert gns.sqr_avg() == 1.0 and gns.var_avg() == pytest.approx(1e-6)
    checkpoint.clear_registry()


def _plain_ddp_replica() -> dict[str, object]:
    """Two-step windows through DDP's own ``no_sync`` on a plain DDP model."""
    from adaptdl.torch import init_process_group

    init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1, bias=False))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    gns = GradientNoiseScale(model, optimizer)
    gns.measure_every = 1
    gns.stats_interval = 1
    grads, sync_times = [], []
    for step in range(6):
        gns.reset_accumulation()
        x = torch.full((4, 3), float(rank + 1 + step % 2))
        with model.no_sync():
            model(x).sum().backward()
        model(2 * x).sum().backward()
        sync_times.append(gns._finalize())
        grads.append(model.module.weight.grad.clone().tolist())
    dist.destroy_process_group()
    return {"grads": grads, "sync": sync_times, "count": gns.accum_count, "var": gns.var_avg()}


def test_plain_ddp_accumulates_through_no_sync_and_times_the_sync() -> None:
    results = run_elastic(_plain_ddp_replica, 2, timeout=120).final.results
    for result in results:
        # Micro-batch gradients 4*(r+1+k) and 8*(r+1+k) per weight, averaged
        # over both micro-batches and both replicas (r = 0, 1; k = step % 2).
        expected = [[[6.0 * (1.5 + step % 2)] * 3] for step in range(6)]
        assert result["grads"] == expected
        assert result["count"] == 2
        sync = result["sync"]
        assert isinstance(sync, list) and all(isinstance(t, float) and t >= 0 for t in sync)
        assert isinstance(result["var"], float) and result["var"] > 1e-6


def _queued_job() -> list[list[list[float]]]:
    """Two replicas queue statistics, then take state_dict with and without a sync."""
    import adaptdl.torch as adt
    from adaptdl import collective

    torch.set_num_threads(1)
    adt.init_process_group("gloo")
    from torch.utils.data import TensorDataset

    x = torch.linspace(0, 1, 400).unsqueeze(1)
    loader = adt.AdaptiveDataLoader(TensorDataset(x, 3 * x + 1), batch_size=10, shuffle=True)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    adp = adt.AdaptiveDataParallel(model, optimizer)
    adp.gns.measure_every = 1
    for step, (inputs, targets) in enumerate(loader):
        optimizer.zero_grad()
        ((adp(inputs) - targets) ** 2).mean().backward()
        optimizer.step()
        if step == 10:
            break
    unsynced = adp.gns.state_dict()["pending"]
    adp.gns._sum_pending()  # what State.sync does before a checkpoint
    synced = adp.gns.state_dict()["pending"]
    collective.teardown()
    return [[obs["local_sum"] for obs in unsynced], [obs["local_sum"] for obs in synced]]


def test_a_state_dict_holds_only_job_wide_queued_statistics() -> None:
    # Without a sync first, each replica's own partial sums were saved as if
    # they were totals, and never summed after a reload.
    results = run_elastic(_queued_job, 2, timeout=60).final.results
    for unsynced, synced in results:
        assert unsynced == [] and len(synced) == 11
    assert results[0][1] == results[1][1]  # summed: the same on every replica


class _FakeCudaEvent:
    """The part of the ``torch.cuda.Event`` contract the sync timing uses."""

    def __init__(self, at: float) -> None:
        self.at = at
        self.done = False

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: _FakeCudaEvent) -> float:
        return (end.at - self.at) * 1e3  # milliseconds, as CUDA reports


def test_gpu_sync_time_is_reported_while_the_host_runs_ahead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The device finishes each step's events one step later than the host
    # asks. Waiting for every queued pair to finish reported nothing, ever,
    # so the fit took the all-reduce for compute time.
    monkeypatch.setattr(torch.cuda, "Event", _FakeCudaEvent)
    gns = GradientNoiseScale.__new__(GradientNoiseScale)
    clock = [0.0]
    gns._sync_events = []
    gns._last_grad_time = None
    monkeypatch.setattr(gns, "_timestamp", lambda: _FakeCudaEvent(clock[0]), raising=False)
    reported = []
    for _ in range(6):
        gns._sync_start = _FakeCudaEvent(clock[0])
        clock[0] += 0.05  # the synchronisation
        reported.append(gns._collect_sync_time())
        for start, end in gns._sync_events[:-1]:  # all but the newest pair finished
            start.done = end.done = True
        clock[0] += 0.1
    assert reported[:2] == [None, None]  # nothing finished yet
    assert reported[2:] == [pytest.approx(0.05)] * 4
    # Once the device catches up, both pairs still queued are reported.
    assert len(gns._sync_events) == 2
    for start, end in gns._sync_events:
        start.done = end.done = True
    assert gns._collect_sync_time() == pytest.approx(0.1)
    assert gns._sync_events == []


def test_gpu_sync_times_that_finish_together_are_all_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The device catches up only every 8 steps (a loop that reads loss.item()
    # now and then). Only 4 pairs were kept and only the newest finished one
    # was reported: 0.35 s of 3.2 s.
    monkeypatch.setattr(torch.cuda, "Event", _FakeCudaEvent)
    waited: list[float] = []
    monkeypatch.setattr(
        _FakeCudaEvent,
        "synchronize",
        lambda self: (waited.append(self.at), setattr(self, "done", True)),
        raising=False,
    )
    gns = GradientNoiseScale.__new__(GradientNoiseScale)
    clock = [0.0]
    gns._sync_events = []
    gns._last_grad_time = None
    monkeypatch.setattr(gns, "_timestamp", lambda: _FakeCudaEvent(clock[0]), raising=False)
    total = 0.0
    for step in range(64):
        if step % 8 == 0:
            for start, end in gns._sync_events:
                start.done = end.done = True
        gns._sync_start = _FakeCudaEvent(clock[0])
        clock[0] += 0.05
        total += gns._collect_sync_time() or 0.0
        clock[0] += 0.1
    for start, end in gns._sync_events:
        start.done = end.done = True
    total += gns._collect_sync_time() or 0.0
    assert total == pytest.approx(64 * 0.05)
    assert waited == []  # the device was never far behind
    # Far behind (nothing ever finishes by itself): the host waits for the
    # oldest pair instead of dropping it, and the queue stays bounded.
    for _ in range(100):
        gns._sync_start = _FakeCudaEvent(clock[0])
        clock[0] += 0.05
        total += gns._collect_sync_time() or 0.0
    assert len(gns._sync_events) <= 64 and len(waited) == 100 - 64
    for start, end in gns._sync_events:
        start.done = end.done = True
    total += gns._collect_sync_time() or 0.0
    assert total == pytest.approx(164 * 0.05)
