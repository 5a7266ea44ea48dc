"""gpuportal node agent: one per GPU node, imports no Django.

Commands come down through Celery (queue ``node.<name>``), facts go up through
the portal's agent REST API (``agents.client``). See docs/design.md section 6.
"""

__version__ = "0.1.0"
