"""Django's PostgreSQL backend with a health check that costs no round trip.

With CONN_HEALTH_CHECKS Django asks the server ``SELECT 1`` before a persistent connection's first
use in each request and each worker task: on this control plane, a round trip and a statement
for PostgreSQL for every agent report and every submit. A connection the server has given up on
says so on its socket first: a restart or a terminated backend sends its FATAL message and closes
it, a killed one closes it. So an idle connection with nothing to read is taken as usable, as a
connection pool takes it, and only one with something waiting (that message, an end of file, a
notice) is asked ``SELECT 1``, which the closed ones fail. A server that vanished without a word
(its host lost) is found by the request's own statement, as ``SELECT 1`` would have found it.
"""
import select

from django.db.backends.postgresql import base
from psycopg import pq


class DatabaseWrapper(base.DatabaseWrapper):
    def is_usable(self):
        conn = self.connection
        if conn is None or conn.closed or conn.pgconn.status != pq.ConnStatus.OK:
            return False
        if conn.pgconn.transaction_status != pq.TransactionStatus.IDLE:
            return super().is_usable()  # mid-transaction or mid-statement: the server has the answer
        try:
            waiting, _, _ = select.select([conn.fileno()], [], [], 0)
        except (OSError, ValueError):
            return False
        return not waiting or super().is_usable()
