"""Numerical kernels behind :mod:`adaptdl.goodput`.

These functions work on plain numpy arrays and a 7-vector of performance
parameters so that the same code serves the public model (evaluation and batch
size optimisation) and the least-squares fit (where the parameters are the
unknowns and an analytic gradient is needed). They do not validate their
inputs: the public layer does that once at the boundary, which keeps the hot
paths (the scheduler evaluates thousands of configurations per round) cheap.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "FitData",
    "MAX_BATCH_SIZE",
    "NET_FLOOR",
    "NUM_CANDIDATES",
    "ROUND_EPS",
    "fit_loss",
    "fit_loss_and_grad",
    "step_times",
]

FloatArray = NDArray[np.float64]

#: Stand-in network constant and retrogression floor. Using a tiny positive
#: value instead of zero keeps every logarithm finite, which matters both for
#: the p-norm below and for the log-space loss of the fit.
NET_FLOOR = 1e-8

#: Largest batch size (total, per replica, or accumulation steps) the model
#: accepts: the largest integer a float64 holds exactly, far beyond any real
#: batch. Larger values would overflow the int64 results of ``optimize`` or
#: the products of the throughput model.
MAX_BATCH_SIZE = 2**53

#: Number of geometrically spaced total batch sizes tried by ``optimize``.
NUM_CANDIDATES = 50

#: Tolerance used before ``ceil`` so that exact multiples are not rounded up
#: because of floating-point noise (e.g. ``384 / 3`` must stay ``128``).
ROUND_EPS = 1e-8

#: Weight of the prior pulling gamma towards 1 (no compute/network overlap).
#: Added to each mean squared error before the square root. It rounds off the
#: kink of the RMSE at a perfect fit (where its gradient is undefined and the
#: line search stalls, e.g. when the start values already fit one of the two
#: step times exactly) and shifts the loss by at most 1e-4.
RMSE_SMOOTH = 1e-8

GAMMA_REG = 1e-3

#: Weight of the optimism prior penalising retrogression (beta relative to alpha).
RETRO_REG = 1e-2


def _network_params(
    params: Sequence[float] | FloatArray,
    num_nodes: FloatArray,
    num_replicas: FloatArray,
) -> tuple[FloatArray, FloatArray]:
    """Pick the (alpha, beta) network pair that applies to each configuration.

    Several nodes are bottlenecked by the inter-node link, several replicas on
    one node by the intra-node link, and a single replica does no all-reduce
    at all (both terms are the tiny floor).
    """
    multi_node = num_nodes > 1
    multi_replica = num_replicas > 1
    alpha = np.where(multi_node, params[2], np.where(multi_replica, params[4], NET_FLOOR)).astype(
        np.float64
    )
    beta = np.where(multi_node, params[3], np.where(multi_replica, params[5], NET_FLOOR)).astype(
        np.float64
    )
    return alpha, beta


def step_times(
    params: Sequence[float] | FloatArray,
    num_nodes: FloatArray,
    num_replicas: FloatArray,
    atomic_bsz: FloatArray,
) -> tuple[FloatArray, FloatArray]:
    """Model the accumulation-step and optimizer-step times.

    Args:
        params: The seven performance parameters in :class:`PerfParams` order.
        num_nodes: Nodes per configuration (broadcastable with the others).
        num_replicas: Replicas per configuration.
        atomic_bsz: Per-replica micro-batch size.

    Returns:
        ``(t_acc, t_opt)``: the compute-only time of one micro-batch, and the
        time of a synchronising step, where compute and all-reduce overlap as
        the gamma-norm of the two (gamma=1 adds them, large gamma takes the
        maximum). The norm is evaluated in log space to avoid overflow for
        large gamma.
    """
    gamma = float(params[6])
    t_acc = params[0] + params[1] * np.asarray(atomic_bsz, dtype=np.float64)
    alpha, beta = _network_params(params, num_nodes, num_replicas)
    retro = np.maximum(np.asarray(num_replicas, dtype=np.float64) - 2.0, NET_FLOOR)
    t_net = alpha + beta * retro
    with np.errstate(divide="ignore"):
        log_sum = np.logaddexp(gamma * np.log(t_acc), gamma * np.log(t_net))
    t_opt = np.exp(log_sum / gamma)
    return np.asarray(t_acc, dtype=np.float64), np.asarray(t_opt, dtype=np.float64)


class FitData(NamedTuple):
    """Profiled observations, already validated and converted to float arrays.

    The network pair of every observation is fixed by its configuration, so
    the masks and the retrogression factor are precomputed once per fit
    instead of once per loss evaluation.
    """

    atomic_bsz: FloatArray
    log_accum_time: FloatArray
    log_optim_time: FloatArray
    multi_node: NDArray[np.bool_]
    single_node_multi_replica: NDArray[np.bool_]
    retro: FloatArray

    @classmethod
    def build(
        cls,
        num_nodes: FloatArray,
        num_replicas: FloatArray,
        atomic_bsz: FloatArray,
        accum_step_time: FloatArray,
        optim_step_time: FloatArray,
    ) -> FitData:
        """Precompute the per-observation quantities the loss needs."""
        multi_node = num_nodes > 1
        return cls(
            atomic_bsz=atomic_bsz,
            log_accum_time=np.log(accum_step_time),
            log_optim_time=np.log(optim_step_time),
            multi_node=multi_node,
            single_node_multi_replica=~multi_node & (num_replicas > 1),
            retro=np.maximum(num_replicas - 2.0, NET_FLOOR),
        )


def fit_loss_and_grad(
    x: FloatArray, data: FitData, smoothing: float = RMSE_SMOOTH
) -> tuple[float, FloatArray]:
    """The fit objective and its exact gradient with respect to the parameters.

    The loss is the RMSE of the log accumulation-step time plus the RMSE of
    the log optimizer-step time (each smoothed by ``smoothing``), plus two
    weak priors: gamma towards 1 and small beta/alpha ratios (optimism about
    scaling when the data cannot tell).
    Working in log time makes the fit care about relative error, so fast and
    slow configurations weigh the same.

    Args:
        x: The seven parameters in :class:`PerfParams` order.
        data: The observations.

    Returns:
        ``(loss, gradient)`` with the gradient shaped like ``x``.
    """
    alpha_c, beta_c, alpha_n, beta_n, alpha_r, beta_r, gamma = (float(v) for v in x)
    n = data.atomic_bsz.shape[0]
    grad = np.zeros(7, dtype=np.float64)

    # Accumulation-step time: t_acc = alpha_c + beta_c * m.
    t_acc = alpha_c + beta_c * data.atomic_bsz
    log_acc = np.log(t_acc)
    resid_acc = log_acc - data.log_accum_time
    rmse_acc = float(np.sqrt(np.mean(resid_acc**2) + smoothing))
    # d rmse / d log_acc_i = resid_i / (n * rmse); at an exact fit without
    # smoothing the RMSE has a kink, and 0 is taken as its gradient.
    coef_acc = resid_acc / (n * rmse_acc) if rmse_acc > 0 else np.zeros_like(resid_acc)

    # Network time with the pair selected by each observation's configuration.
    alpha = np.where(
        data.multi_node, alpha_n, np.where(data.single_node_multi_replica, alpha_r, NET_FLOOR)
    )
    beta = np.where(
        data.multi_node, beta_n, np.where(data.single_node_multi_replica, beta_r, NET_FLOOR)
    )
    t_net = alpha + beta * data.retro
    log_net = np.log(t_net)

    # log t_opt = logsumexp(gamma*log t_acc, gamma*log t_net) / gamma.
    g_acc = gamma * log_acc
    g_net = gamma * log_net
    lse = np.logaddexp(g_acc, g_net)
    log_opt = lse / gamma
    w_acc = np.exp(g_acc - lse)  # share of t_acc**gamma in the p-norm sum
    w_net = np.exp(g_net - lse)
    resid_opt = log_opt - data.log_optim_time
    rmse_opt = float(np.sqrt(np.mean(resid_opt**2) + smoothing))
    coef_opt = resid_opt / (n * rmse_opt) if rmse_opt > 0 else np.zeros_like(resid_opt)

    # Chain rule: d log_opt / d t_acc = w_acc / t_acc, / d t_net = w_net / t_net,
    # and d log_opt / d gamma = (w_acc log t_acc + w_net log t_net - log_opt) / gamma.
    d_tacc = coef_acc / t_acc + coef_opt * w_acc / t_acc
    grad[0] = float(np.sum(d_tacc))
    grad[1] = float(np.sum(d_tacc * data.atomic_bsz))
    d_tnet = coef_opt * w_net / t_net
    grad[2] = float(np.sum(d_tnet[data.multi_node]))
    grad[3] = float(np.sum((d_tnet * data.retro)[data.multi_node]))
    grad[4] = float(np.sum(d_tnet[data.single_node_multi_replica]))
    grad[5] = float(np.sum((d_tnet * data.retro)[data.single_node_multi_replica]))
    grad[6] = float(np.sum(coef_opt * (w_acc * log_acc + w_net * log_net - log_opt) / gamma))

    # Priors.
    ratio_n = beta_n / alpha_n
    ratio_r = beta_r / alpha_r
    loss = (
        rmse_acc + rmse_opt + GAMMA_REG * (gamma - 1.0) ** 2 + RETRO_REG * (ratio_n**2 + ratio_r**2)
    )
    grad[6] += 2.0 * GAMMA_REG * (gamma - 1.0)
    grad[2] += -2.0 * RETRO_REG * ratio_n**2 / alpha_n
    grad[3] += 2.0 * RETRO_REG * ratio_n / alpha_n
    grad[4] += -2.0 * RETRO_REG * ratio_r**2 / alpha_r
    grad[5] += 2.0 * RETRO_REG * ratio_r / alpha_r
    return float(loss), grad


def fit_loss(x: FloatArray | Sequence[float], data: FitData) -> float:
    """The fit objective alone (see :func:`fit_loss_and_grad`)."""
    return fit_loss_and_grad(np.asarray(x, dtype=np.float64), data)[0]
