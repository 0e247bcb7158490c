"""``AdaptiveDataParallel``: DistributedDataParallel with adaptive batch sizes.

The wrapper adds, on top of :class:`torch.nn.parallel.DistributedDataParallel`:

* gradient accumulation driven by the AdaptDL data loader: while the loader
  says the current micro-batch only accumulates, the forward pass turns DDP's
  gradient synchronisation off (``require_backward_grad_sync``), exactly what
  :meth:`~torch.nn.parallel.DistributedDataParallel.no_sync` does;
* gradient-noise measurement (:mod:`adaptdl.torch.gradient_noise_scale`)
  through parameter gradient hooks and ``.grad`` after DDP's all-reduce,
  feeding the goodput model and the learning-rate scaling rule;
* a learning-rate scaling rule patched into the optimizer instance, so the
  usual ``optimizer.step()`` trains correctly at any batch size;
* automatic checkpointing of the model, optimizer, LR scheduler, GradScaler
  and gradient statistics, restored in the constructor after a restart.

Only public PyTorch APIs are used: tensor hooks, a communication hook (only
once gradients are accumulated), the ``require_backward_grad_sync`` switch
and the optimizer's public methods.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import IO, Any

import torch
import torch.distributed as dist

from adaptdl import checkpoint
from adaptdl.torch import _metrics
from adaptdl.torch.data import _add_discard_listener, _tag_prefix, current_dataloader
from adaptdl.torch.gradient_noise_scale import AdamGradientNoiseScale, GradientNoiseScale
from adaptdl.torch.scaling_rules import (
    AdamScale,
    AdaScale,
    ScalingRuleBase,
    _check_unpatched,
    get_scaling_rule,
)

__all__ = ["AdaptiveDataParallel"]

logger = logging.getLogger(__name__)

_ADAM_TYPES: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW)


def _resolve_rule(
    scaling_rule: ScalingRuleBase | str | None, optimizer: torch.optim.Optimizer
) -> ScalingRuleBase:
    if scaling_rule is None:
        # Adam-type optimizers normalise their steps; AdaScale's full gain
        # would overshoot, so they get the square-root variant by default.
        return AdamScale() if isinstance(optimizer, _ADAM_TYPES) else AdaScale()
    if isinstance(scaling_rule, str):
        return get_scaling_rule(scaling_rule)
    if isinstance(scaling_rule, ScalingRuleBase):
        return scaling_rule
    if isinstance(scaling_rule, type) and issubclass(scaling_rule, ScalingRuleBase):
        raise TypeError(
            f"scaling_rule={scaling_rule.__name__} is a class; pass an instance, e.g. "
            f"scaling_rule={scaling_rule.__name__}()"
        )
    raise TypeError(
        "scaling_rule must be a ScalingRuleBase, a rule name or None, "
        f"got {type(scaling_rule).__name__}: {scaling_rule!r}"
    )


class _AdaptiveDataParallelState(checkpoint.State):
    """The checkpointed state of one :class:`AdaptiveDataParallel`."""

    _adaptdl_internal = True  # forgotten in a forked test replica (_procstate)

    def __init__(self, adp: AdaptiveDataParallel, name: str) -> None:
        super().__init__(name)
        self.adp = adp
        self.gain = 1.0
        self.lr_factor = 1.0

    def save(self, fileobj: IO[bytes]) -> None:
        adp = self.adp
        payload = {
            "model": adp.module.state_dict(),
            "optimizer": adp.optimizer.state_dict(),
            "lr_scheduler": None if adp.lr_scheduler is None else adp.lr_scheduler.state_dict(),
            "mp_scaler": None if adp.mp_scaler is None else adp.mp_scaler.state_dict(),
            "gns": adp.gns.state_dict(),
            "gain": self.gain,
            "lr_factor": self.lr_factor,
        }
        torch.save(payload, fileobj)

    def sync(self) -> None:
        # Runs on every replica before a save: sum the queued statistics over
        # the replicas (a collective), so rank 0 saves the job-wide queue.
        self.adp.gns._sum_pending()

    def load(self, fileobj: IO[bytes]) -> None:
        adp = self.adp
        # Our own checkpoint, written by this job; the scheduler and optimizer
        # state dicts hold plain Python objects that weights_only rejects.
        payload = torch.load(fileobj, map_location="cpu", weights_only=False)
        adp.module.load_state_dict(payload["model"])
        adp.optimizer.load_state_dict(payload["optimizer"])
        if adp.lr_scheduler is not None and payload["lr_scheduler"] is not None:
            adp.lr_scheduler.load_state_dict(payload["lr_scheduler"])
        if adp.mp_scaler is not None and payload["mp_scaler"] is not None:
            adp.mp_scaler.load_state_dict(payload["mp_scaler"])
        adp.gns.load_state_dict(payload["gns"])
        self.gain = float(payload["gain"])
        self.lr_factor = float(payload["lr_factor"])


def _outside_stacklevel() -> int:
    """The ``stacklevel`` of the nearest caller outside AdaptDL and PyTorch."""
    import inspect

    inside = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(torch.__file__))
    frame = inspect.currentframe()
    level = 0
    while frame is not None:
        if not frame.f_code.co_filename.startswith(inside):
            return max(level, 1)
        frame, level = frame.f_back, level + 1
    return 1


def _check_optimizer_params(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that updates tensors which are not the model's parameters.

    Such an optimizer never sees the averaged gradients, so every replica
    would drift apart silently (or, with one replica, fail at the first step).
    """
    owned = {id(param) for param in model.parameters()}
    foreign = [
        (index, tuple(param.shape))
        for index, group in enumerate(optimizer.param_groups)
        for param in group["params"]
        if id(param) not in owned
    ]
    if foreign:
        shown = ", ".join(f"group {index} shape {list(shape)}" for index, shape in foreign[:3])
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise ValueError(
            f"optimizer updates {len(foreign)} tensor(s) that are not parameters of the model "
            f"({shown}{more}); create it from model.parameters() of the model passed to "
            "AdaptiveDataParallel"
        )


