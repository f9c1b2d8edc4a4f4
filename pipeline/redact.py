"""The one redaction rule: what terascale shows and stores as ``***``.

Everything that renders or stores configuration or paths goes through this module: the
"resolved configuration" log and ``terascale config``, ``metadata.json``, every JSON file a job
writes (``fsutil.write_json_atomic``: dataset and prediction manifests, metrics, progress files,
pointers), the HTML report, terascale's log lines and the CLI's error line. Spark's own UI, event
log and configuration dumps are redacted by Spark with ``spark.redaction.regex``, which
terascale's sessions extend with :data:`SPARK_REDACTION_REGEX`. The real values still reach
Spark: only presentation and storage are redacted.

**Secret keys.** A key is split into lower-case words at ``.``, ``_``, ``-``, ``/``, spaces and
camelCase boundaries (``spark.executorEnv.AWS_SECRET_ACCESS_KEY`` -> spark, executor, env, aws,
secret, access, key). Its value is secret when

1. a word contains ``secret``, ``password``, ``passwd``, ``passphrase``, ``token``, ``credential``,
   ``signature``, or is one of ``pwd``, ``jwt``, ``bearer``, ``cookie``, ``sas`` (Azure shared access signatures, ``fs.azure.sas.*``), ``sig``,
   or a run-together ``apikey`` / ``accesskey`` / ``secretkey`` / ``privatekey`` /
   ``accountkey`` / ``sharedkey`` / ``encryptionkey``; or its last word is ``auth``
   (``spark.mycompany.auth``); or, in an environment variable (``spark.executorEnv.*``,
   ``spark.yarn.appMasterEnv.*``, ``spark.kubernetes.driverEnv.*``), a word is ``pass`` or
   ``pat`` (``DB_PASS``, ``GITHUB_PAT``); or
2. a word ``key`` (or ``keys``) directly follows an access-key qualifier: access, secret, private,
   account, api, encryption, session, client, signing, storage, shared, master, provided,
   customer (``fs.s3a.access.key``, ``fs.s3a.secret.key``, ``fs.s3a.encryption.key``,
   ``fs.azure.account.key.<account>.dfs.core.windows.net``, ``fs.gs.auth.service.account.private.key``,
   ``x.api_key``); a bare ``key`` (a column or join key) is not secret;

unless its last word says the key names something *about* a secret rather than the secret
itself: provider(s), type, class, path, file, dir, uri, url, enabled, binding, hash,
size, bits, length, algorithm, expiry, timeout, interval, mode, dictionary (``hadoop.security.credential.provider.path``,
``fs.s3a.aws.credentials.provider``, ``spark.authenticate.secret.file``,
``fs.azure.sas.token.provider.type``, ``spark.io.encryption.keySizeBits``: shown). Those name
files, classes or sizes; the secrets they point to are not in the configuration.

In nested mappings a key is judged by its dotted path (``{access: {key: ...}}`` is
``access.key``); the whole value under a secret key becomes ``***``, whatever its type.

**URIs.** In every string (values, paths, log text), a URI's user-info
(``s3a://AKIA..:SECRET@bucket/x``, ``https://user:pass@host/``, ``https://TOKEN@host/``)
becomes ``***`` (``s3a://***@bucket/x``), and so does the value of a query parameter whose name
is secret by the rule above (``?sig=...``, ``&X-Amz-Credential=...``). Hadoop's
credential-provider URIs (``jceks://hdfs@nn/keys.jceks``) keep theirs: that slot names the
filesystem the keystore lives on.
"""

from __future__ import annotations

import logging
import re
from typing import Any

SECRET = "***"

_CONTAINS = ("secret", "password", "passwd", "passphrase", "token", "credential", "signature")
_WORDS = frozenset({"pwd", "jwt", "bearer", "cookie", "sas", "sig", "apikey", "accesskey", "secretkey", "privatekey", "accountkey",
                    "sharedkey", "encryptionkey"})
_LAST_WORDS = frozenset({"auth"})  # spark.mycompany.auth; not fs.gs.auth.service.account.json.keyfile
# words that name a secret in an environment variable (DB_PASS, GITHUB_PAT) but are ordinary words
# in terascale's own keys (train.inject.fail_pass)
_ENV_WORDS = frozenset({"pass", "pat"})
_ENV = re.compile(r"(?i)(^|\.)(executorEnv|appMasterEnv|driverEnv|executorEnvVar)\.")
_KEY_QUALIFIERS = frozenset({"access", "secret", "private", "account", "api", "encryption", "session", "client",
                             "signing", "storage", "shared", "master", "provided", "customer"})
_ABOUT = frozenset({"provider", "providers", "type", "class", "path", "file", "dir", "uri", "url", "enabled",
                    "binding", "hash", "size", "bits", "length", "algorithm", "expiry", "timeout", "interval",
                    "mode", "dictionary"})
