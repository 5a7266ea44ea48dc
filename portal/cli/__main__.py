"""`python -m portal.cli ...` is `gpuctl ...`."""
from .app import main

main()
