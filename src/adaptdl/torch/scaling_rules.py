"""Learning-rate scaling rules for training at a batch size that changes.

When the batch grows from ``B0`` to ``B = S * B0`` the learning rate tuned for
``B0`` is no longer right. A scaling rule turns the current scale ``S`` (and,
for the adaptive rules, the gradient noise statistics) into a factor applied
to each parameter group's learning rate for one optimizer step:

=================  ===================================================
``AdaScale``       ``r_t = (var + sqr) / (var / S + sqr)`` per group
``AdamScale``      ``r_t ** 0.5`` (Adam's update is scale-normalised)
``LinearScale``    ``S``
``SqrtScale``      ``sqrt(S)``
``LEGWScale``      ``sqrt(S)`` times a warm-up ramp stretched by ``S``
=================  ===================================================

Every rule also advances the training progress by the gain ``r_t`` per step,
so "progress" counts iterations at ``B0`` that the job has been worth.

Rules are looked up by name with :func:`get_scaling_rule` (new rules join with
:func:`register_scaling_rule`); an unknown name lists the valid ones.

:class:`~adaptdl.torch.AdaptiveDataParallel` patches ``optimizer.step`` and
``optimizer.zero_grad`` on the optimizer *instance* with the rule's versions,
so an unchanged training loop that calls ``optimizer.step()`` gets the scaled
learning rate, and accumulation micro-batches skip the step.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import math
import os
import sys
import types
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from adaptdl import _registry
from adaptdl.torch.data import current_dataloader

if TYPE_CHECKING:
    from adaptdl.torch.gradient_noise_scale import GradientNoiseScale

__all__ = [
    "AdaScale",
    "AdamScale",
    "LEGWScale",
    "LinearScale",
    "ScalingRuleBase",
    "SqrtScale",
    "available_scaling_rules",
    "get_scaling_rule",
    "register_scaling_rule",
]

logger = logging.getLogger(__name__)

_VAR_FLOOR = 1e-6

LrFactor = float | npt.NDArray[np.float64]


@dataclasses.dataclass(frozen=True)
class _Factors:
    """One computation of the learning-rate factors, as plain floats for the step."""

    key: tuple[int, float, object]
    """What they were computed from (statistics version, scale, progress key)."""
    values: list[float]
    """One factor per parameter group."""
    mean: float
    identity: bool
    """All factors are 1: the step leaves the learning rates alone."""


#: Source folders whose frames a warning skips, to point at the user's own line.
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(module.__file__ or "")) + os.sep
    for module in (torch, sys.modules[__name__.rpartition(".")[0]])
)


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of the first caller outside adaptdl.torch and torch."""
    frame = inspect.currentframe()
    level = 0
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY_DIRS):
        frame = frame.f_back
        level += 1
    return level


class _Replay:
    """A closure whose first call returns the loss it already gave.

    Later calls (LBFGS evaluates the closure several times) run it again,
    with the gradient-noise statistics left alone.
    """

    def __init__(self, closure: Callable[[], Any], loss: Any, gns: GradientNoiseScale) -> None:
        self._closure = closure
        self._loss = loss
        self._gns = gns
        self._fresh = True

    def __call__(self) -> Any:
        if self._fresh:
            self._fresh = False
            return self._loss
        with self._gns._replay():
            return self._closure()


