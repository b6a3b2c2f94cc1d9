"""Users of a multi-user server: the `--users` JSON file, password checks and API keys.

The file maps user names to their credentials::

    {"alice": {"password": "pbkdf2_sha256$600000$<salt_b64>$<hash_b64>", "api_key": "sk-alice-..."},
     "bob":   {"password": "plain text also works", "api_key": "sk-bob-..."}}

A user needs a `password` (to sign in to the UI), an `api_key` (for the HTTP API), or both.
``"admin": true`` lets a user see the whole server (the UI's Engine tab: every user's live load on
the KV pool); everyone else sees only their own conversations. Other fields are kept and ignored.

Passwords may be stored in plain text or hashed with `hash_password` (``python -m
chatengine.app.auth hash`` prints a hash for a password typed at a prompt).

Every comparison is constant-time in the secret; an unknown user name costs the same work as a
known one, and an API key lookup compares against every key without stopping at a match.
"""

import base64
import hashlib
import hmac
import json
import os
import secrets
import sys

HASH_SCHEME = "pbkdf2_sha256"
DEFAULT_ITERATIONS = 600_000  # OWASP 2023 recommendation for PBKDF2-HMAC-SHA256
MAX_ITERATIONS = 10_000_000  # refuse absurd work factors (a denial of service at sign-in)
_DUMMY_HASH_SALT = secrets.token_bytes(16)


def _b64decode(text: str) -> bytes:
    """Standard or URL-safe base64, padding optional."""
    text = text.strip()
    padded = text + "=" * (-len(text) % 4)
    alt = b"-_" if ("-" in text or "_" in text) else None
    return base64.b64decode(padded, altchars=alt, validate=True)


def _parse_hash(stored: str) -> tuple[int, bytes, bytes]:
    """(iterations, salt, digest) of a `pbkdf2_sha256$iters$salt$hash` string; ValueError if malformed."""
    parts = stored.split("$")
    if len(parts) != 4 or parts[0] != HASH_SCHEME:
        raise ValueError(f"a hashed password must look like {HASH_SCHEME}$<iterations>$<salt_b64>$<hash_b64>")
    try:
        iterations = int(parts[1])
    except ValueError:
        raise ValueError(f"the iteration count {parts[1]!r} is not an integer") from None
    if not 1 <= iterations <= MAX_ITERATIONS:
        raise ValueError(f"the iteration count must be in [1, {MAX_ITERATIONS}], got {iterations}")
    try:
        salt, digest = _b64decode(parts[2]), _b64decode(parts[3])
    except (ValueError, TypeError):
        raise ValueError("the salt and hash must be base64") from None
    if not salt or len(digest) < 16:
        raise ValueError("the salt is empty or the hash is shorter than 16 bytes")
    return iterations, salt, digest


def is_hashed(password: str) -> bool:
    return isinstance(password, str) and password.startswith(HASH_SCHEME + "$")


def hash_password(password: str, *, iterations: int = DEFAULT_ITERATIONS, salt: bytes | None = None) -> str:
    """`pbkdf2_sha256$<iterations>$<salt_b64>$<hash_b64>` for `password` (a random 16-byte salt)."""
    if not isinstance(password, str) or not password:
        raise ValueError("the password must be a non-empty string")
    if not 1 <= iterations <= MAX_ITERATIONS:
        raise ValueError(f"iterations must be in [1, {MAX_ITERATIONS}]")
    salt = salt if salt is not None else secrets.token_bytes(16)
    digest = hashlib.pbkdf2_hmac("sha256", password.encode("utf-8"), salt, iterations)
    return f"{HASH_SCHEME}${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def _check_string(value, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid Unicode (lone surrogate)") from None
    if value != value.strip() or any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError(f"{what} must not have leading/trailing spaces or control characters")
    return value


def validate_users(data, source: str = "users") -> dict[str, dict]:
    """Check the structure of a users mapping; return a copy. ValueError names the bad entry."""
    if not isinstance(data, dict):
        raise ValueError(
            f"{source}: the top level must be a JSON object mapping user names to "
            f'{{"password": ..., "api_key": ...}}, got {type(data).__name__}'
        )
    users: dict[str, dict] = {}
    key_owner: dict[str, str] = {}
    for name, entry in data.items():
        _check_string(name, f"{source}: user name {name!r}")
        if not isinstance(entry, dict):
            raise ValueError(
                f"{source}: user {name!r} must map to an object with 'password' and/or "
                f"'api_key', got {type(entry).__name__}"
            )
        if "password" not in entry and "api_key" not in entry:
            raise ValueError(f"{source}: user {name!r} has neither 'password' nor 'api_key'")
        if "password" in entry:
            password = entry["password"]
            if not isinstance(password, str) or not password:
                raise ValueError(f"{source}: user {name!r}: 'password' must be a non-empty string")
            if is_hashed(password):
                try:
                    _parse_hash(password)
                except ValueError as e:
                    raise ValueError(f"{source}: user {name!r}: bad hashed password: {e}") from None
        if "api_key" in entry:
            key = _check_string(entry["api_key"], f"{source}: user {name!r}: 'api_key'")
            if key in key_owner:
                raise ValueError(
                    f"{source}: users {key_owner[key]!r} and {name!r} have the same api_key; every key must be unique"
                )
            key_owner[key] = name
        if not isinstance(entry.get("admin", False), bool):
            raise ValueError(f"{source}: user {name!r}: 'admin' must be true or false")
        users[name] = dict(entry)
    return users


