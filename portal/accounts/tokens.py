"""Token format and hashing, one place.

`gpp_` + 36 random base62 characters (214 bits) + 6 base62 characters of a
CRC32, so a secret scanner can recognise a real token offline. Only
sha256(token) is stored: a high-entropy secret needs no slow hash (ASVS 6.5.2).
"""
import hashlib
import secrets
import string
import zlib

ALPHABET = string.ascii_letters + string.digits
PREFIX_LEN = 12  # what is shown in lists and audit records: "gpp_" + 8 characters


def _base62(number: int, width: int) -> str:
    out = []
    for _ in range(width):
        number, rem = divmod(number, 62)
        out.append(ALPHABET[rem])
    return "".join(reversed(out))


def generate(kind: str = "gpp") -> str:
    body = "".join(secrets.choice(ALPHABET) for _ in range(36))
    return f"{kind}_{body}{_base62(zlib.crc32(body.encode()), 6)}"


def looks_valid(token: str, kind: str = "gpp") -> bool:
    """Cheap offline check (prefix, length, checksum) before touching the database."""
    head = f"{kind}_"
    if not token.startswith(head) or len(token) != len(head) + 42:
        return False
    body, check = token[len(head):-6], token[-6:]
    return _base62(zlib.crc32(body.encode()), 6) == check


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
