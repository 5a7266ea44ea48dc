"""Page forms for jobs. They only turn what people type into the dict the API takes
(a command line into argv, NAME=value lines into env); every rule about what is allowed
lives in spec.JobSpecSerializer, and its messages come back here through add_api_errors."""
import shlex

from django import forms

from agents.protocol import DEFAULT_SANDBOX, JOB_SANDBOXES
from portal.core.numbers import parse_int

from .models import JobState, Priority
from .spec import CHECKPOINT_SIGNALS

# The API's field names for the form's resource inputs.
RESOURCE_FIELDS = ("gpus", "nodes", "gpus_per_node", "gpu_type", "gpu_memory_mb", "cpus", "memory_mb")
# Spec fields a template may lock -> the inputs that show them.
INPUTS_FOR_SPEC_FIELD = {"resources": RESOURCE_FIELDS, "checkpoint": ("checkpoint_signal", "checkpoint_grace_s",
                                                                  "checkpoint_interval_s")}


def _number(**attrs):
    return forms.TextInput(attrs={"type": "number", "step": "any", "min": "0", **attrs})


class JobSubmitForm(forms.Form):
    project = forms.ChoiceField(label="Project")
    template = forms.IntegerField(required=False, widget=forms.HiddenInput)
    name = forms.CharField(max_length=200, label="Name", required=False,
                           help_text="Empty: the command's program, e.g. python.")
    image = forms.CharField(max_length=400, label="Image",
                            help_text="One of the project's allowed images, e.g. gpuportal/busybox:latest.")
    command = forms.CharField(max_length=65536, label="Command",
                              help_text="As you would type it in a shell; it is split the way a shell splits it.")
    env = forms.CharField(required=False, label="Environment", widget=forms.Textarea(attrs={"rows": 3}),
                          help_text="One NAME=value per line. CUDA_*, NVIDIA_* and LD_* are set by the portal.")
    gpus = forms.CharField(required=False, label="GPUs", widget=_number(placeholder="0"),
                           help_text="0, a whole number, or 0.125, 0.25 or 0.5 of a shared GPU.")
    nodes = forms.CharField(required=False, label="Nodes", widget=_number(placeholder="1", step="1", min="1"),
                            help_text="All GPUs on one node unless more: then one gang, equal GPUs on each node.")
    gpus_per_node = forms.CharField(required=False, label="GPUs per node", widget=_number(step="1", min="1"),
                                    help_text="With several nodes; GPUs is then nodes × this.")
    gpu_type = forms.CharField(required=False, max_length=64, label="GPU type",
                               help_text="e.g. H100-80GB; empty for any.")
    gpu_memory_mb = forms.CharField(required=False, label="GPU memory (MB)", widget=_number(),
                                    help_text="Fractional GPUs only.")
    cpus = forms.CharField(required=False, label="CPUs", widget=_number(placeholder="1"))
    memory_mb = forms.CharField(required=False, label="Memory (MB)", widget=_number(placeholder="4096"))
    time_limit = forms.CharField(required=False, max_length=32, label="Time limit",
                                 help_text="Seconds, or 90m, 2h, 1d, 1-00:00:00. Empty: the project default.")
    priority = forms.ChoiceField(choices=Priority.choices, initial=Priority.NORMAL, label="Priority")
    preemptible = forms.BooleanField(required=False, label="Preemptible (cheaper; may be stopped and requeued)")
    sandbox = forms.ChoiceField(choices=[(s, s) for s in JOB_SANDBOXES], initial=DEFAULT_SANDBOX, label="Sandbox")
    network = forms.BooleanField(required=False, label="Network access (if the project allows it)")
    checkpoint_signal = forms.ChoiceField(required=False, label="Checkpoints on",
                                          choices=[("", "No checkpoints")] + [(s, s) for s in CHECKPOINT_SIGNALS],
                                          help_text="The signal the job traps to save to GPUPORTAL_CHECKPOINT_DIR: "
                                                    "then a preemption or a move resumes it instead of restarting it.")
    checkpoint_grace_s = forms.CharField(required=False, label="Seconds to save", widget=_number(placeholder="120"),
                                         help_text="How long it may take after the signal.")
    checkpoint_interval_s = forms.CharField(required=False, label="Saves every (seconds)",
                                            widget=_number(placeholder="none"),
                                            help_text="If it also saves on its own this often "
                                                      "(GPUPORTAL_CHECKPOINT_INTERVAL_S).")
    array = forms.CharField(required=False, max_length=64, label="Array",
                            help_text="Run as an array: 0-99, 1,3,5, with an optional %N cap on tasks at once.")
    depends_on = forms.CharField(required=False, max_length=1000, label="Depends on",
                                 help_text="Job ids that must succeed first, separated by commas or spaces.")

    def __init__(self, *args, projects=(), template=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["project"].choices = [(p.slug, f"{p.slug} ({p.organization.slug})") for p in projects]
        self.template = template
        for spec_field in getattr(template, "locked", []):
            for name in INPUTS_FOR_SPEC_FIELD.get(spec_field, (spec_field,)):
                if name in self.fields:
                    self.fields[name].disabled = True
                    self.fields[name].help_text = "Locked by the template."

    @staticmethod
    def initial_from_template(template) -> dict:
        spec = template.spec
        initial = {"project": template.project.slug, "template": template.pk}
        for key, value in spec.items():
            if key == "command" and isinstance(value, list):
                initial[key] = shlex.join(str(v) for v in value)
            elif key == "env" and isinstance(value, dict):
                initial[key] = "\n".join(f"{k}={v}" for k, v in value.items())
            elif key == "resources" and isinstance(value, dict):
                initial.update({k: value[k] for k in RESOURCE_FIELDS if k in value})
            elif key == "depends_on" and isinstance(value, list):
                initial[key] = ", ".join(str(v) for v in value)
            elif key == "checkpoint" and isinstance(value, dict):
                initial.update(checkpoint_signal=value.get("signal", "SIGUSR1"), checkpoint_grace_s=value.get("grace_s"),
                               checkpoint_interval_s=value.get("interval_s"))
            else:
                initial[key] = value
        return initial

    def clean_command(self):
        try:
            argv = shlex.split(self.cleaned_data["command"])
        except ValueError as exc:  # "No closing quotation"
            raise forms.ValidationError(f"Cannot split this command: {exc}.") from None
        if not argv:
            raise forms.ValidationError("This field is required.")
        return argv

    def clean_env(self):
        env = {}
        for number, line in enumerate(self.cleaned_data["env"].splitlines(), start=1):
            if not line.strip():
                continue
            name, sep, value = line.partition("=")
            if not sep:
                raise forms.ValidationError(f"Line {number}: expected NAME=value.")
            env[name.strip()] = value
        return env

    def clean_depends_on(self):
        ids = []
        for part in self.cleaned_data["depends_on"].replace(",", " ").split():
            if parse_int(part) is None:
                raise forms.ValidationError(f"{part!r} is not a job id.")
            ids.append(parse_int(part))
        return ids

    def spec(self) -> dict:
        """The dict POST /api/v1/jobs/ takes. Empty inputs are left out, so the API's defaults apply;
        fields the template locks are left out too, so the template's values are used."""
        # On an invalid form, the inputs that passed: the API then checks them too (spec_errors).
        d = self.cleaned_data
        locked = set(getattr(self.template, "locked", []))
        data = {k: d[k] for k in ("project", "name", "image", "command", "env", "priority", "preemptible",
                                  "sandbox", "network") if k in d and (k != "name" or d[k])}
        resources = {k: d[k].strip() for k in RESOURCE_FIELDS if (d.get(k) or "").strip()}
        if resources:
            data["resources"] = resources
        for key in ("time_limit", "array"):
            if (d.get(key) or "").strip():
                data[key] = d[key].strip()
        if d.get("depends_on"):
            data["depends_on"] = d["depends_on"]
        if d.get("checkpoint_signal"):
            data["checkpoint"] = {"signal": d["checkpoint_signal"]}
            for key in ("grace_s", "interval_s"):
                if (value := (d.get(f"checkpoint_{key}") or "").strip()):
                    data["checkpoint"][key] = value
        if self.template is not None:
            data["template"] = self.template.name
            for key in locked:
                data.pop(key, None)
        return data

    def add_api_errors(self, fields: dict[str, list[str]], message: str = "", *, beside_own: bool = False) -> None:
        """Put the API's field messages ("resources.gpus", "command.0") next to their inputs.
        beside_own: the form had errors of its own; add the API's only to inputs without one
        (an input the form refused was left out of the spec, and the API would call it missing)."""
        placed = False
        for api_name, messages in fields.items():
            name = self.input_for(api_name)
            if beside_own and (name is None or name in self.errors):
                continue
            for text in messages:
                self.add_error(name, text)
            placed = True
        if not placed:
            self.add_error(None, message or "The job was refused.")

    def input_for(self, api_name: str) -> str | None:
        parts = api_name.replace("[", ".").replace("]", "").split(".")
        if parts[0] == "resources":
            return parts[1] if len(parts) > 1 and parts[1] in RESOURCE_FIELDS else "gpus"
        if parts[0] == "template":
            return None
        if parts[0] == "checkpoint":
            return f"checkpoint_{parts[1]}" if parts[1:2] in (["grace_s"], ["interval_s"]) else "checkpoint_signal"
        return parts[0] if parts[0] in self.fields else None


STATE_FILTERS = [("", "Any state"), ("active", "Active (queued to running)"), ("finished", "Finished"),
                 *JobState.choices]


class JobFilterForm(forms.Form):
    """The job list's filters, all GET parameters so a filtered list is a link."""

    # A plain slug, not a checked choice: another tenant's slug simply matches no job of mine.
    project = forms.CharField(required=False, max_length=50, label="Project", widget=forms.Select)
    state = forms.ChoiceField(required=False, choices=STATE_FILTERS, label="State")
    submitted_from = forms.DateField(required=False, label="Submitted from",
                                     widget=forms.DateInput(attrs={"type": "date"}))
    submitted_to = forms.DateField(required=False, label="to", widget=forms.DateInput(attrs={"type": "date"}))
    mine = forms.TypedChoiceField(required=False, label="Whose", coerce=lambda v: v == "1", empty_value=False,
                                  choices=[("", "Everyone in my projects"), ("1", "Mine only")])

    def __init__(self, *args, projects=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["project"].widget.choices = [("", "All projects")] + [(p.slug, p.slug) for p in projects]

    def filters(self) -> dict:
        if not self.is_valid():
            return {}
        return {k: v for k, v in self.cleaned_data.items() if v not in (None, "")}
