"""RankState.quiet remembers the stream that made it False: its answer equals the full test at every call."""

from __future__ import annotations

import pytest

import simulator.api as api
from simulator.engine.options import EngineOptions
from simulator.engine.rank_state import RankState
from simulator.scenario import scenario_from_dict
from test_scale_inline import _doc, _everything


@pytest.mark.parametrize("nodes, global_batch, parallel", [
    (2, 32, {"tp": 8, "pp": 2, "dp": 1, "schedule": "interleaved-1f1b", "virtual_stages": 2,
             "sequence_parallel": True}),
])
def test_remembered_answer_is_the_full_test(monkeypatch, nodes, global_batch, parallel):
    # Without send_lookahead, whose pending Sends followed by their Free were the loud streams here.
    monkeypatch.setattr(api, "EngineOptions", lambda: EngineOptions(send_lookahead=False))
    doc = _doc(nodes, global_batch, **parallel)
    before = _everything(api.simulate(scenario_from_dict(doc)))
    real = RankState.quiet
    answers = {"remembered": 0}

    def checked(self):
        loud = self._loud
        remembered = loud is not None and self.blocked.get(loud[0]) is loud[1] and loud[0] not in self.parked
        self._loud = None
        full = real(self)                       # the whole test, nothing remembered
        self._loud = loud
        answer = real(self)
        assert answer == full
        answers["remembered"] += remembered
        return answer

    monkeypatch.setattr(RankState, "quiet", checked)
    assert _everything(api.simulate(scenario_from_dict(doc))) == before
    assert answers["remembered"] > 0          # the memo was used, so the comparison above tested it
