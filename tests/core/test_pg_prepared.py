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


@pytest.mark.django_db
def test_the_submits_budget_read_keeps_a_generic_plan(demo):
    """The budget a submit checks: its project list goes through `any_array`, so PostgreSQL keeps one
    generic plan for it after its first runs, instead of planning every call (which `= ANY(array)`,
    a custom plan for each list, made it do)."""
    from portal.jobs.selectors import gpu_hours_used_this_month

    for _ in range(10):
        assert gpu_hours_used_this_month([demo.vision.pk]) == {}
    with connection.cursor() as cur:
        cur.execute("SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement LIKE %s",
                    ["SELECT project_id, sum(s) / 3600 FROM%WHERE project_id = ANY((SELECT $1)::bigint[]) AND month = $2%"])
        ((generic, custom),) = cur.fetchall()
    assert generic >= 2 and custom <= 5


@pytest.mark.django_db
def test_a_read_of_a_list_of_ids_keeps_one_generic_plan_whatever_the_list():
    """AnyOf sends the list through a sub-SELECT: PostgreSQL plans the statement once for every list
    length (`= ANY(array)` made it plan each call for the list it had), and still finds rows by index."""
    from portal.jobs.reports import _READ_MANY

    for n in range(1, 11):
        assert _READ_MANY.rows(ids=list(range(-n, 0))) == []  # no job has a negative id
    with connection.cursor() as cur:
        cur.execute("SELECT generic_plans FROM pg_prepared_statements WHERE statement LIKE %s",
                    ['%"jobs_job"."id" = ANY((SELECT $1)::bigint[])%'])
        ((generic,),) = cur.fetchall()
        cur.execute("SET LOCAL enable_seqscan = off")  # an empty table is read whole otherwise: can it not?
        cur.execute("EXPLAIN SELECT id FROM jobs_job WHERE id = ANY((SELECT '{1,2}'::int[])::bigint[])")
        plan = " ".join(row[0] for row in cur.fetchall())
    assert generic >= 2
    assert "Index" in plan and "Seq Scan" not in plan
