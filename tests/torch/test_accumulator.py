"""Accumulator: modes, arithmetic, and idempotent replay across restarts."""

from __future__ import annotations

import re
from typing import Any

import pytest

import adaptdl.torch as adt
from adaptdl import collective, env
from adaptdl.testing import run_elastic


def test_accumulation_mode_reads_like_an_empty_dict() -> None:
    acc = adt.Accumulator()
    acc["a"] += 2
    acc["a"] += 3
    acc["b"] -= 1
    acc.update({"c": 1}, d=2)
    acc += {"c": 1}
    acc -= {"d": 0.5}
    acc.subtract(e=4)
    assert len(acc) == 0 and "a" not in acc and list(acc) == []
    with pytest.raises(TypeError, match="synchronized"):
        acc["a"] = 1
    with pytest.raises(TypeError, match="synchronized"):
        del acc["a"]
    with acc.synchronized():
        assert dict(acc) == {"a": 5, "b": -1, "c": 2, "d": 1.5, "e": -4}
        acc["f"] = 10  # plain dict in synchronized mode
        acc["a"] += 1
        with acc.synchronized():  # nested: no new synchronisation
            assert acc["a"] == 6
    acc["a"] += 1
    with acc.synchronized():
        assert acc["a"] == 7 and acc["f"] == 10
        acc.clear()
        assert len(acc) == 0
    with acc.synchronized():
        assert dict(acc) == {}


def test_updates_do_not_keep_the_callers_objects() -> None:
    # update() stored the caller's tensor itself: changing it in place later
    # changed the sum, and "/=" inside synchronized() halved the caller's.
    import torch

    acc = adt.Accumulator()
    given = torch.tensor([1.0, 2.0])
    acc.update(loss=given)
    given.mul_(100)
    with acc.synchronized():
        assert acc["loss"].tolist() == [1.0, 2.0]
        mine = torch.tensor([1.0, 2.0])
        acc.update(t=mine)
        acc["t"] /= 2
        assert acc["t"].tolist() == [0.5, 1.0]
    assert mine.tolist() == [1.0, 2.0]
    acc.update(items=[1])  # what does not add to 0 is kept as it is
    with acc.synchronized():
        assert acc["items"] == [1]


def test_text_updates_are_refused() -> None:
    # Summed across replicas, "abc" came back as "abcabc..." in rank order.
    acc = adt.Accumulator()
    with pytest.raises(TypeError, match="Accumulator update of 'x' with str 'abc'"):
        acc.update(x="abc")
    with pytest.raises(TypeError, match="updates are summed across replicas"):
        acc += {"y": b"raw"}
    with pytest.raises(TypeError):
        acc["z"] += "abc"  # 0 + "abc": refused by the arithmetic itself
    with acc.synchronized():
        assert dict(acc) == {}
        acc["name"] = "run-1"  # assignment in synchronized mode is a plain dict's
        assert acc["name"] == "run-1"


def test_initial_values_are_results() -> None:
    acc = adt.Accumulator({"x": 1}, y=2)
    acc["x"] += 1
    with acc.synchronized():
        assert dict(acc) == {"x": 2, "y": 2}


def _job(schedule: list[int]) -> Any:
    """Each replica adds its rank+1; restarts mid-epoch must not double count."""
    adt.init_process_group("gloo")
    import torch
    from torch.utils.data import TensorDataset

    loader = adt.AdaptiveDataLoader(TensorDataset(torch.arange(24)), batch_size=4)
    acc = adt.Accumulator()
    history = []
    generation = env.num_restarts()
    for epoch in adt.remaining_epochs_until(4):
        acc["epochs"] += 1 if env.replica_rank() == 0 else 0
        for i, (batch,) in enumerate(loader):
            acc["samples"] += len(batch)
            acc["total"] += int(batch.sum())
            acc["neg"] -= len(batch)
            if generation < len(schedule) and epoch == 1 + generation and i == 1:
                adt.request_checkpoint(exit=True)
        with acc.synchronized():
            history.append((epoch, dict(acc)))
            if epoch == 2:
                acc.clear()
    collective.teardown()
    return history


