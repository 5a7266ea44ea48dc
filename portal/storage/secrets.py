"""Encryption of stored secrets (registry passwords and tokens): Fernet (AES-128-CBC with an
HMAC-SHA256 tag) under a key derived from SECRET_KEY, so a database dump alone does not reveal
them. Rotating SECRET_KEY makes stored secrets unreadable: set them again."""
import base64
import hashlib

from cryptography.fernet import Fernet
from django.conf import settings


def _fernet() -> Fernet:
    digest = hashlib.sha256(b"gpuportal registry credentials\0" + settings.SECRET_KEY.encode()).digest()
    return Fernet(base64.urlsafe_b64encode(digest))


def encrypt(secret: str) -> str:
    return _fernet().encrypt(secret.encode()).decode()


def decrypt(token: str) -> str:
    return _fernet().decrypt(token.encode()).decode()
