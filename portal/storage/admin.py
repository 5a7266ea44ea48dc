from django.contrib import admin

from .models import Volume


@admin.register(Volume)
class VolumeAdmin(admin.ModelAdmin):
    list_display = ("name", "project", "quota_mb", "created_by", "created_at")
    list_filter = ("project",)
    list_select_related = ("project", "created_by")