def test_idempotent_replay_across_1_4_2_replicas() -> None:
    reference = run_elastic(_job, 1, args=([],), timeout=60).final.results[0]
    result = run_elastic(_job, [1, 4, 2], args=([4, 2],), timeout=120)
    assert [g.num_replicas for g in result.generations] == [1, 4, 2]
    final = result.final.results
    assert final[0] == final[1]
    # The last generation starts in epoch 2 (interrupted) and must agree with
    # the uninterrupted run from there on.
    expected = dict(reference)
    for epoch, values in final[0]:
        assert values == expected[epoch], epoch
    assert expected[1] == {"epochs": 2, "samples": 48, "total": 2 * 276, "neg": -48}
    assert expected[3]["samples"] == 24  # cleared after epoch 2


def _outside_job(stop: bool) -> Any:
    """Counts epochs outside loader loops and synchronizes only at the end."""
    adt.init_process_group("gloo")
    import torch
    from torch.utils.data import TensorDataset

    loader = adt.AdaptiveDataLoader(TensorDataset(torch.arange(24)), batch_size=4)
    acc = adt.Accumulator()
    for epoch in adt.remaining_epochs_until(3):
        for i, _ in enumerate(loader):
            if stop and env.num_restarts() == 0 and epoch == 1 and i == 2:
                adt.request_checkpoint(exit=True)
        acc["epochs"] += 1
    with acc.synchronized():
        value = acc["epochs"]
    collective.teardown()
    return [value]  # not an int: that would ask run_elastic for a restart


@pytest.mark.usefixtures("agree_every_step")
def test_outside_updates_of_finished_epochs_survive_a_restart() -> None:
    # Epoch 0's update is still pending when epoch 1 is interrupted; it must
    # be saved (no replay repeats it), while epoch 1's is made again.
    uninterrupted = run_elastic(_outside_job, 2, args=(False,), timeout=60)
    interrupted = run_elastic(_outside_job, [2, 2], args=(True,), timeout=60)
    assert interrupted.generations[0].exit_codes == [143, 143]
    assert uninterrupted.final.results == [[6], [6]]
    assert interrupted.final.results == [[6], [6]]


def _boundary_job(stop: bool) -> Any:
    """Updates before the epoch loop; the checkpoint falls between two epochs."""
    adt.init_process_group("gloo")
    import torch
    from torch.utils.data import TensorDataset

    loader = adt.AdaptiveDataLoader(TensorDataset(torch.arange(16)), batch_size=4)
    acc = adt.Accumulator()
    acc["before"] += 1
    for epoch in adt.remaining_epochs_until(3):
        for (x,) in loader:
            acc["samples"] += len(x)
        acc["epochs"] += 1
        if stop and env.num_restarts() == 0 and epoch == 1:
            adt.request_checkpoint(exit=True)  # served at the next epoch boundary
    acc["after"] += 1
    with acc.synchronized():
        value = dict(acc)
    collective.teardown()
    return [value]


