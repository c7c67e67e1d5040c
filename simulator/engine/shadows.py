"""Shadow traffic: which groups and pairs of unsimulated ranks run the communication a simulated rank posts.

Under the symmetry reduction each stage's representative (dp 0, tp 0) stands for the rest of its stage. When
it posts a collective, the other groups of the same axis over the ranks it represents run the same
collective; when it sends to another stage, each rank it represents sends to its own peer there. The
engine's NetworkModel starts those as shadow operations that load the links without anyone waiting for them
(engine/network_model.py); this class only finds the groups and pairs, remembering each answer.
"""

from __future__ import annotations

from simulator.parallel.plan import ParallelPlan

AXES_TRIED = ("tp", "dp", "pp")


class ShadowRanks:
    """The unsimulated ranks a plan's simulated ranks stand for, and the groups and pairs they communicate in.

    Args:
        plan: the parallel plan (None: no shadows).
        simulated: the ranks that have programs.
    """

    def __init__(self, plan: ParallelPlan | None, simulated: frozenset[int]):
        self.plan = plan
        self.simulated = simulated
        self._represented: dict[int, tuple[int, ...]] = {}
        self._groups: dict[tuple, tuple[tuple[int, ...], ...]] = {}   # (kind, group) -> groups()
        self._pairs: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {}   # (src, dst) -> pairs()

    def represented(self, rank: int) -> tuple[int, ...]:
        """Unsimulated ranks `rank` stands for: the rest of its stage when it is the stage's representative."""
        plan = self.plan
        if plan is None or not 0 <= rank < plan.world_size:
            return ()
        found = self._represented.get(rank)
        if found is None:
            stage = plan.stage_of(rank)
            found = () if plan.rank_of(dp=0, pp=stage, tp=0) != rank else \
                tuple(r for r in plan.stage_ranks(stage) if r not in self.simulated)
            self._represented[rank] = found
        return found

    def groups(self, kind: str, group: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """Groups of the same axis that unsimulated, represented ranks run the same collective over."""
        key = (kind, group)
        if key in self._groups:
            return self._groups[key]
        plan = self.plan
        found: dict[tuple[int, ...], None] = {}
        if plan is not None and len(self.simulated) < plan.world_size \
                and all(0 <= r < plan.world_size for r in group):
            members = sorted(group)
            axis = next((a for a in AXES_TRIED if sorted(plan.group_of(members[0], a)) == members), None)
            if axis is not None:
                # Position in the real group's listing of each axis coordinate (broadcast root first); a
                # group_of tuple lists its members in coordinate order, so member i has coordinate i.
                listed = {plan.group_of(r, axis).index(r): i for i, r in enumerate(group)}
                seen: set[tuple[int, ...]] = set()
                covered: set[int] = set()       # members of the groups in `seen` (each rank is in one group)
                for rank in group:
                    if rank not in self.simulated:
                        continue
                    for other in self.represented(rank):
                        if other in covered:
                            continue
                        shadow_group = plan.group_of(other, axis)
                        if shadow_group in seen:
                            continue
                        seen.add(shadow_group)
                        covered.update(shadow_group)
                        if any(r in self.simulated for r in shadow_group):
                            continue
                        # keep the members in the order the real group lists them (broadcast root first)
                        keys = [listed.get(i, i) for i in range(len(shadow_group))]
                        ordered = tuple(r for _, r in sorted(zip(keys, shadow_group)))
                        found.setdefault(ordered, None)
            elif len(group) == 2:
                self._embedding_groups(group, found)
        result = tuple(found)
        self._groups[key] = result
        return result

    def _embedding_groups(self, group: tuple[int, ...], found: dict[tuple[int, ...], None]) -> None:
        """A two-rank group of one (dp, tp) across two stages (Megatron's embedding group when pp > 2): the
        same pair of stages of every represented (dp, tp) copy."""
        plan = self.plan
        first, second = (plan.coords(r) for r in group)
        if (first.dp, first.tp) != (second.dp, second.tp) or first.pp == second.pp:
            return
        for rank in group:
            if rank not in self.simulated:
                continue
            for other in self.represented(rank):
                c = plan.coords(other)
                pair = (plan.rank_of(dp=c.dp, pp=first.pp, tp=c.tp), plan.rank_of(dp=c.dp, pp=second.pp, tp=c.tp))
                if not any(r in self.simulated for r in pair):
                    found.setdefault(pair, None)

    def pairs(self, src: int, dst: int) -> tuple[tuple[int, int], ...]:
        """Stage-to-stage pairs of unsimulated ranks that (src, dst) stand for (remembered per pair)."""
        key = (src, dst)
        found = self._pairs.get(key)
        if found is not None:
            return found
        plan = self.plan
        if plan is None or len(self.simulated) == plan.world_size \
                or not (0 <= src < plan.world_size and 0 <= dst < plan.world_size):
            found = ()
        else:
            # The represented ranks are the rest of src's stage: each one's peer at (its dp, dst's stage, its tp)
            # is a whole number of pipeline strides away.
            shift = (plan.stage_of(dst) - plan.stage_of(src)) * plan.stride("pp")
            simulated = self.simulated
            found = tuple((other, other + shift) for other in self.represented(src)
                          if shift != 0 and other + shift not in simulated)
        self._pairs[key] = found
        return found
