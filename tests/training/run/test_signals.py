import os
import signal

import pytest

from training.run.signals import Interrupted, StopRequest, stop_status


@pytest.mark.parametrize("signum, name, status", [(signal.SIGINT, "Ctrl-C", 130), (signal.SIGTERM, "SIGTERM", 143),
                                                  (signal.SIGUSR1, "SIGUSR1", 138)])
def test_each_stop_signal_requests_a_checkpointed_stop(signum, name, status):
    messages = []
    stop = StopRequest(say=messages.append)
    try:
        assert not stop.requested
        os.kill(os.getpid(), signum)
        assert stop.requested and stop.signum == signum and stop.exit_status == status == stop_status(signum)
        assert messages[0].strip().startswith(f"{name}: saving a checkpoint at the end of this step, then stopping")
    finally:
        stop.restore()


def test_a_second_ctrl_c_stops_at_once_but_a_repeated_sigterm_does_not():
    messages = []
    stop = StopRequest(say=messages.append)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a scheduler sending it twice: the checkpoint goes on
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.signum == signal.SIGTERM and len(messages) == 1
        with pytest.raises(Interrupted):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.restore()


def test_quiet_ranks_and_restored_handlers():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    messages = []
    stop = StopRequest(announce=False, say=messages.append)
    assert all(signal.getsignal(s) != h for s, h in before.items())
    os.kill(os.getpid(), signal.SIGUSR1)
    stop.restore()
    assert stop.requested and messages == []
    assert {s: signal.getsignal(s) for s in before} == before
