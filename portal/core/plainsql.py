"""Model instances from plain SQL, for the few hot reads written by hand on PostgreSQL (a token and
its user, the project a submit names): the ORM's compilation of a join cost more CPU than running it.
Each such read is held to its ORM definition by a test."""
from django.db import DEFAULT_DB_ALIAS, connection


def columns(model, alias: str) -> str:
    """The model's concrete columns under `alias`, in the order `instance` takes them."""
    return ", ".join(f'{alias}."{f.column}"' for f in model._meta.concrete_fields)


def instance(model, values):
    """A model instance from its concrete columns, converted as the ORM converts them (JSON decoded)."""
    fields = model._meta.concrete_fields
    converted = []
    for field, value in zip(fields, values):
        col = field.get_col(model._meta.db_table)
        for convert in connection.ops.get_db_converters(col) + field.get_db_converters(connection):
            value = convert(value, col, connection)
        converted.append(value)
    return model.from_db(DEFAULT_DB_ALIAS, [f.attname for f in fields], converted)
