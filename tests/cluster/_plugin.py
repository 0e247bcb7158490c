"""A deterministic policy for cluster tests, loaded into daemons with ``--plugin``.

``test-fair`` splits the slots of the single local node equally between the
active jobs in submission order, capped by each job's ``max_replicas`` and
raised to its ``min_replicas``; left-over slots go to the oldest jobs that can
still grow. It reacts to hints (``max_replicas`` grows with
``maxProfiledReplicas``) like the real policies, but with no solver noise, so
tests can predict resizes.
"""

from __future__ import annotations

from collections.abc import Mapping

from adaptdl.sched import Allocation, Decision, JobInfo, NodeInfo, Policy, register_policy


class FairPolicy(Policy):
    """Equal shares of one node's slots."""

    name = "test-fair"

    def optimize(
        self,
        jobs: Mapping[str, JobInfo],
        nodes: Mapping[str, NodeInfo],
        previous: Mapping[str, Allocation],
        now: float,
    ) -> Decision:
        del previous, now
        node = sorted(nodes)[0]
        info = nodes[node]
        resource = next(iter(info.resources))
        slots = info.resources[resource]
        order = sorted(jobs, key=lambda name: (jobs[name].submission_time, name))
        counts = {name: 0 for name in order}
        free = slots
        for name in order:  # minimums first, oldest first
            need = jobs[name].min_replicas
            if need <= free:
                counts[name] = need
                free -= need
        grew = True
        while free > 0 and grew:
            grew = False
            for name in order:
                if free > 0 and counts[name] < jobs[name].max_replicas:
                    counts[name] += 1
                    free -= 1
                    grew = True
        return Decision({name: (node,) * count for name, count in counts.items()})


register_policy("test-fair", FairPolicy)