@pytest.mark.parametrize("schedule", [[2, 2], [2, 3]])
def test_updates_before_the_epoch_loop_are_not_counted_twice_at_an_epoch_boundary(
    schedule: list[int],
) -> None:
    result = run_elastic(_boundary_job, schedule, args=(True,), timeout=90)
    assert result.generations[0].exit_codes == [143, 143]
    replicas = schedule[-1]
    # "before" ran before the checkpoint: it counts as the first generation's
    # two replicas made it (the restart runs it again only as a dry run that
    # entering the epoch loop undoes), like the epochs that generation
    # finished. Each replica of the last generation made "after" once. (The
    # sampler pads the last epoch's 16 samples to a multiple of replicas.)
    samples = 32 + -(-16 // replicas) * replicas
    expected = {"before": 2, "after": replicas, "samples": samples, "epochs": 4 + replicas}
    assert result.final.results[0] == [expected]


def test_accumulation_mode_get_pop_setdefault_act_on_an_empty_dict() -> None:
    acc = adt.Accumulator()
    acc["k"] += 1
    assert acc.get("k") is None and acc.get("k", "default") == "default"
    assert acc.pop("k", 0) == 0
    with pytest.raises(KeyError):
        acc.pop("k")
    with pytest.raises(TypeError, match="synchronized"):
        acc.setdefault("k", 5)
    with acc.synchronized():
        assert acc.get("k") == 1 and acc.setdefault("j", 2) == 2
        assert acc.pop("j") == 2 and dict(acc) == {"k": 1}


def _per_epoch_job(stop: bool) -> Any:
    """A new loader and Accumulator every epoch, as in the tutorial."""
    adt.init_process_group("gloo")
    import torch
    from torch.utils.data import TensorDataset

    from adaptdl import checkpoint

    history = []
    registered = []
    for epoch in adt.remaining_epochs_until(12):
        loader = adt.AdaptiveDataLoader(TensorDataset(torch.arange(16)), batch_size=4)
        stats = adt.Accumulator()
        for i, (batch,) in enumerate(loader):
            stats["total"] += int(batch.sum()) * (epoch + 1)
            if stop and env.num_restarts() == 0 and epoch == 8 and i == 2:
                adt.request_checkpoint(exit=True)
        with stats.synchronized():
            history.append((epoch, stats["total"]))
        names = [s.name for s in checkpoint.registered_states()]
        registered.append(sum(re.search(r"-epoch[0-9]", name) is not None for name in names))
    collective.teardown()
    return history, registered


@pytest.mark.usefixtures("agree_every_step")
def test_states_of_finished_epochs_leave_the_checkpoint() -> None:
    uninterrupted = run_elastic(_per_epoch_job, 2, args=(False,), timeout=60)
    interrupted = run_elastic(_per_epoch_job, [2, 1], args=(True,), timeout=90)
    assert interrupted.generations[0].exit_codes == [143, 143]
    reference = dict(uninterrupted.final.results[0][0])
    assert reference[0] == 120 and reference[11] == 120 * 12
    # The interrupted epoch is replayed from the saved position and totals agree.
    history, registered = interrupted.final.results[0]
    assert [epoch for epoch, _ in history] == [8, 9, 10, 11]
    assert dict(history) == {e: reference[e] for e in (8, 9, 10, 11)}
    # Only the current epoch's loader and Accumulator are registered: before,
    # every finished epoch added two states to every later checkpoint.
    assert registered == [2, 2, 2, 2]
    assert uninterrupted.final.results[0][1] == [2] * 12


def _looped_outside_job(stops: list[tuple[int, str, int]]) -> Any:
    """Sums made in loader loops before and after the epoch loop.

    ``stops`` lists (generation, where, step) at which to checkpoint and
    exit: where is an epoch number as a string, or "before" or "after" for
    the loops before and after the epoch loop.
    """
    adt.init_process_group("gloo")
    import torch
    from torch.utils.data import TensorDataset

    evaluation = adt.AdaptiveDataLoader(TensorDataset(torch.arange(16)), batch_size=4)
    training = adt.AdaptiveDataLoader(TensorDataset(torch.arange(16)), batch_size=4)
    acc = adt.Accumulator()

    def stop(where: str, step: int) -> None:
        if (env.num_restarts(), where, step) in stops:
            adt.request_checkpoint(exit=True)

    for i, (x,) in enumerate(evaluation):
        acc["before"] += len(x)
        stop("before", i)
    for epoch in adt.remaining_epochs_until(3):
        for i, (x,) in enumerate(training):
            acc["samples"] += len(x)
            stop(str(epoch), i)
    for i, (x,) in enumerate(evaluation):
        acc["after"] += len(x)
        stop("after", i)
    with acc.synchronized():
        value = dict(acc)
    collective.teardown()
    return [value]


@pytest.mark.usefixtures("agree_every_step")
def test_sums_of_loops_outside_epochs_are_not_counted_twice_after_a_restart() -> None:
    # The loop before the epoch loop finished before the first two
    # checkpoints and runs whole again after each restart: its sums were
    # counted again on top of the saved ones. The loop after the epoch loop
    # is interrupted, resumes at its position, and keeps the sums made before
    # the checkpoint, also through a third checkpoint, taken in the loop
    # before the epoch loop, which in turn resumes.
    stops = [(0, "1", 1), (1, "after", 1), (2, "before", 1)]
    result = run_elastic(_looped_outside_job, [2, 1, 2, 1], args=(stops,), timeout=120)
    assert [g.exit_codes for g in result.generations[:3]] == [[143, 143], [143], [143, 143]]
    assert result.final.results == [[{"before": 16, "samples": 48, "after": 16}]]


def test_a_checkpoint_written_before_loops_outside_epochs_were_told_apart_loads(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pickle

    from adaptdl import checkpoint

    # The earlier format: (history, results, carried), without the updates of
    # a loop outside epochs kept apart.
    class Written(checkpoint.State):
        _adaptdl_owns_name = True  # the library's own name, as the old version wrote it

    state = Written("adaptdl-accumulator-epochNone-0")
    state.save = lambda f: pickle.dump(({}, {"n": 1}, {"n": 2}), f)  # type: ignore[method-assign]
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path))
    checkpoint.save_state(state, tmp_path)
    state.unregister()
    acc = adt.Accumulator()
    acc["n"] += 4
    with acc.synchronized():
        assert dict(acc) == {"n": 7}


