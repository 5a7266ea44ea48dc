"""The Django project.

Its Celery app (portal/celery.py) loads with Django, from portal.core's AppConfig.ready(), not
on `import portal`: gpuctl lives in portal.cli and runs without Django, Celery or the portal's
settings (`pip install .[cli]`). `celery -A portal` finds the app in portal.celery by itself.
"""
