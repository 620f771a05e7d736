"""``engine k8s CONFIG.yaml --image IMAGE --out DIR [--resume URI [--resume-id ID]] [--set KEY=VALUE ...]``.

Renders the job as plain Kubernetes manifests, one YAML file per object in DIR (``engine.launch.k8s``):
a ConfigMap with the resolved config (no secret in it), a headless Service naming the servers, the
servers as an Indexed Job and the workers as an Indexed Job. Nothing is converted or started: the data
must already be Arrow on storage the pods reach. Prints the files written, any warning, and the commands
that complete the deployment::

    engine certs CREDS --hosts <the servers' DNS names>
    kubectl -n NAMESPACE create secret generic engine-security --from-file=CREDS/ca.pem ...
    kubectl apply -f DIR

Exit codes: 0 written; 2 a config error (an inline storage secret, security missing without
``security.insecure: true``, no image, a bad ``kubernetes`` value, ``mode: hybrid`` with more than one
worker), DIR not writable or holding another render's manifests (another job name: ``kubectl apply -f DIR``
would apply them too), with one ``engine k8s: ...`` line on stderr.
"""
from __future__ import annotations

import argparse
import shlex
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("k8s", help="render Kubernetes manifests (ConfigMap, headless Service, server and worker "
                                   "Indexed Jobs) for a job", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", metavar="CONFIG.yaml", help="YAML config file")
    p.add_argument("--image", default=None, help="container image built from the Dockerfile (default kubernetes.image)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (created; our files replaced)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set cluster.servers=2 --set kubernetes.namespace=ml")
    p.add_argument("--resume", default=None, metavar="URI",
                   help="a checkpoint (or job root) every server starts from: an operator's roll-back or a warm "
                        "start (default: the job's newest complete checkpoint)")
    p.add_argument("--resume-id", default=None, metavar="ID",
                   help="with --resume: the id the servers record (with URI) in every checkpoint, so a replaced "
                        "server restores the newest checkpoint written since instead of URI again (default: "
                        "derived from URI; a new id rolls the job back to the same URI once more)")


def run(args) -> int:
    from ..config import load_config
    from ..errors import ConfigError
    from ..launch import k8s
    from ..security import certs

    if not args.out.strip():            # Path("") is the current directory: the manifests landed there
        print("engine k8s: --out is empty; name the directory to write the manifests into", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, args.overrides)
        manifests = k8s.render(cfg, image=args.image, resume=args.resume, resume_id=args.resume_id)
    except ConfigError as e:
        print(f"engine k8s: {e}", file=sys.stderr)
        return 2
    try:
        paths = k8s.write(manifests, args.out, source=args.config)
    except k8s.ManifestsError as e:
        print(f"engine k8s: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"engine k8s: cannot write {args.out}: {e}", file=sys.stderr)
        return 2
    for w in manifests.warnings:
        print(f"engine k8s: warning: {w}", file=sys.stderr)
    kube = cfg.kubernetes
    print("wrote:")
    for path in paths:
        print(f"  {path}")
    ns = f"-n {shlex.quote(kube.namespace)} "
    print("\nnext:")
    if manifests.config.security.tls.cert:
        shipped = [n for n in certs.FILES if n != certs.CA_KEY]   # the CA key stays out of the cluster
        files = " ".join(f"--from-file=CREDS/{n}" for n in shipped)
        print(f"  engine certs CREDS --hosts {','.join(manifests.cert_hosts or manifests.server_hosts)}")
        print(f"  kubectl {ns}create secret generic {shlex.quote(kube.security_secret)} {files}")
    if kube.storage_secret:
        names = k8s.storage_env_names(cfg) or ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]
        keys = " ".join(f"--from-literal={v}=..." for v in names)
        print(f"  kubectl {ns}create secret generic {shlex.quote(kube.storage_secret)} {keys}")
    print(f"  kubectl apply -f {shlex.quote(str(args.out))}")
    return 0
