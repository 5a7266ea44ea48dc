"""Pages: a project's volumes (create, delete), and one volume's folders with upload and download."""
import io

from django import forms
from django.conf import settings
from django.contrib import messages
from django.db.models import Prefetch
from django.http import Http404
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.http import urlencode
from django.views import View

from portal.core.errors import ServiceError
from portal.core.numbers import parse_int
from portal.core.pages import PageMixin, refused, scoped_or_404
from portal.tenancy.access import user_can
from portal.tenancy.models import Project, slug_validator

from .files import download_response
from .models import Dataset, DatasetVersion, Volume
from .selectors import volume_file_open, volume_list_dir
from .services import TooLarge, volume_create, volume_delete, volume_file_put


class VolumeForm(forms.Form):
    name = forms.CharField(max_length=50, validators=[slug_validator], label="Name")
    quota_mb = forms.IntegerField(min_value=1, max_value=2**31 - 1, initial=10240, label="Quota (MB)")


def _project(request, slug):
    return scoped_or_404(Project.objects.select_related("organization"), request, slug=slug)


def _volume(request, slug, pk):
    return scoped_or_404(Volume.objects.select_related("project__organization"), request, pk=pk, project__slug=slug)


def volumes_url(project) -> str:
    return reverse("volumes:list", args=[project.slug])


def volume_url(volume, path: str = "") -> str:
    url = reverse("volumes:browse", args=[volume.project.slug, volume.pk])
    return f"{url}?{urlencode({'path': path})}" if path else url


def _list_page(request, project, form=None, status=200):
    return render(request, "storage/volumes.html", {
        "project": project,
        "volumes": Volume.objects.for_user(request.user, "view").filter(project=project).select_related("created_by"),
        "can_manage": user_can(request.user, "manage", project),
        "form": form or VolumeForm(),
    }, status=status)


class VolumeListView(PageMixin, View):
    def get(self, request, slug):
        return _list_page(request, _project(request, slug))

    def post(self, request, slug):
        project = _project(request, slug)
        form = VolumeForm(request.POST)
        if form.is_valid():
            try:
                volume = volume_create(actor=self.actor, project=project, **form.cleaned_data)
            except ServiceError as exc:
                if exc.status == 403:
                    return refused(request, exc, back=volumes_url(project))
                form.add_error(exc.field if exc.field in form.fields else None, exc.message)
            else:
                messages.success(request, f"Volume {volume.name} created; jobs see it at /data/{volume.name}.")
                return redirect(volumes_url(project))
        return _list_page(request, project, form, status=400)


class VolumeDeleteView(PageMixin, View):
    def post(self, request, slug, pk):
        volume = _volume(request, slug, pk)
        try:
            volume_delete(actor=self.actor, volume=volume)
        except ServiceError as exc:
            return refused(request, exc, back=volumes_url(volume.project))
        messages.success(request, f"Volume {volume.name} and its files deleted.")
        return redirect(volumes_url(volume.project))


class VolumeBrowseView(PageMixin, View):
    def get(self, request, slug, pk):
        volume = _volume(request, slug, pk)
        path = request.GET.get("path", "")
        try:
            listing = volume_list_dir(volume=volume, path=path)
        except ServiceError as exc:
            if exc.status == 404:
                raise Http404(exc.message) from None
            return refused(request, exc, back=volume_url(volume))
        parts = [p for p in listing["path"].split("/") if p]
        crumbs = [("/".join(parts[:i + 1]), name) for i, name in enumerate(parts)]
        for entry in listing["entries"]:
            entry["path"] = "/".join([*parts, entry["name"]])
        return render(request, "storage/browse.html", {
            "volume": volume, "project": volume.project, "listing": listing, "crumbs": crumbs,
            "can_upload": user_can(request.user, "submit", volume.project),
        })


class VolumeUploadView(PageMixin, View):
    def post(self, request, slug, pk):
        volume = _volume(request, slug, pk)
        folder = request.GET.get("path", "")
        back = volume_url(volume, folder)
        # Refused before Django reads the body into its upload handlers.
        limit = settings.VOLUME_UPLOAD_MAX_MB * 1024 * 1024
        if (parse_int(request.META.get("CONTENT_LENGTH")) or 0) > limit + 64 * 1024:
            return refused(request, TooLarge("The file exceeds the upload limit."), back=back)
        upload = request.FILES.get("file")
        # Without a file the service still decides: no right is a 403, a right without a file a message.
        path = "/".join(p for p in (folder.strip("/"), upload.name) if p) if upload else ""
        try:
            done = volume_file_put(actor=self.actor, volume=volume, path=path, stream=upload or io.BytesIO(),
                                   length=upload.size if upload else 0)
        except ServiceError as exc:
            return refused(request, exc, back=back)
        messages.success(request, f"Uploaded {done['path']} ({done['size']} bytes).")
        return redirect(back)


class VolumeDownloadView(PageMixin, View):
    def get(self, request, slug, pk):
        volume = _volume(request, slug, pk)
        try:
            handle, size, name = volume_file_open(volume=volume, path=request.GET.get("path", ""))
        except ServiceError as exc:
            if exc.status == 404:
                raise Http404(exc.message) from None
            return refused(request, exc, back=volume_url(volume))
        return download_response(handle, size, name)


class DatasetListView(PageMixin, View):
    """A project's datasets and their versions (read-only here; gpuctl datasets or the API add them)."""

    def get(self, request, slug):
        project = _project(request, slug)
        datasets = Dataset.objects.for_user(request.user, "view").filter(project=project).prefetch_related(
            Prefetch("versions", queryset=DatasetVersion.objects.order_by("-version")))
        return render(request, "storage/datasets.html", {"project": project, "datasets": datasets})
