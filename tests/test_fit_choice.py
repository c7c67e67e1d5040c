"""What would fit: the candidates chosen for simulation with the allocator replay run lazily (cheapest first, until
enough fit) are those a replay of every candidate chooses."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulator.api import check_scenario
from simulator.errors import MemsimError
from simulator.explore.estimate import estimate_reports
from simulator.explore import fit
from simulator.explore.fit import _caches, _chosen, _forked_round, _keep, _ranked, single_changes
from simulator.forked import fork_safe
from simulator.scenario import load_scenario
from simulator.scenario.loader import read_scenario_document, scenario_from_dict

REPO = Path(__file__).resolve().parents[1]


def _candidates(path: Path, sets: list[str]):
    base = load_scenario(path, sets)
    document = read_scenario_document(str(path))
    out = []
    for change in single_changes(base, 1):
        try:
            candidate = scenario_from_dict(document, str(path), [*sets, *change.sets])
            check_scenario(candidate)
        except MemsimError:
            continue
        out.append((change, candidate))
    return out


def _chosen_replaying_all(candidates, verify: int, estimates: list) -> list:
    """The rule as it reads: every candidate estimated with the replay, then ranked."""
    fitting, unknown = _ranked(candidates, estimates)
    keep = _keep(verify, len(unknown))
    return ([change for _, change in fitting][:keep] + unknown)[:verify]


@pytest.mark.parametrize("path, sets, verifies", [
    # at sequence 3,584 8-bit Adam fits by peak allocated but not by peak reserved: the replay rejects it
    (REPO / "scenarios" / "showcase.toml", ["model.seq_length=3584"], (1, 3, 99)),
    # offload candidates the estimate cannot judge (one of them is always kept)
    (REPO / "scenarios" / "seeds" / "llama7b-adamw-4090.toml", [], (3,)),
])
def test_lazy_replay_chooses_what_replaying_every_candidate_chooses(path, sets, verifies):
    candidates = _candidates(path, sets)
    estimates = estimate_reports([scenario for _, scenario in candidates], errors="return")
    allocated = estimate_reports([scenario for _, scenario in candidates], errors="return", replay=False)
    assert any(not isinstance(a, MemsimError) and a["fits"] and not r["fits"]
               for a, r in zip(allocated, estimates)) or path.name != "showcase.toml"
    for verify in verifies:
        assert _chosen(candidates, verify) == _chosen_replaying_all(candidates, verify, estimates), verify


@pytest.mark.skipif(not fork_safe(), reason="forking is not safe here")
@pytest.mark.parametrize("path, sets, verifies", [
    (REPO / "scenarios" / "showcase.toml", ["model.seq_length=3584"], (1, 3, 99)),
    (REPO / "scenarios" / "seeds" / "llama7b-adamw-4090.toml", [], (3,)),
])
def test_replays_in_forked_children_choose_what_the_lazy_replay_chooses(path, sets, verifies, monkeypatch):
    # a stand-in simulation (the job's --set items): what is compared is which candidates are simulated, in order
    monkeypatch.setattr(fit, "_simulate", lambda job: list(job[2]))
    candidates = _candidates(path, sets)

    def job(change):
        return {}, str(path), [*change.sets]

    for verify in verifies:
        expected = _chosen(candidates, verify)
        for processes in (1, 2, 4):
            round_ = _forked_round(candidates, verify, _caches(), job, processes)
            assert [change for change, _ in round_] == expected, (verify, processes)
            assert [outcome for _, outcome in round_] == [list(change.sets) for change in expected]
