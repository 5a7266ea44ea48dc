"""The nodes page: site staff see every node, GPU and what runs where; drain and undrain.
The cluster page: every signed-in user sees GPUs by pool and type, counts only.

Here, above jobs and nodes, because both show or change jobs beside nodes: what runs on each
GPU, the queue's counts, a drain that moves checkpointing jobs away (jobs/node_effects.py)."""
from django import forms
from django.contrib import messages
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views import View

from portal.core.errors import ServiceError
from portal.core.pages import PageMixin, StaffPageMixin, refused

from portal.jobs.node_effects import node_drain
from portal.nodes.models import Node
from portal.nodes.services import node_undrain

from .selectors import cluster_summary, nodes_overview


class DrainForm(forms.Form):
    reason = forms.CharField(required=False, max_length=200, label="Reason")


class ClusterView(PageMixin, View):
    """The cluster for every signed-in user (like `sinfo`): counts only, no tenant's jobs."""

    def get(self, request):
        return render(request, "nodes/cluster.html", {"summary": cluster_summary()})


class NodeListView(StaffPageMixin, View):
    def get(self, request):
        return render(request, "nodes/list.html", {"nodes": nodes_overview()})


class NodeDrainView(StaffPageMixin, View):
    def post(self, request, name):
        node = get_object_or_404(Node, name=name)
        form = DrainForm(request.POST)
        reason = form.cleaned_data["reason"] if form.is_valid() else ""
        try:
            node = node_drain(actor=self.actor, node=node, reason=reason)
        except ServiceError as exc:
            return refused(request, exc, back=reverse("nodes:list"))
        messages.success(request, f"Node {node.name} is {node.state}.")
        return redirect("nodes:list")


class NodeUndrainView(StaffPageMixin, View):
    def post(self, request, name):
        node = get_object_or_404(Node, name=name)
        try:
            node = node_undrain(actor=self.actor, node=node)
        except ServiceError as exc:
            return refused(request, exc, back=reverse("nodes:list"))
        messages.success(request, f"Node {node.name} is {node.state} again.")
        return redirect("nodes:list")