def _evaluate_closure(
    args: tuple[Any, ...], kwargs: dict[str, Any], gns: GradientNoiseScale
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Run ``optimizer.step``'s closure, if one is given, and replay its loss.

    Returns:
        The arguments with the closure replaced by a :class:`_Replay`.

    Raises:
        RuntimeError: a closure is given while a ``GradScaler`` is enabled
            (PyTorch's ``GradScaler.step`` refuses closures too: the closure's
            gradients would be scaled).
    """
    if "closure" in kwargs:
        position: int | None = None
        closure = kwargs["closure"]
    else:
        position, closure = 0, args[0] if args else None
    if closure is None or not callable(closure):
        return args, kwargs
    scaler = gns._mp_scaler
    if scaler is not None and scaler.is_enabled():
        raise RuntimeError(
            "optimizer.step(closure) is not supported with an enabled GradScaler (the "
            "closure's gradients would be scaled); call backward() and step() yourself"
        )
    with torch.enable_grad():
        loss = closure()
    replay = _Replay(closure, loss, gns)
    if position is None:
        return args, {**kwargs, "closure": replay}
    return (replay, *args[1:]), kwargs


class ScalingRuleBase(ABC):
    """Base class of the learning-rate scaling rules.

    A rule is bound to one model and optimizer by :meth:`initialize` (which
    :class:`~adaptdl.torch.AdaptiveDataParallel` calls). Subclasses only
    implement :meth:`scale_lr`.

    Example::

        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model = adaptdl.torch.AdaptiveDataParallel(model, optimizer, scaling_rule=AdaScale())
        for epoch in adaptdl.torch.remaining_epochs_until(30):
            for batch in loader:
                optimizer.zero_grad()
                loss_fn(model(batch)).backward()
                optimizer.step()
    """

    # Class-level defaults too: a subclass written for the original library
    # may not call super().__init__() (the original set these in initialize()).
    _adp: Any = None
    _optimizer: torch.optim.Optimizer | None = None
    _optimizer_step: Callable[..., Any] | None = None
    _optimizer_zero_grad: Callable[..., Any] | None = None
    _step_hook: Callable[[float, float, float, float | None], None] | None = None
    _factor_cache: _Factors | None = None
    _warned_scaler_accumulation = False

    def __init__(self) -> None:
        self._unbind()

    def _unbind(self) -> None:
        """Forget the model and optimizer (the state of a rule not yet initialised)."""
        self._adp = None
        self._optimizer = None
        self._optimizer_step = None
        self._optimizer_zero_grad = None
        # The model's per-step callback (AdaptiveDataParallel has one), looked up once.
        self._step_hook = None
        self._factor_cache = None
        self._warned_scaler_accumulation = False

    @property
    def adp(self) -> Any:
        """The model this rule was initialised with (None before :meth:`initialize`)."""
        return self._adp

    @adp.setter
    def adp(self, value: Any) -> None:
        # The original base class kept a plain ``adp`` attribute, and rules
        # written for it may assign it (``self.adp = None`` in __init__).
        self._adp = value

    @property
    def gns(self) -> GradientNoiseScale:
        """The gradient noise scale estimator of the bound model.

        Raises:
            RuntimeError: the rule has not been initialised.
        """
        if self._adp is None:
            raise RuntimeError(
                f"{type(self).__name__} is not initialised; pass it to AdaptiveDataParallel "
                "or call initialize(adp, optimizer)"
            )
        gns: GradientNoiseScale = self._adp.gns
        return gns

    def _release(self) -> None:
        """Undo :meth:`initialize`: the optimizer's own step and zero_grad come back.

        For a model whose construction failed, so that the optimizer and
        this rule can be used again.
        """
        optimizer = self._optimizer
        if optimizer is not None and getattr(optimizer, "_adaptdl_rule", None) is self:
            for attribute in ("step", "zero_grad", "_adaptdl_rule"):
                optimizer.__dict__.pop(attribute, None)
        self._unbind()

    def _check_unbound(self) -> None:
        """Raise if this rule already serves a model (one rule per model)."""
        if self._adp is not None:
            raise RuntimeError(
                f"this {type(self).__name__} is already bound to a model; create one rule "
                "object per AdaptiveDataParallel"
            )

    def initialize(
        self, adp: Any, optimizer: torch.optim.Optimizer, patch_optimizer: bool = False
    ) -> None:
        """Bind the rule to a model (with a ``gns`` attribute) and its optimizer.

        Args:
            adp: the :class:`~adaptdl.torch.AdaptiveDataParallel` model.
            optimizer: its optimizer.
            patch_optimizer: replace ``optimizer.step`` and
                ``optimizer.zero_grad`` on this instance with :meth:`step` and
                :meth:`zero_grad`, so existing training loops need no change.

        Raises:
            TypeError: ``optimizer`` is not an optimizer, or ``adp`` has no
                ``gns`` estimator.
            RuntimeError: the rule is already bound to another model.
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
        if not hasattr(adp, "gns"):
            raise TypeError(
                f"adp must carry a gradient noise estimator (.gns), got {type(adp).__name__}"
            )
        self._check_unbound()
        if patch_optimizer:
            _check_unpatched(optimizer)
        self._adp = adp
        self._step_hook = getattr(adp, "_on_optimizer_step", None)
        self._optimizer = optimizer
        # Keep whatever step/zero_grad the instance currently exposes (possibly
        # an LR scheduler's wrapper) and call through to it.
        self._optimizer_step = optimizer.step
        self._optimizer_zero_grad = optimizer.zero_grad
        if patch_optimizer:
            rule = self

            def step(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
                return rule.step(*args, **kwargs)

            def zero_grad(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
                rule.zero_grad(*args, **kwargs)

            # Behave like any well-made decorator: carry over the metadata of
            # the step we wrap (name, docstring, attributes such as the marker
            # a scheduler created earlier left on its own wrapper), so that
            # code inspecting ``optimizer.step`` sees what it set up.
            functools.update_wrapper(step, self._optimizer_step)
            # Bound methods on the instance (not plain functions): an LR
            # scheduler created later wraps ``optimizer.step`` through its
            # ``__func__`` and must still reach the rule.
            optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
            optimizer.zero_grad = types.MethodType(  # type: ignore[method-assign]
                zero_grad, optimizer
            )
            optimizer._adaptdl_rule = self  # type: ignore[attr-defined]

    @abstractmethod
    def scale_lr(self, scale: float) -> LrFactor:
        """Learning-rate factor(s) for a batch ``scale`` times the initial one.

        Args:
            scale: ``S = B / B0``.

        Returns:
            One factor for every parameter group, or an array with one per group.
        """

    def _factors(self, scale: float) -> _Factors:
        groups = len(self._require_optimizer().param_groups)
        gns = self.gns
        measured = getattr(gns, "_num_groups", groups)
        if groups != measured:
            raise RuntimeError(
                f"the optimizer has {groups} parameter groups but had {measured} when "
                "AdaptiveDataParallel was created; call optimizer.add_param_group() before "
                "wrapping the model (gradient statistics and checkpoints are kept per group, "
                "and a restart restores the optimizer before the script could add it again)"
            )
        gns._refresh_host()
        # The factors depend only on the scale and the statistics (and, for
        # LEGW, the progress), so most steps can reuse the previous ones.
        key = (gns._host_version, scale, self._cache_progress_key())
        cached = self._factor_cache
        if cached is not None and cached.key == key:
            return cached
        raw = np.asarray(self.scale_lr(scale), dtype=np.float64)
        if raw.ndim == 0:
            raw = np.full(groups, float(raw))
        if raw.shape != (groups,):
            raise ValueError(
                f"{type(self).__name__}.scale_lr returned {raw.shape[0]} factors for "
                f"{groups} parameter groups"
            )
        if not np.all(np.isfinite(raw)) or np.any(raw < 0):
            raise ValueError(
                f"{type(self).__name__}.scale_lr({scale}) returned invalid factors {raw}"
            )
        values = [float(f) for f in raw]
        self._factor_cache = _Factors(key, values, float(raw.mean()), all(f == 1 for f in values))
        return self._factor_cache

    def _cache_progress_key(self) -> object:
        """What besides the scale and statistics the factors depend on (None: nothing).

        A rule whose factors change on every step returns a fresh ``object()``,
        which never compares equal to an earlier key.
        """
        return None

    def _require_optimizer(self) -> torch.optim.Optimizer:
        if self._optimizer is None:
            raise RuntimeError(f"{type(self).__name__} is not initialised")
        return self._optimizer

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Run one optimizer step with the learning rate scaled for the current batch.

        A no-op on accumulation micro-batches. Otherwise each group's ``lr``
        is multiplied by :meth:`scale_lr` for the duration of the step and
        then restored (so LR schedulers keep seeing their own values), and
        the progress advances by the gain.

        A ``closure`` (as ``torch.optim.LBFGS`` needs) is evaluated once
        before anything else, because the step's gradient statistics come
        from its backward pass; the optimizer's first call of it then gets
        that loss, and any further calls evaluate it again (leaving the
        statistics alone). As in PyTorch, a closure cannot be combined with
        an enabled ``GradScaler``.

        Args:
            *args: passed to the optimizer's ``step``.
            **kwargs: passed to the optimizer's ``step``.

        Returns:
            Whatever the optimizer's ``step`` returns (None when skipped).

        Raises:
            RuntimeError: a closure is given while a ``GradScaler`` is enabled.
        """
        optimizer = self._require_optimizer()
        gns = self.gns
        args, kwargs = _evaluate_closure(args, kwargs, gns)
        if not gns.should_zero_grad:
            scaler = gns._mp_scaler
            if scaler is not None and scaler.is_enabled():
                self._warn_scaler_accumulation()
            return None  # accumulating: the real step comes with the last micro-batch
        sync_time = gns._finalize()
        if getattr(self._adp, "_plain_step", False):
            # Outside an AdaptiveDataLoader the batch size is the user's own
            # and fixed: train exactly like DDP, at scale 1 (factor 1, gain 1).
            return self._plain_step(optimizer, gns, sync_time, args, kwargs)
        scale = gns.accum_scale * max(gns.accum_count, 1)
        factors = self._factors(scale)
        optimizer_step = self._optimizer_step
        if optimizer_step is None:
            raise RuntimeError(f"{type(self).__name__} is not initialised")
        if factors.identity:
            result = optimizer_step(*args, **kwargs)  # nothing to scale (e.g. S = 1)
        else:
            groups = optimizer.param_groups
            saved = [group["lr"] for group in groups]
            for group, factor in zip(groups, factors.values):
                group["lr"] = group["lr"] * factor
            try:
                result = optimizer_step(*args, **kwargs)
            finally:
                for group, lr in zip(groups, saved):
                    group["lr"] = lr
        gain = gns._gain(scale)
        gns._progress += gain
        hook = self._step_hook
        if hook is not None:
            hook(scale, gain, factors.mean, sync_time)
        return result

    def _warn_scaler_accumulation(self) -> None:
        """Warn once that a GradScaler stepped on an accumulation micro-batch.

        ``scaler.step`` unscales ``.grad`` in place before it calls the
        optimizer, so the next micro-batches add scaled gradients to unscaled
        ones and the step trains on the wrong sum, silently.
        """
        if getattr(self, "_warned_scaler_accumulation", False):
            return
        self._warned_scaler_accumulation = True
        message = (
            "the optimizer was stepped on a gradient-accumulation micro-batch while the "
            "GradScaler is enabled: scaler.step() unscales the accumulated gradients in "
            "place, so they would mix with the scaled gradients of the next micro-batches. "
            "Call scaler.step() and scaler.update() only when "
            "adaptdl.torch.current_dataloader().is_optim_step() is True."
        )
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=_caller_stacklevel())

    def _plain_step(
        self,
        optimizer: torch.optim.Optimizer,
        gns: GradientNoiseScale,
        sync_time: float | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """An unscaled optimizer step that counts as one iteration of progress."""
        optimizer_step = self._optimizer_step
        if optimizer_step is None:
            raise RuntimeError(f"{type(self).__name__} is not initialised")
        result = optimizer_step(*args, **kwargs)
        gns._progress += 1.0
        hook = self._step_hook
        if hook is not None:
            hook(1.0, 1.0, 1.0, sync_time)
        return result

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        """Zero the gradients, unless a gradient accumulation is in progress.

        Args:
            *args: passed to the optimizer's ``zero_grad``.
            **kwargs: passed to the optimizer's ``zero_grad``.
        """
        gns = self.gns
        if gns.should_zero_grad:
            gns.reset_accumulation(*args, **kwargs)
        else:
            logger.debug("zero_grad skipped: accumulating gradients over micro-batches")


def _check_unpatched(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that a scaling rule already drives.

    A second rule would wrap the first one's ``step``: the learning-rate
    factor applied twice (S squared), and two sets of noise statistics.
    """
    rule = getattr(optimizer, "_adaptdl_rule", None)
    if rule is not None:
        raise RuntimeError(
            f"this optimizer is already driven by a {type(rule).__name__} of another "
            "AdaptiveDataParallel; wrap each model once, with its own optimizer"
        )


def _check_scale(scale: object) -> float:
    """``S = B / B0`` as a float, refused unless it is a finite number > 0."""
    if (
        isinstance(scale, bool)
        or not isinstance(scale, int | float | np.integer | np.floating)
        or not math.isfinite(scale)
        or not scale > 0
    ):
        raise ValueError(
            f"scale must be a finite number > 0 (the batch size over the initial one), "
            f"got {scale!r}"
        )
    return float(scale)


def _gain_per_group(gns: GradientNoiseScale, scale: float) -> npt.NDArray[np.float64]:
    scale = _check_scale(scale)
    var = np.maximum(gns.raw_var_avg, _VAR_FLOOR)
    sqr = np.maximum(gns.raw_sqr_avg, 0.0)
    result: npt.NDArray[np.float64] = (var + sqr) / (var / scale + sqr)
    return result


class AdaScale(ScalingRuleBase):
    """AdaScale: each group's rate grows by its gain ``r_t`` (Johnson et al., 2020).

    ``r_t`` moves from ``S`` (noise-dominated, where linear scaling is right)
    towards 1 (where a bigger batch buys nothing), per parameter group.
    """

    def scale_lr(self, scale: float) -> LrFactor:
        """Per-group gains ``(var + sqr) / (var / S + sqr)``."""
        return _gain_per_group(self.gns, scale)


class AdamScale(ScalingRuleBase):
    """AdaScale for Adam-type optimizers: the square root of the per-group gain.

    Adam normalises the update by the gradient's second moment, so the step
    already shrinks with the noise; the square-root dampens the AdaScale
    factor accordingly. Chosen by default for :class:`torch.optim.Adam` and
    :class:`torch.optim.AdamW`, and always paired with the preconditioned
    :class:`~adaptdl.torch.gradient_noise_scale.AdamGradientNoiseScale`.
    """

    def scale_lr(self, scale: float) -> LrFactor:
        """Per-group ``sqrt(r_t)``."""
        return np.sqrt(_gain_per_group(self.gns, scale))


class LinearScale(ScalingRuleBase):
    """Linear scaling (Goyal et al., 2017): the rate grows with the batch, ``S``."""

    def scale_lr(self, scale: float) -> LrFactor:
        """``S``."""
        return _check_scale(scale)


class SqrtScale(ScalingRuleBase):
    """Square-root scaling (Krizhevsky, 2014): the rate grows with ``sqrt(S)``."""

    def scale_lr(self, scale: float) -> LrFactor:
        """``sqrt(S)``."""
        return math.sqrt(_check_scale(scale))


class LEGWScale(ScalingRuleBase):
    """Linear-epoch gradual warm-up (You et al., 2019) with square-root scaling.

    The factor is ``sqrt(S)`` after a warm-up of ``base_warmup_epochs * S``
    epochs, ramping linearly before that. Progress is AdaptDL's
    scale-invariant progress (iterations at ``B0``), so the ramp is measured
    in the same units whatever batch sizes were used so far.

    Args:
        base_warmup_epochs: warm-up length, in epochs, at the initial batch size.
        data_size: number of samples in the training set.

    Raises:
        TypeError: ``data_size`` is not an int.
        ValueError: an argument is negative or ``data_size`` not positive.
    """

    def __init__(self, base_warmup_epochs: float, data_size: int) -> None:
        super().__init__()
        if (
            isinstance(base_warmup_epochs, bool)
            or not isinstance(base_warmup_epochs, int | float | np.integer | np.floating)
            or not math.isfinite(base_warmup_epochs)
            or base_warmup_epochs < 0
        ):
            raise ValueError(
                f"base_warmup_epochs must be a finite number >= 0, got {base_warmup_epochs!r}"
            )
        if isinstance(data_size, bool) or not isinstance(data_size, int | np.integer):
            kind = type(data_size).__name__
            raise TypeError(f"data_size must be an int, got {kind}: {data_size!r}")
        if data_size < 1:
            raise ValueError(f"data_size must be a positive int, got {data_size!r}")
        self.base_warmup_epochs = float(base_warmup_epochs)
        self.data_size = int(data_size)

    def _cache_progress_key(self) -> object:
        # The ramp moves with the progress (and B0 with the loader): never reuse.
        return object()

    def scale_lr(self, scale: float) -> LrFactor:
        """``sqrt(S) * min(progress / W, 1)`` with ``W = warmup * S * steps_per_epoch``.

        Raises:
            RuntimeError: called outside an AdaptDL data loader (``B0`` unknown).
            ValueError: ``scale`` is not a finite number > 0.
        """
        scale = _check_scale(scale)
        loader = current_dataloader()
        if loader is None:
            raise RuntimeError(
                "LEGWScale needs the initial batch size of the training loader; "
                "call optimizer.step() inside an AdaptiveDataLoader loop"
            )
        warmup = self.base_warmup_epochs * scale * self.data_size / loader.batch_size
        ramp = 1.0 if warmup <= 0 else min(self.gns.get_progress() / warmup, 1.0)
        return math.sqrt(scale) * ramp


_REGISTRY: dict[str, type[ScalingRuleBase]] = {
    "adascale": AdaScale,
    "adamscale": AdamScale,
    "linear": LinearScale,
    "sqrt": SqrtScale,
    "legw": LEGWScale,
}
_BUILTIN_RULES = frozenset(_REGISTRY)


def available_scaling_rules() -> list[str]:
    """Names accepted by :func:`get_scaling_rule`, sorted."""
    return sorted(_REGISTRY)


def register_scaling_rule(name: str, rule: type[ScalingRuleBase], *, replace: bool = False) -> None:
    """Make ``rule`` constructible by (case-insensitive) name.

    The rules of :func:`adaptdl.sched.register_policy` apply: registering the
    same class twice is harmless, and a built-in's name is taken only with
    ``replace=True``.

    Raises:
        ValueError: ``name`` is not an identifier (dashes allowed), or is a
            built-in's and ``replace`` is false.
        TypeError: ``rule`` is not a :class:`ScalingRuleBase` subclass.
    """
    _registry.check_name("scaling rule", name)
    if not (isinstance(rule, type) and issubclass(rule, ScalingRuleBase)):
        raise TypeError(f"rule must be a ScalingRuleBase subclass, got {rule!r}")
    _registry.register(
        _REGISTRY,
        "scaling rule",
        name,
        rule,
        builtins=_BUILTIN_RULES,
        replace=replace,
        key=str.lower,
    )


def get_scaling_rule(name: str, **kwargs: Any) -> ScalingRuleBase:
    """A new scaling rule by (case-insensitive) name, e.g. ``get_scaling_rule("adascale")``.

    Args:
        name: one of :func:`available_scaling_rules`.
        **kwargs: constructor arguments (``LEGWScale`` needs
            ``base_warmup_epochs`` and ``data_size``).

    Raises:
        ValueError: the name is unknown; the message lists the valid names.
        TypeError: ``kwargs`` do not fit the rule's constructor (the message
            shows its parameters).
    """
    rule = _registry.lookup(_REGISTRY, "scaling rule", name, "names", key=str.lower)
    import inspect

    try:
        signature = inspect.signature(rule)
        signature.bind(**kwargs)
    except TypeError as exc:
        params = ", ".join(signature.parameters)
        raise TypeError(
            f"scaling rule {name!r} ({rule.__name__}({params})): {exc}; pass its "
            f"arguments, or an instance such as {rule.__name__}(...) as scaling_rule"
        ) from None
    except ValueError:  # no signature to check (a builtin): let the call decide
        pass
    return rule(**kwargs)
