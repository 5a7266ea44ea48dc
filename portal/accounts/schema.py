"""Tells drf-spectacular how our Bearer token authentication appears in the OpenAPI schema."""
from drf_spectacular.extensions import OpenApiAuthenticationExtension


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "portal.accounts.auth.BearerTokenAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "bearerFormat": "gpp_ token"}


class NodeTokenScheme(OpenApiAuthenticationExtension):
    target_class = "portal.nodes.auth.NodeTokenAuthentication"
    name = "nodeToken"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "bearerFormat": "gpn_ node token"}
