"""Ledger: run-length compression, JSON round trip, equality, bad input."""

import json

import pytest

from widedp.accounting import Ledger
from widedp.dp.spend import ExponentialSpend, FreeSpend, GaussianSpend, SparseVectorSpend, StepSpend
from widedp.errors import ConfigError

JOINT = StepSpend(1e-4, (GaussianSpend(0.5, 0.75), ExponentialSpend(0.1 + 0.2, 100)))
SVT = StepSpend(1e-4, (GaussianSpend(0.7), SparseVectorSpend(0.3, 5, 0.05)))
FREE = StepSpend(1e-4, (GaussianSpend(0.5), FreeSpend("uniform")))


def test_consecutive_equal_records_merge():
    led = Ledger()
    for _ in range(3):
        led.add(JOINT)
    led.add(SVT, 2)
    led.add(JOINT)
    led.add(JOINT, 0)  # no-op
    assert led.runs == ((JOINT, 3), (SVT, 2), (JOINT, 1))
    assert led.steps == 6
    assert len(led) == 3


def test_200k_steps_cost_a_few_bytes():
    led = Ledger()
    led.add(JOINT, 150_000)
    for _ in range(50_000):
        led.add(JOINT)
    assert led.runs == ((JOINT, 200_000),)
    assert len(json.dumps(led.to_json())) < 400


def test_json_round_trip_is_exact():
    led = Ledger([(JOINT, 7), (SVT, 3), (FREE, 11), (JOINT, 1)])
    d = json.loads(json.dumps(led.to_json()))
    back = Ledger.from_json(d)
    assert back == led
    assert back.runs[0][0].parts[1].epsilon == 0.1 + 0.2  # floats survive bit-exactly
    assert back.to_json() == led.to_json()


def test_equality():
    a, b = Ledger(), Ledger()
    a.add(JOINT, 3)
    for _ in range(3):
        b.add(JOINT)
    assert a == b
    b.add(SVT)
    assert a != b
    assert a != Ledger([(JOINT, 4)])


@pytest.mark.parametrize(
    "bad",
    [
        {"format": "other", "runs": []},
        {"format": "widedp.ledger/1", "runs": [{"count": 1}]},
        {"format": "widedp.ledger/1", "runs": [{"count": 1, "step": {"sampling_rate": 0.1, "parts": [{"kind": "x"}]}}]},
        {"format": "widedp.ledger/1", "runs": [{"count": -1, "step": {"sampling_rate": 0.1, "parts": []}}]},
        {"format": "widedp.ledger/1",
         "runs": [{"count": 1, "step": {"sampling_rate": 0.1, "parts": [{"kind": "free", "name": "u", "zz": 1}]}}]},
    ],
)
def test_bad_json_raises_config_error(bad):
    with pytest.raises(ConfigError):
        Ledger.from_json(bad)


def test_add_rejects_bad_input():
    with pytest.raises(ConfigError):
        Ledger().add(JOINT, -1)
    with pytest.raises(ConfigError):
        Ledger().add(GaussianSpend(1.0))  # not a StepSpend
