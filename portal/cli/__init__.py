"""gpuctl, the portal's command-line client (docs/cli.md).

It talks to the REST API v1 over HTTP and imports nothing of Django: only typer, requests,
PyYAML and the standard library, so it runs on a laptop that has none of the server installed.
"""
from importlib import metadata


def version() -> str:
    try:
        return metadata.version("gpuportal")
    except metadata.PackageNotFoundError:  # run from a checkout without `pip install -e .`
        return "dev"