def _dry_run_job(mode: str, stops: list[tuple[int, str]]) -> Any:
    """Work before the epoch loop, folded in by a synchronisation before a checkpoint.

    ``stops`` are (generation, place) checkpoints: ``pre{i}`` at step ``i`` of
    the loop before the epoch loop, ``e{epoch}-{i}`` in the epochs.
    """
    import torch
    from torch.utils.data import TensorDataset

    adt.init_process_group("gloo")
    evaluation = adt.AdaptiveDataLoader(TensorDataset(torch.arange(16)), batch_size=4)
    training = adt.AdaptiveDataLoader(TensorDataset(torch.arange(16)), batch_size=4)
    acc = adt.Accumulator()

    def stop(place: str) -> None:
        if (env.num_restarts(), place) in stops:
            adt.request_checkpoint(exit=True)

    if mode in ("plain", "sync-before"):
        acc["plain"] += 8
    if mode != "plain":
        for i, (x,) in enumerate(evaluation):
            acc["before"] += len(x)
            if mode == "loop-sync":
                with acc.synchronized():
                    pass
            stop(f"pre{i}")
    if mode == "sync-before":
        with acc.synchronized():
            pass
    seen = []
    for epoch in adt.remaining_epochs_until(3):
        for i, (x,) in enumerate(training):
            acc["samples"] += len(x)
            stop(f"e{epoch}-{i}")
        with acc.synchronized():
            seen.append((epoch, dict(acc)))
    collective.teardown()
    return seen


@pytest.mark.usefixtures("agree_every_step")
@pytest.mark.parametrize("mode", ["plain", "loop", "loop-sync", "sync-before"])
def test_work_before_the_epoch_loop_is_counted_once_after_a_restart(mode: str) -> None:
    # Epoch 0's synchronisation folds the work done before the epoch loop
    # into the results, which the checkpoint in epoch 1 saves; the restart
    # ran that work again and counted it twice ("plain", "loop",
    # "loop-sync"). A synchronisation before the epoch loop replayed its
    # recorded results and so dropped epoch 0's samples ("sync-before").
    reference = dict(run_elastic(_dry_run_job, 2, args=(mode, []), timeout=60).final.results[0])
    restarted = run_elastic(_dry_run_job, [2, 2], args=(mode, [(0, "e1-1")]), timeout=60)
    assert restarted.generations[0].exit_codes == [143, 143]
    history = restarted.final.results[0]
    assert [epoch for epoch, _ in history] == [1, 2]
    assert dict(history) == {1: reference[1], 2: reference[2]}


@pytest.mark.usefixtures("agree_every_step")
def test_a_checkpoint_during_the_dry_run_saves_the_previous_checkpoints_sums() -> None:
    # The second checkpoint comes while the code before the epoch loop runs
    # again after the first restart. It saved that dry run's state, and the
    # third generation counted the work before the loop twice on top of
    # results the replayed synchronisation had rewound.
    uninterrupted = run_elastic(_dry_run_job, 2, args=("sync-before", []), timeout=60)
    reference = dict(uninterrupted.final.results[0])
    stops = [(0, "e1-1"), (1, "pre1")]
    restarted = run_elastic(_dry_run_job, [2, 2, 2], args=("sync-before", stops), timeout=90)
    assert [g.exit_codes for g in restarted.generations[:2]] == [[143, 143], [143, 143]]
    history = restarted.final.results[0]
    assert [epoch for epoch, _ in history] == [1, 2]
    assert dict(history) == {1: reference[1], 2: reference[2]}


