from django.contrib.auth.signals import user_logged_in, user_logged_out
from django.dispatch import receiver

from portal.core.context import Actor, client_ip
from portal.core.services import audit_record


@receiver(user_logged_in)
def _audit_login(sender, request, user, **kwargs):
    audit_record(actor=Actor(user=user, ip=client_ip(request) if request else None), action="user.login", obj=user)


@receiver(user_logged_out)
def _audit_logout(sender, request, user, **kwargs):
    if user is not None:
        audit_record(actor=Actor(user=user, ip=client_ip(request) if request else None), action="user.logout", obj=user)
