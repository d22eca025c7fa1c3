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
    election = parser.add_argument_group(
        "leader election (one replica acts; the others stand by: operator/leadership.py)"
    )
    election.add_argument(
        "--lease-namespace", help="namespace of the replicas' Lease (default: $POD_NAMESPACE, else default)"
    )
    # Defaults: operator/leadership.py (not imported here: `berth --help` stays light).
    election.add_argument("--lease-duration", type=float, help="seconds a Lease lasts unrenewed (default 15)")
    election.add_argument("--lease-renew-interval", type=float, help="seconds between renewals (default 2)")
    election.add_argument(
        "--lease-renew-deadline",
        type=float,
        help="a leader that has not renewed for this many seconds stops acting (default 10)",
    )


def run(args: argparse.Namespace) -> int:
    if args.action == "crd":
        from berth.operator.crd import render_yaml

        sys.stdout.write(render_yaml())
        return 0
    return run_operator(args)


def run_operator(args: argparse.Namespace, memo: dict | None = None) -> int:
    """The operator's process (operator/process.py); `memo`: more for the handlers' memo."""
    # Heavy imports here: `berth --help` must not pay for kopf and the Kubernetes client.
    import asyncio

    import kopf

    from berth.operator import handlers, process  # noqa: F401  (handlers: registers them)
    from berth.operator.metrics import serve

    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig
    if args.metrics_port:
        serve(args.metrics_port)
    kopf.configure(verbose=args.verbose)
    return asyncio.run(process.run(args, memo))
