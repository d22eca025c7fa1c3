"""What a dead MPI world's error says: hydra's verdict, found in mpiexec's last lines."""

from __future__ import annotations

import io

from berth.engine.executor.world import OutputTail

FRAME = "=" * 83


def last_words(text: str) -> str:
    tail = OutputTail(io.BytesIO(text.encode()))
    tail.copy()
    return tail.last_words()


def test_a_rank_on_this_machine_is_named_by_its_exit_string():
    text = f"""{FRAME}
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   PID 4242 RUNNING AT vm
=   EXIT CODE: 9
=   CLEANING UP REMAINING PROCESSES
=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES
{FRAME}
YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)
"""
    assert last_words(text) == "a rank ended: Killed (signal 9)"


def test_a_rank_a_remote_proxy_reported_is_named_with_its_host():
    # The block a worker pod's hydra proxy makes mpiexec print, then mpiexec's own complaints.
    text = f"""{FRAME}
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   PID 6111 RUNNING AT tiny-w0-1.tiny-w0.default.svc
=   EXIT CODE: 9
=   CLEANING UP REMAINING PROCESSES
=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES
{FRAME}
[proxy:0@tiny-w0-0] main (pmip.c:123): demux engine error waiting for event
[mpiexec@launcher] main (mpiexec.c:270): process manager error waiting for completion
"""
    assert last_words(text) == "a rank ended with exit code 9 (pid 6111 on tiny-w0-1.tiny-w0.default.svc)"


def test_without_a_verdict_the_last_line_that_says_something():
    assert (
        last_words("starting\n[mpiexec@vm] cannot connect to w0-1\n\n=====\n")
        == "[mpiexec@vm] cannot connect to w0-1"
    )