_SPLIT = re.compile(r"[._\-/\s]+|(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
_PROVIDER_SCHEMES = frozenset({"jceks", "localjceks", "bcfks", "localbcfks"})
# scheme://[userinfo@]rest; rest stops at whitespace, quotes and brackets (a URI inside text)
_URI = re.compile(r"\b([A-Za-z][A-Za-z0-9+.\-]*)://([^\s'\"<>]*)")
# user:password@ whose password holds a '/' (AWS secret keys do): a ':' before the first '/' that
# does not start a port, and an '@' after it
_SLASHED_USERINFO = re.compile(r"^[^/@?#:]*:(?!\d*(?:[/?#]|$))[^@?#]*@")
_QUERY_PARAM = re.compile(r"([?&;])([^=&;#]+)=([^&;#]*)")

#: Java regex that terascale adds (as an alternative) to Spark's ``spark.redaction.regex``:
#: a superset of the key rule above, for Spark's UI, event logs and configuration dumps
#: (Spark also redacts a value when the regex matches it, so ``://...@`` hides a value holding a
#: URI with user-info, which Spark would otherwise show). Spark 4's default,
#: ``(?i)secret|password|token|access[.]?key|credential``, misses account, private, encryption
#: and api keys and SAS keys.
SPARK_REDACTION_REGEX = (r"(?i)secret|passw(or)?d|passphrase|token|credential|signature|(?<![a-z])(pwd|jwt|bearer|cookie|sig)(?![a-z])|auth$|Env[.].*(?<![a-z])(pass|pat)(?![a-z])|"
                         r"[._-]sas[._-]|(access|secret|private|account|api|encryption|session|client|signing|"
                         r"storage|shared|master|provided|customer)[._-]?keys?(?![a-z])|://[^\s@]+@")
#: Java regex for ``spark.redaction.string.regex``: the user-info of a URI in strings Spark
#: produces (query plans name the paths they read); unset by default in Spark.
SPARK_STRING_REDACTION_REGEX = r"(?<=://)[^\s@]+(?=@)"
#: Spark's own default ``spark.redaction.regex`` (Spark 4)
SPARK_DEFAULT_REDACTION_REGEX = r"(?i)secret|password|token|access[.]?key|credential"


def words(key: str) -> list[str]:
    """The lower-case words of a key (see the module docstring)."""
    return [w.lower() for w in _SPLIT.split(str(key)) if w]


def is_secret_key(key: str) -> bool:
    """True when the value of configuration key ``key`` is a secret (the rule above)."""
    ws = words(key)
    if not ws or ws[-1] in _ABOUT:
        return False
    if ws[-1] in _LAST_WORDS or (_ENV.search(str(key)) and _ENV_WORDS.intersection(ws)):
        return True
    for i, w in enumerate(ws):
        if w in _WORDS or any(s in w for s in _CONTAINS):
            return True
        if w in ("key", "keys") and i > 0 and ws[i - 1] in _KEY_QUALIFIERS:
            return True
    return False


def _uri(m: re.Match) -> str:
    scheme, rest = m.group(1), m.group(2)
    authority, sep, tail = rest.partition("/")
    if scheme.lower() in _PROVIDER_SCHEMES:
        out = rest
    elif "@" in authority:
        out = SECRET + "@" + authority.rsplit("@", 1)[1] + sep + tail
    elif m2 := _SLASHED_USERINFO.match(rest):
        out = SECRET + "@" + rest[m2.end():]
    else:
        out = rest
    if "?" in out or ";" in out:
        out = _QUERY_PARAM.sub(lambda q: q.group(1) + q.group(2) + "=" + (SECRET if is_secret_key(q.group(2))
                                                                          else q.group(3)), out)
    return f"{scheme}://{out}"


def redact_text(text: str) -> str:
    """``text`` with the credentials of every URI in it replaced by ``***`` (user-info and
    secret query parameters); text without URIs is returned unchanged."""
    if "://" not in text:
        return text
    return _URI.sub(_uri, text)


def redact(obj: Any, path: str = "") -> Any:
    """A copy of a JSON-like value (dicts, lists, tuples, strings, numbers) with the value of
    every secret key replaced by ``***`` and the credentials of every URI in a string removed.
    ``path``: the dotted key ``obj`` sits under."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            p = f"{path}.{k}" if path else str(k)
            out[k] = SECRET if is_secret_key(p) else redact(v, p)
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact(x, path) for x in obj)
    if isinstance(obj, str):
        return redact_text(obj)
    return obj


def shown(key: str, value: Any) -> Any:
    """How the value of ``key`` is shown: ``***`` for a secret key, else ``redact(value)``."""
    return SECRET if is_secret_key(key) else redact(value, key)


def _union(current: str | None, ours: str) -> str:
    if not current or current == ours:
        return ours
    return current if f"(?:{ours})" in current else f"(?:{current})|(?:{ours})"


def spark_redaction_regex(current: str | None) -> str:
    """``spark.redaction.regex`` for a terascale session: the current value (Spark's default when
    unset) or terascale's rule, so that a setting the user made is kept and extended."""
    return _union(current or SPARK_DEFAULT_REDACTION_REGEX, SPARK_REDACTION_REGEX)


def spark_redaction_settings(get) -> dict[str, str]:
    """The redaction settings of a terascale session, each extending its current value
    (``get(key)``: the value set so far, or None): ``spark.redaction.regex`` (keys and values
    of the configuration) and ``spark.redaction.string.regex`` (:data:`SPARK_STRING_REDACTION_REGEX`,
    parts of strings Spark produces, such as the paths in a query plan)."""
    return {"spark.redaction.regex": spark_redaction_regex(get("spark.redaction.regex")),
            "spark.redaction.string.regex": _union(get("spark.redaction.string.regex"), SPARK_STRING_REDACTION_REGEX)}


class RedactingFormatter(logging.Formatter):
    """A log formatter whose every line (message, arguments, traceback) has its URI
    credentials redacted (:func:`redact_text`)."""

    def format(self, record: logging.LogRecord) -> str:
        return redact_text(super().format(record))