def _in_loop_sync_job(where: str, stop: bool) -> Any:
    """Updates outside a loader loop, then a synchronisation inside it, then a checkpoint."""
    import torch
    from torch.utils.data import TensorDataset

    adt.init_process_group("gloo")
    evaluation = adt.AdaptiveDataLoader(TensorDataset(torch.arange(16)), batch_size=4)
    training = adt.AdaptiveDataLoader(TensorDataset(torch.arange(16)), batch_size=4)
    acc = adt.Accumulator()
    seen = []
    if where == "before":
        acc["pre"] += 1
        for i, (x,) in enumerate(evaluation):
            acc["evaluated"] += len(x)
            if i == 0:
                with acc.synchronized():
                    pass
            if stop and env.num_restarts() == 0 and i == 2:
                adt.request_checkpoint(exit=True)
    for epoch in adt.remaining_epochs_until(3):
        acc["epochs"] += 1
        for i, (x,) in enumerate(training):
            acc["samples"] += len(x)
            if i == 1:
                with acc.synchronized():
                    pass
            if stop and where == "epoch" and env.num_restarts() == 0 and (epoch, i) == (1, 2):
                adt.request_checkpoint(exit=True)
        with acc.synchronized():
            seen.append((epoch, dict(acc)))
    collective.teardown()
    return seen


@pytest.mark.usefixtures("agree_every_step")
@pytest.mark.parametrize("where", ["epoch", "before"])
def test_updates_folded_in_by_a_sync_inside_a_loop_are_not_counted_twice(where: str) -> None:
    # The synchronisation inside the loader loop folded in the updates made
    # before the loop (in the epoch, or before the epoch loop); the checkpoint
    # saved them with the results and the restart made them again: epochs 6
    # instead of 4 after epoch 1.
    uninterrupted = run_elastic(_in_loop_sync_job, 2, args=(where, False), timeout=60)
    reference = dict(uninterrupted.final.results[0])
    restarted = run_elastic(_in_loop_sync_job, [2, 2], args=(where, True), timeout=60)
    assert restarted.generations[0].exit_codes == [143, 143]
    history = dict(restarted.final.results[0])
    assert history == {epoch: reference[epoch] for epoch in history}
    assert sorted(history) == ([1, 2] if where == "epoch" else [0, 1, 2])


def _made_in_epoch_job(where: str, stops: list[int]) -> Any:
    """An Accumulator made in epoch 1, or after the epoch loop; checkpoints at ``stops``."""
    import torch
    from torch.utils.data import TensorDataset

    adt.init_process_group("gloo")
    loader = adt.AdaptiveDataLoader(TensorDataset(torch.arange(40)), batch_size=4)
    totals = []

    def count(acc: adt.Accumulator) -> None:
        for (batch,) in loader:
            acc["n"] += len(batch)
            done = env.num_restarts()
            if done < len(stops) and loader._elastic.current_index == stops[done]:
                adt.request_checkpoint(exit=True)
        with acc.synchronized():
            totals.append(acc["n"])

    for epoch in adt.remaining_epochs_until(2):
        if where == "epoch" and epoch == 1:
            count(adt.Accumulator())
    if where == "after":
        count(adt.Accumulator())
    collective.teardown()
    return totals


@pytest.mark.usefixtures("agree_every_step")
@pytest.mark.parametrize("where", ["epoch", "after"])
def test_an_accumulator_made_after_its_epoch_loop_began_survives_two_restarts(where: str) -> None:
    # Loaded after the epoch loop was entered, it waited for that entry to
    # undo a dry run, so every later checkpoint saved the first one's sums
    # again: 24 of the 40 samples after the second restart.
    restarted = run_elastic(_made_in_epoch_job, [1, 1, 1], args=(where, [8, 24]), timeout=90)
    assert [gen.exit_codes for gen in restarted.generations[:2]] == [[143], [143]]
    assert restarted.final.results[0] == [40]


def _sync_then_loop_sync_job(stop: bool) -> Any:
    """A synchronisation outside the loader loop, then one inside it, then a checkpoint."""
    import torch
    from torch.utils.data import TensorDataset

    adt.init_process_group("gloo")
    acc = adt.Accumulator()
    loader = adt.AdaptiveDataLoader(TensorDataset(torch.arange(40)), batch_size=4)
    seen = []
    for _ in adt.remaining_epochs_until(1):
        with acc.synchronized():
            seen.append(dict(acc))
            acc["syncs"] = acc.get("syncs", 0) + 1
        for i, (batch,) in enumerate(loader):
            acc["n"] += len(batch)
            if i == 3:
                with acc.synchronized():
                    acc["looped"] = 1
            if stop and env.num_restarts() == 0 and i == 6:
                adt.request_checkpoint(exit=True)
        with acc.synchronized():
            seen.append(dict(acc))
    collective.teardown()
    return seen


