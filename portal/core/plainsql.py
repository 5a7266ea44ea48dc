"""Model instances from plain SQL, for the few hot reads written by hand on PostgreSQL (a token and
its user, the project a submit names): the ORM's compilation of a join cost more CPU than running it.
Each such read is held to its ORM definition by a test. And the submit's INSERTs (``insert``)."""
import functools

from django.db import DEFAULT_DB_ALIAS, connection, connections


@functools.cache
def columns(model, alias: str) -> str:
    """The model's concrete columns under `alias`, in the order `instance` takes them."""
    return ", ".join(f'{alias}."{f.column}"' for f in model._meta.concrete_fields)


_INSERTS: dict = {}


def insert(obj) -> None:
    """Save the new instance ``obj`` as ``Model.objects.create`` would (its fields' pre_save, such as
    auto_now_add, and their conversion for the database), in a plain INSERT ... RETURNING its id: a
    submit writes two rows, and the ORM compiled each INSERT anew, about a third of the submit's CPU.
    Elsewhere than PostgreSQL it is ``obj.save(force_insert=True)``."""
    if connection.vendor != "postgresql":
        obj.save(force_insert=True)
        return
    model = type(obj)
    compiled = _INSERTS.get(model)
    if compiled is None:
        meta = model._meta
        fields = [f for f in meta.local_concrete_fields if f is not meta.auto_field]
        compiled = _INSERTS[model] = (
            f'INSERT INTO "{meta.db_table}" ({", ".join(chr(34) + f.column + chr(34) for f in fields)}) '
            f'VALUES ({", ".join(["%s"] * len(fields))}) RETURNING "{meta.pk.column}"', fields)
    sql, fields = compiled
    values = [f.get_db_prep_save(f.pre_save(obj, True), connection) for f in fields]
    with connection.cursor() as cursor:
        cursor.execute(sql, values)
        obj.pk = cursor.fetchone()[0]
    obj._state.adding, obj._state.db = False, DEFAULT_DB_ALIAS


def instance(model, values):
    """A model instance from its concrete columns, converted as the ORM converts them (JSON decoded)."""
    names, converters = _conversions(model, connection.alias)
    converted = list(values)
    for i, col, convert in converters:
        converted[i] = convert(converted[i], col, connection)
    return model.from_db(DEFAULT_DB_ALIAS, names, converted)


@functools.cache
def _conversions(model, alias: str) -> tuple[list[str], list]:
    """`instance`'s field names and its (index, column, converter) steps, found once per model: looking
    them up for each field of each row cost more than the read."""
    conn = connections[alias]
    fields = model._meta.concrete_fields
    steps = []
    for i, field in enumerate(fields):
        col = field.get_col(model._meta.db_table)
        steps += [(i, col, convert) for convert in conn.ops.get_db_converters(col) + field.get_db_converters(conn)]
    return [f.attname for f in fields], steps
