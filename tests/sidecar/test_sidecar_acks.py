"""The ack table: every situation, first and last delivery."""

from __future__ import annotations

import pytest

from lorafleet.core.wire import ERR_ADAPTER, ERR_DEADLINE, ERR_INVALID, ERR_MALFORMED, ERR_RUNTIME
from lorafleet.sidecar.acks import ACK_TABLE, REPLY_RESULT, Settle, Situation, decide, is_last_delivery


def test_table_covers_every_situation_on_both_deliveries() -> None:
    assert set(ACK_TABLE) == {(s, last) for s in Situation for last in (False, True)}


def test_nothing_is_dropped_silently() -> None:
    # A task either gets a reply and leaves the queue, or stays for a retry (nak); term always dead-letters.
    # The only drops without a reply are tasks nobody waits for: their gateway is gone, or it said its
    # client is (a cancelled generation).
    nobody_waits = {Situation.ORPHANED, Situation.OWNER_AWAY, Situation.CANCELLED}
    for (situation, last), action in ACK_TABLE.items():
        if action.settle is Settle.TERM:
            assert action.dead_letter and action.reply is not None, situation
        if action.settle is Settle.ACK and situation not in nobody_waits:
            assert action.reply is not None and not action.dead_letter, situation
        if situation in nobody_waits:
            assert action.reply is None and not action.dead_letter, situation
            assert action.settle is (Settle.ACK if last or situation is not Situation.OWNER_AWAY else Settle.NAK)


@pytest.mark.parametrize("delivered", [1, 4, 5, 9])
def test_success_and_deadline_ack_on_any_delivery(delivered: int) -> None:
    assert decide(Situation.OK, delivered, 5).reply == REPLY_RESULT
    assert decide(Situation.OK, delivered, 5).settle is Settle.ACK
    act = decide(Situation.DEADLINE, delivered, 5)
    assert (act.reply, act.settle, act.dead_letter) == (ERR_DEADLINE, Settle.ACK, False)


def test_refused_input_is_answered_and_acked_on_any_delivery() -> None:
    for delivered in (1, 5):
        act = decide(Situation.INVALID, delivered, 5)
        assert (act.reply, act.settle, act.dead_letter) == (ERR_INVALID, Settle.ACK, False)


def test_malformed_and_permanent_adapter_failure_term_and_dead_letter_at_once() -> None:
    act = decide(Situation.MALFORMED, 1, 5)
    assert (act.reply, act.settle, act.dead_letter) == (ERR_MALFORMED, Settle.TERM, True)
    act = decide(Situation.ADAPTER_UNAVAILABLE, 1, 5)
    assert (act.reply, act.settle, act.dead_letter) == (ERR_ADAPTER, Settle.TERM, True)


@pytest.mark.parametrize(("situation", "code"), [(Situation.RUNTIME_FAILED, ERR_RUNTIME),
                                                 (Situation.ADAPTER_FAILED, ERR_ADAPTER)])
def test_failures_retry_with_delay_until_the_last_delivery(situation: Situation, code: str) -> None:
    for delivered in (1, 2, 3, 4):
        act = decide(situation, delivered, 5)
        assert (act.reply, act.settle, act.nak_delay, act.dead_letter) == (None, Settle.NAK, True, False)
    act = decide(situation, 5, 5)
    assert (act.reply, act.settle, act.dead_letter) == (code, Settle.TERM, True)


def test_shutdown_gives_task_back_without_delay() -> None:
    act = decide(Situation.SHUTDOWN, 1, 5)
    assert (act.reply, act.settle, act.nak_delay) == (None, Settle.NAK, False)
    assert decide(Situation.SHUTDOWN, 5, 5).settle is Settle.TERM


def test_last_delivery() -> None:
    assert not is_last_delivery(1, 2) and is_last_delivery(2, 2) and is_last_delivery(3, 2)
    assert is_last_delivery(None, 1) and not is_last_delivery(None, 2)


def test_unconfirmed_result_is_retried_then_dead_lettered() -> None:
    from lorafleet.sidecar.acks import Situation, decide

    first = decide(Situation.UNDELIVERED, 1, 5)
    assert first.settle is Settle.NAK and first.nak_delay and first.reply is None
    last = decide(Situation.UNDELIVERED, 5, 5)
    assert last.settle is Settle.TERM and last.dead_letter


def test_an_away_owners_retries_reach_past_the_grace() -> None:
    from lorafleet.sidecar.acks import AWAY_MARGIN_S, away_retry_delay

    # 5 deliveries, 3 s of grace, the inbox vanished at delivery 1: four retries 0.75 s apart end past the grace.
    t, delays = 0.0, []
    for delivered in range(1, 5):
        delays.append(away_retry_delay(t, 3.0, delivered, 5, 0.5))
        t += delays[-1]
    assert t >= 3.0 and delays[0] == pytest.approx(0.75 + AWAY_MARGIN_S)
    assert away_retry_delay(1.0, 3.0, 4, 5, 0.5) == pytest.approx(2.0 + AWAY_MARGIN_S)  # learnt late: the rest at once
    assert away_retry_delay(0.0, 3.0, 1, 5, 2.0) == 2.0  # never below nak_delay_s
    assert away_retry_delay(3.5, 3.0, 2, 5, 0.5) == 0.5  # past the grace: the next delivery finds it gone


def test_a_grace_that_no_redelivery_can_cover_is_refused_at_load() -> None:
    from lorafleet.core.config import ConfigError, FleetConfig, validate_model

    with pytest.raises(ConfigError, match=r"orphan_grace_s \(3s\) needs queue\.max_deliver of at least 2"):
        validate_model(FleetConfig, {"queue": {"max_deliver": 1}})
    assert validate_model(FleetConfig, {"queue": {"max_deliver": 1}, "worker": {"orphan_grace_s": 0}})
    assert validate_model(FleetConfig, {"queue": {"max_deliver": 2}}).worker.orphan_grace_s == 3.0
