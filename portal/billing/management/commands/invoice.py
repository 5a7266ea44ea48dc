from django.core.management.base import BaseCommand, CommandError

from portal.billing.services import invoices_generate, parse_month, usage_meter
from portal.core.context import Actor
from portal.core.errors import ServiceError
from portal.tenancy.models import Organization


class Command(BaseCommand):
    help = "Meter usage, then (re)generate the draft invoices of a month: invoice --month 2026-11 [--org acme]"

    def add_arguments(self, parser):
        parser.add_argument("--month", required=True, help="YYYY-MM (UTC)")
        parser.add_argument("--org", default="", help="one organization's slug (default: every one with usage)")
        parser.add_argument("--no-meter", action="store_true", help="skip metering open allocations first")

    def handle(self, *args, month, org, no_meter, **options):
        try:
            when = parse_month(month)
            organization = None
            if org:
                organization = Organization.objects.filter(slug=org).first()
                if organization is None:
                    raise CommandError(f"No organization named {org!r}.")
            if not no_meter:
                usage_meter()
            invoices = invoices_generate(actor=Actor(user=None, label="manage.py"), month=when,
                                         organization=organization)
        except ServiceError as exc:
            raise CommandError(exc.message) from None
        for inv in invoices:
            self.stdout.write(f"{inv.number} {inv.organization.slug} {inv.month:%Y-%m} {inv.status} "
                              f"{inv.gpu_seconds / 3600:.3f} GPU-h {inv.total:.2f} {inv.currency}")
        self.stdout.write(self.style.SUCCESS(f"{len(invoices)} draft invoice(s) for {when:%Y-%m}."))
