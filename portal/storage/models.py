from django.conf import settings
from django.core.validators import MinValueValidator
from django.db import models

from portal.core.querysets import TenantQuerySet
from portal.tenancy.models import slug_validator


class Volume(models.Model):
    """A project's persistent folder, ``<VOLUMES_ROOT>/<org>/<project>/<name>`` on the portal and on
    every node, mounted into the project's jobs at ``/data/<name>`` (agents/sandbox/volumes.py)."""

    project = models.ForeignKey("tenancy.Project", on_delete=models.PROTECT, related_name="volumes")
    name = models.SlugField(max_length=50, validators=[slug_validator])
    # Uploads through the portal stop at this size; jobs write to the shared filesystem directly,
    # where the operator's own quota (if any) applies.
    quota_mb = models.PositiveIntegerField(default=10240, validators=[MinValueValidator(1)])
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["project_id", "name"]
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="volume_unique_name_per_project")]

    def __str__(self) -> str:
        return f"{self.project.slug}/{self.name}"
