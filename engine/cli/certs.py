"""``engine certs OUT_DIR --hosts NAME_OR_IP,... [--days N] [--force]``
``engine certs OUT_DIR --hosts NAME_OR_IP,... --renew [--tokens] [--days N]``.

Writes everything a secured cluster needs into OUT_DIR (created with mode 0700): a private CA
(ca.pem, ca.key), a server certificate for the given hosts plus localhost and 127.0.0.1 (server.pem,
server.key), a client certificate (client.pem, client.key) and the worker and admin bearer tokens
(token, admin_token). Private keys and tokens are mode 0600. Prints the files written and the
``security:`` config section that uses them.

--renew re-issues the server and client certificates with the CA already in OUT_DIR (with --tokens,
new tokens too), replacing each file atomically: certificate rotation in a running cluster, whose
servers and clients re-read the files when they change.

Exit codes: 0 success, 2 bad input (a file exists without --force, an invalid host, no CA to renew
with) with one ``engine certs: ...`` line on stderr.
"""
from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("certs", help="write a CA, server/client certificates and tokens for a secured cluster",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", metavar="OUT_DIR", help="output directory (created, mode 0700, if missing)")
    p.add_argument("--hosts", required=True, metavar="NAME_OR_IP,...",
                   help="comma-separated host names and IP addresses the servers are reached by "
                        "(localhost and 127.0.0.1 are always added)")
    p.add_argument("--days", type=int, default=365, metavar="N",
                   help="certificate validity in days (default 365), from one hour ago")
    p.add_argument("--force", action="store_true", help="overwrite existing files (a new CA and tokens)")
    p.add_argument("--renew", action="store_true",
                   help="re-issue the server and client certificates with the existing CA in OUT_DIR")
    p.add_argument("--tokens", action="store_true", help="with --renew: also write new token files")


def run(args) -> int:
    from ..errors import ConfigError
    from ..security import certs

    if not args.out_dir.strip():        # Path("") is the current directory: the CA key and tokens landed there
        print("engine certs: OUT_DIR is empty; name the directory to write the credentials into", file=sys.stderr)
        return 2
    if args.tokens and not args.renew:
        print("engine certs: --tokens only applies with --renew (new credentials always get new tokens)",
              file=sys.stderr)
        return 2
    if args.force and args.renew:
        print("engine certs: --force does not apply with --renew (renewing always replaces the "
              "server and client certificates)", file=sys.stderr)
        return 2
    try:
        if args.renew:
            written = certs.renew(args.out_dir, args.hosts, days=args.days, tokens=args.tokens)
        else:
            written = certs.write_cluster_credentials(args.out_dir, args.hosts, days=args.days,
                                                        force=args.force)
    except ConfigError as e:
        print(f"engine certs: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"engine certs: cannot write {args.out_dir}: {e}", file=sys.stderr)
        return 2
    out = Path(args.out_dir).absolute()
    print("renewed:" if args.renew else "wrote:")
    for path in written.values():
        print(f"  {path}")
    print("\nconfig:\n" + security_yaml(out))
    if args.renew:
        print("servers and clients that re-read these files pick up the new certificates; "
              "update the Kubernetes secret to roll them out there.")
    # the CA key stays out of the cluster: whoever holds it can issue certificates the cluster trusts
    shipped = [n for n in certs.FILES if n != certs.CA_KEY]
    files = " ".join(f"--from-file={shlex.quote(str(out / n))}" for n in shipped)
    print(f"kubernetes: kubectl create secret generic engine-security {files}")
    return 0


def security_yaml(out_dir) -> str:
    """The ``security:`` config section that uses the files of ``out_dir`` (absolute paths)."""
    from ..security import certs as c
    out = Path(out_dir).absolute()
    p = {name: _yaml_scalar(str(out / name)) for name in c.FILES}
    return ("security:\n"
            f"  tls: {{cert: {p[c.SERVER_CERT]}, key: {p[c.SERVER_KEY]}, ca: {p[c.CA_CERT]}, "
            f"client_cert: {p[c.CLIENT_CERT]}, client_key: {p[c.CLIENT_KEY]}}}\n"
            f"  token_file: {p[c.TOKEN]}\n"
            f"  admin_token_file: {p[c.ADMIN_TOKEN]}\n")


def _yaml_scalar(s: str) -> str:
    """Plain when safe inside a YAML flow mapping, else double-quoted (JSON-compatible)."""
    if re.fullmatch(r"[A-Za-z0-9_./+@-]+", s):
        return s
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