def admins(users: dict[str, dict] | None) -> frozenset[str]:
    """The users whose entry says ``"admin": true``."""
    return frozenset(name for name, entry in (users or {}).items() if entry.get("admin") is True)


def load_users(path) -> dict[str, dict]:
    """Read and validate a users file. ValueError (with the path) on anything malformed."""
    source = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ValueError(f"cannot read the users file {source}: {e.strerror or e}") from None

    def no_duplicates(pairs):
        seen = {}
        for k, v in pairs:
            if k in seen:
                raise ValueError(f"{source}: duplicate key {k!r}")
            seen[k] = v
        return seen

    try:
        data = json.loads(raw.decode("utf-8-sig"), object_pairs_hook=no_duplicates)
    except UnicodeDecodeError:
        raise ValueError(f"{source}: the users file is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    return validate_users(data, source)


def _dummy_iterations(users) -> int:
    """The largest PBKDF2 work factor among the users' hashed passwords (0: all plain)."""
    most = 0
    for entry in (users or {}).values():
        stored = entry.get("password") if isinstance(entry, dict) else None
        if isinstance(stored, str) and is_hashed(stored):
            try:
                most = max(most, _parse_hash(stored)[0])
            except ValueError:
                pass
    return most


def verify_password(users: dict[str, dict] | None, username, password) -> bool:
    """True when `username` exists with a password equal to `password` (plain or hashed).

    Costs the same for an unknown user as for a known one with a wrong password."""
    entry = users.get(username) if isinstance(users, dict) and isinstance(username, str) else None
    stored = entry.get("password") if isinstance(entry, dict) else None
    given = password.encode("utf-8", "surrogatepass") if isinstance(password, str) else b""
    if not isinstance(stored, str) or not stored:
        # the same work as a known user's check, so that probing names does not reveal which exist
        iterations = _dummy_iterations(users)
        if iterations:
            hashlib.pbkdf2_hmac("sha256", given, _DUMMY_HASH_SALT, iterations)
        hmac.compare_digest(hashlib.sha256(given).digest(), hashlib.sha256(b"x").digest())
        return False
    if is_hashed(stored):
        try:
            iterations, salt, digest = _parse_hash(stored)
        except ValueError:
            return False
        computed = hashlib.pbkdf2_hmac("sha256", given, salt, iterations, dklen=len(digest))
        return hmac.compare_digest(computed, digest) and isinstance(password, str)
    # plain text: compare digests so the comparison does not depend on the lengths either
    ok = hmac.compare_digest(hashlib.sha256(given).digest(), hashlib.sha256(stored.encode("utf-8")).digest())
    return ok and isinstance(password, str)


def user_for_api_key(users: dict[str, dict] | None, key) -> str | None:
    """The user owning API key `key`, or None. Compares against every key (constant-time each)."""
    if not isinstance(users, dict) or not isinstance(key, str) or not key:
        return None
    given = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
    found = None
    for name, entry in users.items():
        stored = entry.get("api_key") if isinstance(entry, dict) else None
        if not isinstance(stored, str) or not stored:
            continue
        if hmac.compare_digest(given, hashlib.sha256(stored.encode("utf-8")).digest()) and found is None:
            found = name
    return found


def _main(argv=None) -> int:
    import argparse
    import getpass

    parser = argparse.ArgumentParser(
        prog="python -m chatengine.app.auth", description="Helpers for the --users file of `chatengine serve`."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    h = sub.add_parser(
        "hash",
        help="print a pbkdf2_sha256 hash of a password (read from a prompt, "
        "or from stdin when it is not a terminal), to paste as 'password'",
    )
    h.add_argument(
        "--iterations", type=int, default=DEFAULT_ITERATIONS, help=f"PBKDF2 iterations (default {DEFAULT_ITERATIONS})"
    )
    c = sub.add_parser("check", help="validate a users file and list its users")
    c.add_argument("path", help="the users JSON file")
    k = sub.add_parser("key", help="print a new random API key")
    k.add_argument("--prefix", default="sk-", help="text before the random part (default 'sk-')")
    args = parser.parse_args(argv)
    try:
        if args.command == "hash":
            if sys.stdin.isatty():
                password = getpass.getpass("password: ")
                if getpass.getpass("again: ") != password:
                    print("the passwords differ", file=sys.stderr)
                    return 1
            else:
                password = sys.stdin.readline().rstrip("\r\n")
            print(hash_password(password, iterations=args.iterations))
        elif args.command == "check":
            users = load_users(args.path)
            for name, entry in users.items():
                kinds = [k for k in ("password", "api_key") if k in entry] + (["admin"] if entry.get("admin") else [])
                print(f"{name}: {', '.join(kinds)}")
        else:
            print(args.prefix + secrets.token_urlsafe(24))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
