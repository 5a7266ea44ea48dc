"""Statements a connection runs often are prepared on the PostgreSQL server (DB_PREPARE_THRESHOLD,
portal/settings.py): parsed and planned once per connection, not for every call."""
import pytest
from django.conf import settings
from django.db import connection

from portal.jobs.models import Job


@pytest.mark.django_db
def test_a_query_run_again_is_prepared_on_the_server_and_answers_the_same():
    assert connection.vendor == "postgresql", "this test needs PostgreSQL: set DATABASE_URL (make test does)"
    options = settings.DATABASES["default"]["OPTIONS"]
    assert options["server_side_binding"] is True and options["prepare_threshold"] >= 1

    def prepared():
        with connection.cursor() as cur:
            cur.execute("SELECT statement FROM pg_prepared_statements WHERE statement LIKE %s",
                        ['%WHERE ("jobs_job"."name" = $1 AND "jobs_job"."priority" = $2)%'])
            return [row[0] for row in cur.fetchall()]

    assert prepared() == []
    # A query no other test makes, so none has prepared it on this connection before.
    answers = [list(Job.objects.filter(name=f"nothing-{i}", priority=-7).values_list("pk", flat=True))
               for i in range(options["prepare_threshold"] + 2)]
    assert answers == [[]] * len(answers)
    assert len(prepared()) == 1  # one server-side statement, whatever the parameter
