from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "portal.accounts"
    label = "accounts"
    verbose_name = "Accounts"

    def ready(self):
        from . import schema, signals  # noqa: F401  (OpenAPI auth scheme; audit log of logins)
