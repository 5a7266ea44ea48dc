"""Converts gpuctl's plain option values without pydantic, so a command starts in well under 150 ms.

typer 0.29 converts every parameter of the command it runs with a pydantic TypeAdapter, built on
first use: importing pydantic and building about 25 adapters is most of `gpuctl submit`'s start-up
CPU. gpuctl's parameters are str, int, float, bool, list[str] and Enum choices; a value of those
that is plainly valid (a string for a str, digits for a number within its bounds, a listed choice)
is converted here to exactly what the adapter returns. Anything else, and every invalid value,
goes to typer's own adapter, so errors and their messages are typer's, word for word.
"""
import importlib
import re
import sys
import types
from dataclasses import dataclass
from enum import Enum
from typing import Any, get_args, get_origin

_INT = re.compile(r"-?[0-9]{1,18}")
_FLOAT = re.compile(r"-?[0-9]{1,15}(\.[0-9]{1,15})?")
_SLOW = object()  # "not plainly valid: ask typer's adapter"


def _number(annotation, info, value):
    if annotation is int:
        if type(value) is int:
            number = value
        elif type(value) is str and _INT.fullmatch(value):
            number = int(value)
        else:
            return _SLOW
    elif type(value) is float:
        number = value
    elif type(value) is int:
        number = float(value)
    elif type(value) is str and _FLOAT.fullmatch(value):
        number = float(value)
    else:
        return _SLOW
    if (info.min is not None and number < info.min) or (info.max is not None and number > info.max):
        return _SLOW  # typer's message, or its clamp
    return number


def _convert(annotation, info, value, ctx):
    if info.parser is not None:
        return _SLOW
    if annotation is str or annotation is bool:
        return value if type(value) is annotation else _SLOW
    if annotation is int or annotation is float:
        return _number(annotation, info, value)
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        # typer's private module: reached only once install() has found this typer's internals.
        from typer._param_types import coerce_cli_choice
        try:
            return coerce_cli_choice(value, choices=tuple(annotation), case_sensitive=info.case_sensitive, ctx=ctx)
        except ValueError:
            return _SLOW
    if get_origin(annotation) is list and get_args(annotation) == (str,):
        if isinstance(value, (list, tuple)) and all(type(item) is str for item in value):
            return list(value)
        return _SLOW
    return _SLOW


def _plain(annotation) -> bool:
    if annotation in (str, bool, int, float) or get_origin(annotation) is list and get_args(annotation) == (str,):
        return True
    return isinstance(annotation, type) and issubclass(annotation, Enum)


def install() -> None:
    """Route typer's conversion of plain parameters through `_convert` (idempotent)."""
    try:
        from typer import core
        from typer._coercion import RuntimeParam
    except ImportError:  # another typer: it converts everything itself, only slower
        return
    original = getattr(core, "build_runtime_param", None)
    if original is None or getattr(original, "gpuctl_fast", False):
        return

    @dataclass(frozen=True)
    class FastRuntimeParam(RuntimeParam):
        descriptor: Any

        def _coerce_value(self, value, param, ctx):
            converted = _convert(self.annotation, self.parameter_info, value, ctx)
            if converted is not _SLOW:
                return converted
            return original(self.descriptor)._coerce_value(value, param=param, ctx=ctx)

    def build_runtime_param(descriptor):
        if descriptor.file_annotation is None and _plain(descriptor.annotation):
            return FastRuntimeParam(annotation=descriptor.annotation, parameter_info=descriptor.parameter_info,
                                    descriptor=descriptor)
        return original(descriptor)

    build_runtime_param.gpuctl_fast = True
    core.build_runtime_param = build_runtime_param


def _load(name: str):
    """The real module `name`, in place of its stand-in."""
    if getattr(sys.modules.get(name), "_gpuctl_deferred", False):
        del sys.modules[name]
    return importlib.import_module(name)


class _Deferred(type):
    """A stand-in class for one name of a module not loaded yet: calling it, or reading any of its
    attributes, loads the module and uses the real one."""

    def _real(cls):
        return getattr(_load(cls._module), cls.__name__)

    def __call__(cls, *args, **kwargs):
        return cls._real()(*args, **kwargs)

    def __getattr__(cls, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(cls._real(), attr)


def defer_help_only_modules() -> None:
    """typer's help renderer imports rich.markdown (with markdown-it) and rich.traceback whatever
    its markup mode, about 120 ms; gpuctl's help is in rich mode, so neither is used unless a bug's
    traceback is printed. Only for a gpuctl process (`main`), never in a process that may use rich
    otherwise: the modules load, for real, on first use of one of their names."""
    for name, attrs in (("rich.markdown", ("Markdown",)), ("rich.traceback", ("Traceback",))):
        if name in sys.modules:
            continue
        stub = types.ModuleType(name)
        stub._gpuctl_deferred = True
        for attr in attrs:
            setattr(stub, attr, _Deferred(attr, (), {"_module": name}))

        def forward(attr, _name=name):
            if attr.startswith("__"):  # the import system's questions (__path__...), not a use
                raise AttributeError(attr)
            return getattr(_load(_name), attr)

        stub.__getattr__ = forward
        sys.modules[name] = stub