@pytest.mark.usefixtures("agree_every_step")
def test_a_replayed_sync_keeps_what_a_later_sync_inside_the_loop_folded_in() -> None:
    # The replay of the first synchronisation put back its recorded results
    # for good, dropping the 16 samples (and the assignment) that the one
    # inside the loop had folded in before the checkpoint: n was 24.
    uninterrupted = run_elastic(_sync_then_loop_sync_job, 2, args=(False,), timeout=60)
    assert uninterrupted.final.results[0] == [{}, {"syncs": 1, "n": 40, "looped": 1}]
    restarted = run_elastic(_sync_then_loop_sync_job, [2, 2], args=(True,), timeout=60)
    assert restarted.generations[0].exit_codes == [143, 143]
    # The replayed block still sees the results of its moment.
    assert restarted.final.results[0] == uninterrupted.final.results[0]


def _folded_then_recorded_job(stop: bool) -> Any:
    """An update outside loops, folded by a sync in a loop, then recorded by one outside."""
    import torch
    from torch.utils.data import TensorDataset

    adt.init_process_group("gloo")
    train = adt.AdaptiveDataLoader(TensorDataset(torch.arange(4)), batch_size=2)
    valid = adt.AdaptiveDataLoader(TensorDataset(torch.arange(4)), batch_size=2)
    acc = adt.Accumulator()
    seen = []
    for epoch in adt.remaining_epochs_until(2):
        if env.replica_rank() == 0:
            acc["epochs"] += 1
        for _ in train:
            with acc.synchronized():
                pass
        with acc.synchronized():
            seen.append((epoch, acc["epochs"]))
        for _ in valid:
            if stop and env.num_restarts() == 0 and epoch == 0:
                adt.request_checkpoint(exit=True)
    collective.teardown()
    return seen


@pytest.mark.usefixtures("agree_every_step")
def test_an_update_folded_in_a_loop_then_recorded_outside_is_kept() -> None:
    # The checkpoint took the folded update back out of the saved results,
    # and the replayed sync outside the loop dropped its re-made copy: the
    # count stayed one short for the rest of the run.
    uninterrupted = run_elastic(_folded_then_recorded_job, 1, args=(False,), timeout=60)
    assert uninterrupted.final.results[0] == [(0, 1), (1, 2)]
    restarted = run_elastic(_folded_then_recorded_job, [1, 2], args=(True,), timeout=60)
    assert restarted.generations[0].exit_codes == [143]
    assert restarted.final.results[0] == [(0, 1), (1, 2)]


def test_one_bad_update_is_named_and_the_others_are_kept() -> None:
    import numpy as np

    from adaptdl.torch import Accumulator

    # A shape mismatch in one key made the sync raise after every pending
    # update had been taken: loss +3 and n +5 were lost, and the key unnamed.
    acc = Accumulator()
    acc["loss"] += 2.0
    acc["n"] += 10
    acc["vec"] += np.zeros(3)
    with acc.synchronized():
        pass
    acc["loss"] += 3.0
    acc["n"] += 5
    acc["vec"] += np.zeros(4)
    with pytest.raises(
        TypeError,
        match=r"key 'vec': cannot add the update ndarray of shape \(4,\) to ndarray of shape "
        r"\(3,\).*dropped",
    ):
        with acc.synchronized():
            pass
    with acc.synchronized():
        assert (acc["loss"], acc["n"]) == (5.0, 15)
        assert acc["vec"].shape == (3,)


def test_bad_updates_are_named_by_key_whichever_way_they_are_made() -> None:
    # += and subtract() gave bare operator errors naming neither key nor
    # value, and update({"z": None}) poisoned the key.
    from adaptdl.torch import Accumulator

    acc = Accumulator()
    for make, key in (
        (lambda: acc.__setitem__("x", _add(acc["x"], "abc")), "x"),
        (lambda: acc.__setitem__("y", _add(acc["y"], [1])), "y"),
        (lambda: acc.subtract({"w": "abc"}), "w"),
        (lambda: acc.update({"z": None}), "z"),
    ):
        with pytest.raises(TypeError, match=f"Accumulator update of '{key}' with"):
            make()
    acc["ok"] += 1
    with acc.synchronized():
        assert dict(acc) == {"ok": 1}


def _add(value: Any, other: Any) -> Any:
    value += other
    return value
