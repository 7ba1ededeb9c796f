"""The agreement rules and fault plans, without processes."""

from __future__ import annotations

import signal

import pytest
import torch

from greenswarm.averaging.agreement import FAILED, decide, group_key, majority, state_digest
from greenswarm.errors import ConfigError
from greenswarm.faults import FaultPlan
from greenswarm.node.round_log import RoundEntry, RoundLog, read_rounds

pytestmark = pytest.mark.compression

M = ["p1", "p2", "p3"]


def test_unanimous_group_applies() -> None:
    v = decide("p1", "d", {"p1": "d", "p2": "d", "p3": "d"}, M)
    assert v.action == "apply" and v.digest == "d" and v.holders == ["p2", "p3"]


def test_minority_member_resyncs_from_the_majority() -> None:
    v = decide("p3", "x", {"p1": "d", "p2": "d", "p3": "x"}, M)
    assert v.action == "resync" and v.digest == "d" and v.holders == ["p1", "p2"]
    assert "differs from the majority" in v.reason


def test_the_exchange_can_stop_at_a_strict_majority() -> None:
    """Once a digest has a strict majority, the silent members cannot change any member's verdict:
    the exchange stops waiting for them (a member whose all-reduce failed never answers)."""
    assert majority({"p1": "d", "p2": "d"}, M) == "d"
    for published in ({"p1": "d"}, {"p1": "d", "p2": "x"}, {"p1": "d", "p2": FAILED, "p3": FAILED}):
        assert majority(published, M) is None
    assert majority({"p1": "d", "p2": "d", "outsider": "d"}, ["p1", "p2", "p3", "p4"]) is None
    for published in ({"p1": "d", "p2": "d"}, {"p1": "d", "p2": "d", "p3": "x"}):  # what comes later
        assert decide("p1", "d", published, M).action == "apply"
        assert decide("p3", "x", published, M).action == "resync"


@pytest.mark.parametrize(
    "published",
    [
        {"p1": "d", "p2": "x"},  # a two-way split with one member silent
        {"p1": "d"},  # only this member answered
        {"p1": "d", "p2": FAILED, "p3": FAILED},  # the others' all-reduce failed
        {"p1": "d", "p2": "x", "p3": "y"},
        {},
    ],
)
def test_without_a_strict_majority_of_the_whole_group_nobody_applies(published: dict) -> None:
    v = decide("p1", "d", published, M)
    assert v.action == "fail" and v.digest is None and "majority of 2" in v.reason


def test_two_member_group_must_be_unanimous() -> None:
    assert decide("p1", "d", {"p1": "d", "p2": "d"}, M[:2]).action == "apply"
    assert decide("p1", "d", {"p1": "d", "p2": "x"}, M[:2]).action == "fail"


def test_votes_from_outside_the_group_are_ignored() -> None:
    v = decide("p1", "d", {"p1": "d", "intruder": "d", "other": "d"}, M)
    assert v.action == "fail"


def test_a_silent_member_does_not_block_a_majority() -> None:
    assert decide("p1", "d", {"p1": "d", "p2": "d"}, M).action == "apply"


def test_state_digest_sees_every_bit_dtype_and_shape() -> None:
    a = torch.arange(10, dtype=torch.float32)
    b = a.clone()
    b[3] = torch.nextafter(b[3], torch.tensor(100.0))
    assert state_digest([a]) == state_digest([a.clone()])
    assert state_digest([a]) != state_digest([b])
    assert state_digest([a]) != state_digest([a.view(2, 5)])
    assert state_digest([a]) != state_digest([a.double()])
    assert state_digest([a[:5], a[5:]]) != state_digest([a])


def test_group_key_names_round_lineage_and_members() -> None:
    k = group_key("s", 3, "l", ["b", "a"])
    assert k == group_key("s", 3, "l", ["a", "b"]) and k.startswith("s_agree_")
    assert len({k, group_key("s", 4, "l", ["a", "b"]), group_key("s", 3, "m", ["a", "b"])}) == 3
    assert k != group_key("s", 3, "l", ["a", "b", "c"])


def test_fault_plan_fires_on_the_named_visits() -> None:
    plan = FaultPlan.parse("corrupt-result@2, withhold-digest@*")
    assert [plan.fires("corrupt-result") for _ in range(3)] == [False, True, False]
    assert all(plan.fires("withhold-digest") for _ in range(3))
    assert not FaultPlan.parse("").fires("corrupt-result")


def test_min_group_counts_visits_only_in_groups_that_large() -> None:
    """``min-group@3``: a round of two is no visit at all; the first round of three is visit 1."""
    plan = FaultPlan.parse("corrupt-result@1,min-group@3")
    assert [plan.fires("corrupt-result", group) for group in (2, 2, 3, 3)] == [False, False, True, False]


def test_process_faults_wait_for_their_rounds_and_record_themselves(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    plan = FaultPlan.parse("after-rounds@1,kill:step@2,stop:allreduce@*")
    assert plan.actions == {"step": "kill", "allreduce": "stop"} and plan.armed("step")
    assert not plan.fires("step") and not plan.fires("step")  # held back: no averaged round yet
    plan.round_done()
    signals = []
    monkeypatch.setattr("greenswarm.faults.signal_site", lambda pid, sig: signals.append((pid, sig)))
    plan.record = str(tmp_path / "run" / "faults.jsonl")
    plan.hit("step")
    plan.hit("step")  # the second visit since the round: fires
    assert signals == [(plan.site_pid, signal.SIGKILL)]
    (line,) = (tmp_path / "run" / "faults.jsonl").read_text().splitlines()
    assert '"point": "step"' in line and '"action": "kill"' in line


def test_round_log_skips_a_torn_last_line(tmp_path) -> None:  # noqa: ANN001
    log = RoundLog(tmp_path, started=0.0)
    log.write(RoundEntry(slot=1, action="apply", outer_round=1, lineage="l", digest="d"))
    with open(tmp_path / "rounds.jsonl", "a") as f:
        f.write('{"slot": 2, "act')  # killed mid-write
    (entry,) = read_rounds(tmp_path / "rounds.jsonl")
    assert entry["action"] == "apply" and entry["pid"] > 0


@pytest.mark.parametrize(
    "text",
    [
        "explode@1",
        "corrupt-result@0",
        "corrupt-result@x",
        "kill:nowhere@1",
        "zap:step@1",
        "step@1",
        "min-group@x",
    ],
)
def test_fault_plan_errors_name_the_variable(text: str) -> None:
    with pytest.raises(ConfigError, match="GREENSWARM_FAULTS"):
        FaultPlan.parse(text)
