"""`berth operator`: run the LLMDeployment operator (kopf) against the current cluster;
`berth operator crd`: print the LLMDeployment CRD, generated from the operator's models."""

from __future__ import annotations

import argparse
import os
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.add_parser(
        "crd",
        help="print the CustomResourceDefinition (YAML) generated from the operator's models "
        "(berth operator crd > crds/llmdeployment.yaml)",
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace (repeatable; glob patterns allowed); default: all namespaces",
    )
    scope.add_argument(
        "-A", "--all-namespaces", action="store_true", help="watch every namespace (the default)"
    )
    parser.add_argument(
        "--kubeconfig", help="kubeconfig file (default: in-cluster service account, else $KUBECONFIG)"
    )
    parser.add_argument("--metrics-port", type=int, default=8080, help="Prometheus /metrics port (0: off)")
    parser.add_argument(
        "--liveness",
        default="http://0.0.0.0:8081/healthz",
        help="kopf liveness endpoint URL for the Deployment's livenessProbe ('' to disable)",
    )
    parser.add_argument("--verbose", action="store_true", help="debug logging")


def run(args: argparse.Namespace) -> int:
    if args.action == "crd":
        from berth.operator.crd import render_yaml

        sys.stdout.write(render_yaml())
        return 0
    # Heavy imports here: `berth --help` must not pay for kopf and the Kubernetes client.
    import kopf

    from berth.operator import handlers  # noqa: F401  (registers the handlers)
    from berth.operator.metrics import serve

    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig
    if args.metrics_port:
        serve(args.metrics_port)
    kopf.configure(verbose=args.verbose)
    kopf.run(
        standalone=True,  # one replica (strategy: Recreate); no peering objects needed
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness or None,
        memo=kopf.Memo(kubeconfig=args.kubeconfig),
    )
    return 0
