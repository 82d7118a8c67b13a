"""training/alerts.py: the alert command's environment, who sends, and that it never blocks."""

import os

import pytest
from conftest import ALERT_RECORD as RECORD
from conftest import read_alerts

from t5x_like.training import alerts


def test_the_command_gets_the_event_in_its_environment_and_the_log_records_it(tmp_path):
  sender = alerts.Alerts(RECORD, str(tmp_path))
  sender.send('spike', '> spike at iteration 12: lm loss 9.1\nsecond line', 12)
  sender.send('finished', '> done: 20 iterations')
  sender.wait()
  # The commands run concurrently: their lines may land in either order; the log's are in order.
  assert sorted(read_alerts(tmp_path)) == [
    ['finished', '', '0', '> done: 20 iterations'],
    ['spike', '12', '0', '> spike at iteration 12: lm loss 9.1'],
  ]
  with open(tmp_path / 'logs' / 'alerts.log') as f:
    assert f.read().splitlines() == [
      '> alert spike at iteration 12: > spike at iteration 12: lm loss 9.1',
      '> alert finished at iteration -: > done: 20 iterations',
    ]


def test_run_events_come_from_process_0_and_a_replica_mismatch_from_any(tmp_path):
  sender = alerts.Alerts(RECORD, str(tmp_path), process_index=3)
  for event in ('hang', 'finished', 'spike', 'replica_mismatch'):
    sender.send(event, f'{event} seen', 7)
  sender.wait()
  assert read_alerts(tmp_path) == [['replica_mismatch', '7', '3', 'replica_mismatch seen']]
  with pytest.raises(ValueError, match="unknown alert event 'hng'"):
    sender.send('hng', 'typo')


def test_a_slow_alert_command_does_not_hold_up_the_sender(tmp_path):
  # The command waits for a file that only appears after send() has returned.
  go = tmp_path / 'go'
  command = f'while [ ! -e "{go}" ]; do sleep 0.05; done; {RECORD}'
  sender = alerts.Alerts(command, str(tmp_path))
  sender.send('slowdown', 'slower', 30)
  assert read_alerts(tmp_path) == []
  go.touch()
  sender.wait(timeout_s=60)
  assert read_alerts(tmp_path) == [['slowdown', '30', '0', 'slower']]


def test_no_command_sends_nothing_and_a_failing_command_does_not_raise(tmp_path):
  alerts.Alerts('', str(tmp_path)).send('crashed', 'boom')
  assert not os.path.exists(tmp_path / 'logs')
  failing = alerts.Alerts('exit 7', str(tmp_path))
  failing.send('crashed', 'boom')
  failing.wait()
  with open(tmp_path / 'logs' / 'alerts.log') as f:
    assert f.read() == '> alert crashed at iteration -: boom\n'
