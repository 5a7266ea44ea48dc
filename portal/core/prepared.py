"""Reads a scheduling pass makes every time, compiled to SQL once and afterwards only executed.

Under a stream of submits a pass runs every SCHEDULER_PASS_INTERVAL_S, and most of its reads are
the same statement each time: building and compiling the Django query cost several times what
running it did (the larger part of the worker's CPU in bench/vs_portal.py). The pass's own reads
(scheduler/adapter.py) and those of the apps it calls (its usage figures, the launch specs it
publishes) use it, so it lives at the bottom layer. A `Prepared` read
compiles its queryset on first use and keeps the SQL, its parameters and the compiler, whose
converters turn the rows into what the ORM returns (JSON decoded, decimals, aware datetimes).

A read that depends on a value (the pass's `now`) names it as a placeholder: the query is
compiled with that placeholder, and its place among the parameters takes the value of each call.
Where the backend turns the value into another (SQLite stores datetimes as text) the placeholder
is not found, and that read is built and run through the ORM each time, as before. A compiler
holds its thread's connection, so each thread compiles its own (the race tests run passes in
threads).

A list of values is one placeholder through `AnyOf` (`= ANY(%s)`, one array parameter), where
`__in` writes a parameter per item and so a statement per length; the array is read through a
sub-SELECT, so PostgreSQL keeps one generic plan for the statement whatever the list.
"""
import threading
from collections.abc import Callable

from django.db import connections
from django.db.models import Lookup
from django.db.models.query import FlatValuesListIterable, ValuesIterable


def any_array(db_type: str) -> str:
    """``ANY(...)`` of one array parameter, read through a sub-SELECT: PostgreSQL plans without looking
    into it, so a prepared statement gets the same plan for any list (it keeps a generic plan) instead
    of one made for each list's length on every call, which cost more than running the hot reads.
    Index scans still use it."""
    return f"ANY((SELECT %s)::{db_type}[])"


class AnyOf(Lookup):
    """`AnyOf(F("field"), values)` in a filter: the field is one of `values` (a list), sent as one
    array parameter, `field = ANY(%s)`, so the list may be a Prepared placeholder. SQLite has no
    arrays: there it is `field IN (...)`, a parameter per item, and a Prepared read using it is
    built and run through the ORM each time (its placeholder is not among the parameters)."""

    lookup_name = "any_of"
    prepare_rhs = False  # the list goes to the driver as it is, the same object (Prepared finds it)

    def as_sql(self, compiler, connection):
        lhs, params = self.process_lhs(compiler, connection)
        return f"{lhs} = {any_array(self.lhs.output_field.db_type(connection))}", [*params, self.rhs]

    def as_sqlite(self, compiler, connection, **extra):
        lhs, params = self.process_lhs(compiler, connection)
        return f"{lhs} IN ({', '.join(['%s'] * len(self.rhs))})", [*params, *self.rhs]


class Prepared:
    """A values() or values_list() queryset made by `build(**placeholders)`, or (sql, params)
    that build returns, run by `rows(**values)` with each placeholder's value in its place."""

    def __init__(self, build: Callable, **placeholders):
        self.build = build
        self.placeholders = placeholders
        self._local = threading.local()

    def _compile(self):
        made = self.build(**self.placeholders)
        if isinstance(made, tuple):
            sql, params = made
            compiler, alias, shape, names, converters, composite = None, "default", None, (), {}, False
        else:
            compiler = made.query.get_compiler(using=made.db)
            sql, params = compiler.as_sql()
            alias, shape = made.db, made._iterable_class
            query = made.query
            names = list(query.selected) if query.selected else [
                *query.extra_select, *query.values_select, *query.annotation_select]
            # What results_iter would look up on every call (a tenth of a pass's reading).
            fields = [s[0] for s in compiler.select[:compiler.col_count]]
            converters, composite = compiler.get_converters(fields), compiler.has_composite_fields(fields)
        slots = [(i, name) for i, p in enumerate(params)
                 for name, placeholder in self.placeholders.items() if p is placeholder]
        if {name for _, name in slots} != set(self.placeholders) or composite:
            # The backend converted a placeholder (or a composite key's columns are to be paired): no reuse.
            compiled = self._local.compiled = None
            return compiled
        compiled = self._local.compiled = (sql, tuple(params), slots, compiler, alias, shape, names, converters)
        return compiled

    def rows(self, **values) -> list:
        compiled = self._local.compiled if hasattr(self._local, "compiled") else self._compile()
        if compiled is None:
            return self._uncompiled(values)
        sql, params, slots, compiler, alias, shape, names, converters = compiled
        if slots:
            params = list(params)
            for i, name in slots:
                params[i] = values[name]
        with connections[alias].cursor() as cursor:
            cursor.execute(sql, params)
            fetched = cursor.fetchall()
        if compiler is None:
            return fetched
        if compiler.has_extra_select:  # columns the ordering added
            fetched = [row[:compiler.col_count] for row in fetched]
        # As results_iter(results=[fetched], tuple_expected=True), with the converters found once.
        rows = map(tuple, compiler.apply_converters(fetched, converters)) if converters else fetched
        if shape is ValuesIterable:
            return [dict(zip(names, row)) for row in rows]
        if shape is FlatValuesListIterable:
            return [row[0] for row in rows]
        return list(rows)

    def _uncompiled(self, values: dict) -> list:
        made = self.build(**values)
        if not isinstance(made, tuple):
            return list(made)
        with connections["default"].cursor() as cursor:
            cursor.execute(*made)
            return cursor.fetchall()
