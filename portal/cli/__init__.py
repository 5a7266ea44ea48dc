"""gpuctl, the portal's command-line client (docs/cli.md).

It talks to the REST API v1 over HTTP and imports nothing of Django: only typer, requests,
PyYAML and the standard library, so it runs on a laptop that has none of the server installed.
"""
import functools


@functools.cache
def version() -> str:
    # Imported here: importlib.metadata (email, zipfile, csv...) is start-up time a command that
    # neither prints the version nor calls the API need not pay.
    from importlib import metadata

    try:
        return metadata.version("gpuportal")
    except metadata.PackageNotFoundError:  # run from a checkout without `pip install -e .`
        return "dev"
