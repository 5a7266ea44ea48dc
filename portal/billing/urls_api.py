from django.urls import path
from rest_framework.routers import SimpleRouter

from .api import BudgetView, InvoiceViewSet, JobUsageView, UsageView

router = SimpleRouter()
router.register("invoices", InvoiceViewSet, basename="invoice")
urlpatterns = [
    path("usage/", UsageView.as_view(), name="usage"),
    path("usage/jobs/", JobUsageView.as_view(), name="usage-jobs"),
    path("budgets/", BudgetView.as_view(), name="budgets"),
    *router.urls,
]
