"""How long the ranks of a job wait for each other and for the job's store: every waiting bound in one place.

Read as ``timing.NAME`` at each use, so a test (or a caller with a slow network) can change one."""

from __future__ import annotations

import datetime

#: How long a rank waits for the others at a collective (a rank may finish its share long before the slowest).
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=24)


#: Every rank bumps its counter in the job's store this often, from a thread, while it takes part in a scan.
HEARTBEAT_SECONDS = 2.0
#: A rank whose counter has not moved for this long while others wait for it is taken as dead or stopped.
SILENCE_LIMIT_SECONDS = 30.0
#: A rank still waiting for the others to join the process group after this long says so on stderr (and again).
JOIN_NOTE_SECONDS = 60.0
#: How long a rank still waiting to join tries to reach MASTER_ADDR:MASTER_PORT, to say when it cannot (its note).
REACH_SECONDS = 5.0
#: How often a waiting rank looks at the store (arrivals, failures, heartbeats).
POLL_SECONDS = 0.25


#: Every call to the job's store returns within this many seconds, or the store's host is taken as gone. TCPStore's
#: own timeout does not bound a call whose server stopped answering (a powered-off or unreachable host: the socket
#: stays open, the client waits for a reply forever), so each call runs on a thread of its own that is waited for.
STORE_TIMEOUT_SECONDS = 30.0
#: At most this long a rank other than 0 waits for rank 0's error line, to stay quiet when it is the same
#: (:func:`say_once`); it stops waiting as soon as rank 0 has got past the point where this rank failed.
SAID_WAIT_SECONDS = 10.0
#: How long a rank that stays quiet lets rank 0 exit first.
QUIET_EXIT_SECONDS = 1.0
#: Least time between two posts of a rank's finished modules to the job's store, and between two reads of them on
#: rank 0 (:class:`JobProgress`): a bar needs no more.
PROGRESS_SECONDS = 0.5
#: How long an interrupted rank 0 waits for the other ranks of its node to post their exit marks, to name one that
#: died without a word (killed) in its interrupted line; a rank found gone ends the wait at once.
EXIT_MARK_WAIT_SECONDS = 1.0