class AdaptiveDataParallel(torch.nn.parallel.DistributedDataParallel):
    """DistributedDataParallel with adaptive batch sizes and checkpoint-restart.

    Use it like DDP together with :class:`~adaptdl.torch.AdaptiveDataLoader`.
    With a plain :class:`~torch.utils.data.DataLoader` (step 1 of the
    tutorial) it trains exactly like DDP at a fixed batch size, without noise
    measurement, learning-rate scaling or profiling, and warns once.
    The model, optimizer, LR scheduler and GradScaler are saved whenever a
    checkpoint is taken and restored here after a restart. The optimizer is
    patched with the scaling rule, so ``optimizer.step()`` applies the
    learning-rate factor for the current batch size and skips accumulation
    micro-batches, and ``optimizer.zero_grad()`` keeps accumulated gradients.
    An accumulation that a loader loop leaves incomplete (the loop ends in the
    middle of a step's micro-batches) is discarded when the loop ends, so
    it never reaches the next loop's first optimizer step.

    :func:`adaptdl.torch.init_process_group` (or
    :func:`torch.distributed.init_process_group`) must have been called first.
    DDP accepts a single communication hook; this class registers one when
    it first accumulates gradients, so do not register another one. With a
    GradScaler and gradient accumulation, call
    ``scaler.step``/``scaler.update`` only when
    ``adaptdl.torch.current_dataloader().is_optim_step()``:
    ``scaler.step`` unscales ``.grad`` in place, which would mix scaled and
    unscaled micro-batches.

    Args:
        model: the model to train.
        optimizer: the optimizer of ``model``'s parameters.
        lr_scheduler: its LR scheduler, checkpointed along with it. A
            scaling rule given here (as in the AdaptDL docs' example) is
            taken as ``scaling_rule``.
        mp_scaler: the :class:`torch.amp.GradScaler` for fp16 training; its
            loss scale is divided out of the gradient statistics.
        scaling_rule: a :class:`~adaptdl.torch.scaling_rules.ScalingRuleBase`
            instance or name; defaults to ``AdamScale`` for Adam/AdamW and
            ``AdaScale`` otherwise.
        name: unique checkpoint name of this instance (needed only when
            several exist).
        **ddp_kwargs: passed to DistributedDataParallel.

    Raises:
        TypeError: ``optimizer``, ``scaling_rule``, ``lr_scheduler`` or
            ``mp_scaler`` has the wrong type.
        ValueError: ``name`` is empty or already used by another state.
        RuntimeError: the default process group is not initialised.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        mp_scaler: torch.amp.GradScaler | None = None,
        scaling_rule: ScalingRuleBase | str | None = None,
        name: str = "adaptdl-dataparallel",
        **ddp_kwargs: Any,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {model!r}")
        if isinstance(model, AdaptiveDataParallel):
            raise ValueError(
                f"model is already an AdaptiveDataParallel "
                f"({getattr(model, 'adaptdl_name', '?')!r}); wrapping "
                "it again would scale the learning rate twice: pass the inner module "
                "(model.module), or use the wrapped model as it is"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
        if isinstance(lr_scheduler, ScalingRuleBase):
            # The AdaptDL docs' own example passes the rule third
            # (``AdaptiveDataParallel(model, optim, adascale)``); honour it.
            if scaling_rule is not None:
                raise TypeError(
                    f"lr_scheduler={lr_scheduler!r} is a scaling rule, and scaling_rule="
                    f"{scaling_rule!r} is given too; pass one rule, as scaling_rule="
                )
            lr_scheduler, scaling_rule = None, lr_scheduler
        if isinstance(lr_scheduler, torch.amp.GradScaler):
            # Taken as the scheduler, it was never unscaled: noise statistics
            # computed on gradients 2**16 times too large.
            raise TypeError(f"lr_scheduler={lr_scheduler!r} is a GradScaler; pass it as mp_scaler=")
        if isinstance(lr_scheduler, type) and issubclass(lr_scheduler, ScalingRuleBase):
            raise TypeError(
                f"lr_scheduler={lr_scheduler.__name__} is a scaling-rule class; pass an "
                f"instance, e.g. {lr_scheduler.__name__}()"
            )
        if lr_scheduler is not None and (
            isinstance(lr_scheduler, torch.optim.Optimizer)
            or not hasattr(lr_scheduler, "state_dict")
            or not callable(getattr(lr_scheduler, "step", None))
        ):
            raise TypeError(
                f"lr_scheduler must be an LR scheduler with step() and state_dict(), got "
                f"{lr_scheduler!r}"
            )
        scheduled = getattr(lr_scheduler, "optimizer", optimizer)
        if isinstance(scheduled, torch.optim.Optimizer) and scheduled is not optimizer:
            raise ValueError(
                f"lr_scheduler={lr_scheduler!r} schedules another optimizer ({scheduled!r}); "
                "create it with the optimizer passed to AdaptiveDataParallel"
            )
        _check_optimizer_params(model, optimizer)
        if mp_scaler is not None and not isinstance(mp_scaler, torch.amp.GradScaler):
            raise TypeError(f"mp_scaler must be a torch.amp.GradScaler or None, got {mp_scaler!r}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "AdaptiveDataParallel needs an initialised process group; call "
                "adaptdl.torch.init_process_group('gloo' or 'nccl') first"
            )
        rule = _resolve_rule(scaling_rule, optimizer)
        rule._check_unbound()
        _check_unpatched(optimizer)
        super().__init__(model, **ddp_kwargs)
        # Registering the checkpoint name first rejects a duplicate before the
        # optimizer is patched or gradient hooks are installed, so a failed
        # construction leaves the optimizer as it was.
        self._adaptdl_state = _AdaptiveDataParallelState(self, name)
        try:
            self._set_up(optimizer, lr_scheduler, mp_scaler, rule, name)
        except BaseException:
            # A failed construction (a checkpoint of another model, say) must
            # leave nothing behind: the name registered would block a retry
            # and be saved over the trained model by the next checkpoint.
            self._adaptdl_state.unregister()
            rule._release()
            gns = self.__dict__.get("gns")
            if gns is not None:
                gns.remove_hooks()
            raise

    def _set_up(
        self,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        mp_scaler: torch.amp.GradScaler | None,
        rule: ScalingRuleBase,
        name: str,
    ) -> None:
        """The rest of ``__init__``, once the checkpoint name is registered."""
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.mp_scaler = mp_scaler
        self.scaling_rule = rule
        self.adaptdl_name = name
        # The preconditioned estimator whenever the effective rule is
        # AdamScale, also when it was chosen by default (the original only
        # looked at the argument, so default Adam runs measured SGD noise).
        gns_class = AdamGradientNoiseScale if isinstance(rule, AdamScale) else GradientNoiseScale
        self.gns: GradientNoiseScale = gns_class(self, optimizer, mp_scaler=mp_scaler)
        self.gns.backward_start_callback = self._on_backward_start
        self._num_replicas = dist.get_world_size(getattr(self, "process_group", None))
        # True while the current step runs outside an AdaptiveDataLoader
        # (see _start_plain_step); the scaling rule then applies scale 1.
        self._plain_step = False
        self._warned_plain = False
        # Host version of the statistics last sent to the metrics (see _on_optimizer_step).
        self._reported_version = -1
        rule.initialize(self, optimizer, patch_optimizer=True)
        _add_discard_listener(self._discard_accumulation)
        if checkpoint.load_state(self._adaptdl_state):
            logger.info("restored %s from checkpoint", name)
        _metrics.update_progress(self.gns.get_progress())

    # ------------------------------------------------------------ training

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the model; gate gradient sync on the loader's accumulation schedule."""
        loader = current_dataloader()
        if loader is not None and loader.training:
            sync = loader.is_optim_step()
            if self.require_backward_grad_sync != sync:  # Module.__setattr__ is slow
                self.require_backward_grad_sync = sync
            if loader.current_local_bsz > 0:
                self.gns.set_accum_scale(self._loader_accum_scale(loader))
            if not sync:
                self.gns._prepare_accumulation()
        if torch.is_grad_enabled():
            # The next backward is a new one even if the last one left some
            # parameters without a gradient (unused in that forward).
            self.gns._arm_backward()
        return super().forward(*inputs, **kwargs)  # type: ignore[no-untyped-call]

    def _loader_accum_scale(self, loader: Any) -> float:
        return float(loader.current_local_bsz * self._num_replicas / loader.batch_size)

    def _on_backward_start(self, sync: bool) -> None:
        """Runs once per backward, from the first parameter gradient hook.

        Args:
            sync: whether this backward all-reduces (DDP's
                ``require_backward_grad_sync``, which :meth:`forward` set).
        """
        loader = current_dataloader()
        if loader is None:
            self._start_plain_step(sync)
            return
        self.gns.measuring_enabled = True
        self.gns.average_micro_batches = True
        if self._plain_step:  # Module.__setattr__ is slow: write only on change
            self._plain_step = False
        accum_scale = None
        if not loader.training:
            loader.train()  # the first loader to backpropagate trains
            if loader.training and loader.current_local_bsz > 0:
                accum_scale = self._loader_accum_scale(loader)
        self.gns._on_backward_start(sync, accum_scale)

    def _start_plain_step(self, sync: bool) -> None:
        """Train one step outside an AdaptiveDataLoader, like plain DDP.

        Step 1 of the tutorial wraps the model before the data loader is
        replaced, so a ``torch.utils.data.DataLoader`` must train correctly:
        the batch size is whatever that loader yields, unknown to AdaptDL and
        fixed, so the step runs at scale 1 (learning-rate factor 1, gain 1).
        Gradients accumulated under the user's ``no_sync()`` are summed, as
        DDP sums them, not averaged as the adaptive loader's micro-batches
        are. Noise measurement and profiling are skipped: they only serve batch
        size decisions, which need an AdaptiveDataLoader, and measuring
        without knowing the batch size would store statistics at a wrong
        scale that later adaptive training would inherit.
        """
        if not self._warned_plain:
            self._warned_plain = True
            message = (
                "AdaptiveDataParallel is training outside an adaptdl.torch.AdaptiveDataLoader: "
                "it behaves like DistributedDataParallel with a fixed batch size (no gradient "
                "noise measurement, no learning-rate scaling, no profiling). Iterate over an "
                "AdaptiveDataLoader to enable adaptive batch sizes."
            )
            # Once, as a warning attributed to the user's line (the backward
            # call), not to this hook; a log record as well printed it twice.
            warnings.warn(message, UserWarning, stacklevel=_outside_stacklevel())
        self._plain_step = True
        self.gns.measuring_enabled = False
        # Micro-batches accumulated under the user's no_sync() add up, as in DDP.
        self.gns.average_micro_batches = False
        self.gns._on_backward_start(sync)

    def _discard_accumulation(self) -> None:
        """Drop the gradients of an accumulation the training loader abandoned.

        Called when a loop ends (or the batch size changes) in the middle of
        an accumulation; see :mod:`adaptdl.torch.data`. Without it the
        partial sums would be added into the next loop's first optimizer
        step, which would also divide by too many micro-batches.
        """
        if self.gns.accum_count > 0 and not self.gns.should_zero_grad:
            self.gns.reset_accumulation()
        if not self.require_backward_grad_sync:  # Module.__setattr__ is slow
            # DDP's default: a backward outside the loop synchronises.
            self.require_backward_grad_sync = True

    def _on_optimizer_step(
        self, scale: float, gain: float, lr_factor: float, sync_time: float | None
    ) -> None:
        """Called by the scaling rule after every real optimizer step."""
        self._adaptdl_state.gain = gain
        self._adaptdl_state.lr_factor = lr_factor
        if self._plain_step:
            # No loader: nothing to profile or to decide batch sizes from.
            _metrics.update_progress(self.gns.get_progress())
            return
        if sync_time is not None:
            _metrics.profile_sync_time(sync_time)
        _metrics.update_progress(self.gns.get_progress())
        loader = current_dataloader()
        if loader is not None and loader.autoscaling and self.gns.ready:
            # The statistics change only when the estimator folds in new
            # measurements (every few steps); skip the numpy work otherwise.
            version = self.gns._host_version
            if version != self._reported_version:
                self._reported_version = version
                _metrics.update_grad_params(
                    self.adaptdl_name, self.gns.sqr_avg(), self.gns.var_avg()
                )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients unless an accumulation is in progress (prefer the optimizer's).

        Args:
            set_to_none: passed to :meth:`torch.nn.Module.zero_grad`.
        """
        warnings.warn(
            "AdaptiveDataParallel.zero_grad() keeps gradients while accumulating over "
            "micro-batches; call optimizer.zero_grad() instead",
            UserWarning,
            stacklevel=2,
        )
        if self.gns.should_zero_grad:
            super().zero_grad(set_to_none=set_to_none)
            self.gns._clear_window()

    # ------------------------------------------------------------ reporting

    @property
    def gain(self) -> float:
        """Current estimate of the AdaScale gain ``r_t`` of the last optimizer step."""
        return self._adaptdl_state.gain

    @property
    def lr_factor(self) -> float:
        """Mean learning-rate factor applied by the scaling rule in the last step."""
        return self._adaptdl_state.lr_factor

    def to_tensorboard(self, writer: Any, global_step: int, tag_prefix: str = "") -> None:
        """Write the gradient and scaling statistics to TensorBoard.

        Args:
            writer: a :class:`torch.utils.tensorboard.SummaryWriter`.
            global_step: the step to record them at.
            tag_prefix: prefix of every tag, e.g. ``"Train"`` (a ``/`` is added if it lacks one).
        """
        scalars = {
            "Gradient_Norm_Sqr": self.gns.sqr_avg(),
            "Gradient_Variance": self.gns.var_avg(),
            "Gain": self._adaptdl_state.gain,
            "Learning_Rate_Factor": self._adaptdl_state.lr_factor,
            "Accum_Scale": self.gns.accum_scale,
            "Accum_Count": self.gns.accum_count,
            "Progress": self.gns.get_progress(),
        }
        prefix = _tag_prefix(tag_prefix)
        for tag, value in scalars.items():
            writer.add_scalar(prefix + tag, value, global_step)
