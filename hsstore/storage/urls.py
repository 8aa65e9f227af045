"""The rules a dataset URL must follow before any request is made (docs/STORAGE.md, "URLs").

Pure functions of the text: a URL that could be misread (credentials that would be echoed in
messages, a control character, a query or fragment the object store would drop, a bucket
name the server would answer with an unrelated error) is refused in one line that never
repeats a secret.
"""

from __future__ import annotations

import re
import urllib.parse

from hsstore.errors import BadInputError

OBJECT_SCHEMES = ("s3", "s3a", "gs", "az", "azure", "abfs", "abfss")
# Schemes whose "container@account" authority is syntax, not credentials.
_ACCOUNT_SCHEMES = ("abfs", "abfss")

# S3: 3-63 characters of lowercase letters, digits, dots (never two in a row) and hyphens,
# starting and ending with a letter or digit. GCS also allows underscores and longer dotted
# names. Azure containers: no dots, no double hyphen.
_BUCKET_RULES = {
    "s3": (
        re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"),
        "3-63 lowercase letters, digits, "
        "dots and hyphens, starting and ending with a letter or digit",
    ),  # fmt: skip
    "gs": (  # dotted names: up to 222 characters, each dot-separated part at most 63
        re.compile(
            r"^(?=.{3,222}$)[a-z0-9](?:[a-z0-9_-]{0,61}[a-z0-9])?"
            r"(?:\.[a-z0-9](?:[a-z0-9_-]{0,61}[a-z0-9])?)*$"
        ),
        "3-63 lowercase letters, digits, hyphens and underscores (up to 222 with dots, 63 "
        "between two), starting and ending with a letter or digit",
    ),  # fmt: skip
    "az": (
        re.compile(r"^[a-z0-9](?!.*--)[a-z0-9-]{1,61}[a-z0-9]$"),
        "3-63 lowercase letters, "
        "digits and single hyphens, starting and ending with a letter or digit",
    ),  # fmt: skip
}
_BUCKET_FAMILY = {"s3": "s3", "s3a": "s3", "gs": "gs", "az": "az", "azure": "az"}


def redacted(text: str) -> str:
    """``text`` with any userinfo (``user:secret@``) replaced, and control characters escaped,
    so it can go into a message."""
    scheme, sep, rest = text.partition("://")
    if sep:
        authority, slash, path = rest.partition("/")
        if "@" in authority and scheme.lower() not in _ACCOUNT_SCHEMES:
            authority = "<credentials>@" + authority.rsplit("@", 1)[1]
        elif scheme.lower() in _ACCOUNT_SCHEMES and ":" in authority.split("@", 1)[0]:
            authority = "<credentials>@" + authority.rsplit("@", 1)[-1]
        text = f"{scheme}{sep}{authority}{slash}{path}"
    return text.encode("unicode_escape").decode("ascii")


def check_url(text: str) -> str:
    """The scheme (lowercase) of a URL hsstore accepts; BadInputError naming the problem."""
    scheme, _, rest = text.partition("://")
    scheme = scheme.lower()
    shown = redacted(text)

    def refuse(why: str) -> BadInputError:
        return BadInputError(why, path=shown)

    authority = rest.split("/", 1)[0]
    userinfo = authority.rsplit("@", 1)[0] if "@" in authority else None
    if userinfo is not None and (scheme not in _ACCOUNT_SCHEMES or ":" in userinfo):
        raise refuse(
            "credentials in a URL are refused (they would be stored and printed); set them "
            "in the environment (AWS_ACCESS_KEY_ID, ...) instead"
        )
    bad = next((c for c in text if ord(c) < 0x20 or ord(c) == 0x7F), None)
    if bad is not None:
        raise refuse(f"URL contains a control character (U+{ord(bad):04X})")
    if "?" in text or "#" in text:
        raise refuse(
            "URL has a query or fragment ('?' or '#'), which is not part of an object key; "
            "percent-encode the character if it belongs to the name"
        )
    family = _BUCKET_FAMILY.get(scheme)
    if family is not None:
        bucket = authority
        if not bucket:
            raise refuse("URL names no bucket")
        rule, words = _BUCKET_RULES[family]
        if not rule.match(bucket) or ".." in bucket:
            raise refuse(f"invalid bucket name {bucket!r}: a bucket name is {words}")
    return scheme


def local_path_of_file_url(text: str) -> str:
    """The path a ``file://`` URL names, percent-decoded (``file:///a%20b`` is ``/a b``);
    ``file://localhost/x`` is ``/x``, and ``file://x/y`` the relative path ``x/y``."""
    rest = text[len("file://") :]
    if rest.startswith("localhost/"):
        rest = rest[len("localhost") :]
    return urllib.parse.unquote(rest)
