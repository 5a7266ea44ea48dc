from datetime import date
from decimal import Decimal

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction

from portal.billing.models import RateCard
from portal.billing.services import ratecard_set
from portal.core.context import Actor
from portal.tenancy.models import Membership, Organization, Project, Role
from portal.tenancy.services import membership_add, membership_change_role, organization_create, project_create

DEMO_IMAGES = ["gpuportal/busybox:latest", "gpuportal/python:3.11"]
# The demo's price list, so the console and invoices show amounts: any GPU model ("*"), in
# BILLING_CURRENCY, preemptible work at half price. Written only where no card exists yet.
DEMO_RATE = {"gpu_model": "*", "price_per_gpu_hour": Decimal("2.50"), "effective_from": date(2020, 1, 1),
             "qos_multipliers": {"preemptible": 0.5, "low": 0.8, "high": 1.5}}

# (organization, project, name, quota, members)
DEMO = [
    ("acme", "vision", "Computer vision", {
        "guaranteed_gpus": Decimal(8), "max_gpus": Decimal(16), "max_running_jobs": 20,
        "gpu_hours_budget": Decimal(5000), "allowed_images": DEMO_IMAGES,
    }, [("alice", Role.OWNER), ("bob", Role.MEMBER), ("dave", Role.VIEWER)]),
    ("globex", "nlp", "Language models", {
        "guaranteed_gpus": Decimal(4), "max_gpus": Decimal(8), "max_running_jobs": 10,
        "gpu_hours_budget": Decimal(2000), "allowed_images": DEMO_IMAGES,
    }, [("charlie", Role.OWNER)]),
]


class Command(BaseCommand):
    help = "Create (or bring back to) the demo tenants and users. Safe to run again."

    def handle(self, *args, **options):
        User = get_user_model()
        password = settings.DEMO_PASSWORD
        with transaction.atomic():
            admin, _ = User.objects.get_or_create(username="admin", defaults={"email": "admin@example.com"})
            admin.is_staff = admin.is_superuser = True
            admin.set_password(password)
            admin.save()
            actor = Actor(user=admin, label="seed_demo")
            for username in ("alice", "bob", "charlie", "dave"):
                user, _ = User.objects.get_or_create(username=username, defaults={"email": f"{username}@example.com"})
                user.set_password(password)
                user.save()
            for org_slug, slug, name, quota, members in DEMO:
                org = Organization.objects.filter(slug=org_slug).first() or organization_create(
                    actor=actor, slug=org_slug, name=org_slug.title(), max_gpus=64)
                project = Project.objects.filter(slug=slug).first() or project_create(
                    actor=actor, organization=org, slug=slug, name=name, quota=quota)
                for username, role in members:
                    membership = Membership.objects.filter(project=project, user__username=username).first()
                    if membership is None:
                        membership_add(actor=actor, project=project, username=username, role=role)
                    elif membership.role != role:
                        membership_change_role(actor=actor, membership=membership, role=role)
            if not RateCard.objects.exists():
                ratecard_set(actor=actor, **DEMO_RATE)
        self.stdout.write(self.style.SUCCESS(
            "Demo ready: admin (staff), alice/bob/dave in acme/vision (owner/member/viewer), "
            "charlie in globex/nlp (owner); GPUs priced at "
            f"{DEMO_RATE['price_per_gpu_hour']} {settings.BILLING_CURRENCY}/GPU-hour unless a rate card existed."))
