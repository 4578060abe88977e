"""deploy/kubernetes/nanoserve.yaml, checked without a cluster: the gateway's discovery finds the
replica pods (selector, port, namespace, RBAC), smg takes every argument it is given, and each
replica is one plain `nanoserve serve` whose GPU limit matches its --tp."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

MANIFEST = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes" / "nanoserve.yaml"


@pytest.fixture(scope="module")
def docs() -> dict[str, dict]:
    out = {}
    for doc in yaml.safe_load_all(MANIFEST.read_text()):
        out[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return out


def _container(workload: dict) -> dict:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _flag(cmd: list[str], name: str, nargs: int = 1) -> list[str]:
    i = cmd.index(name)
    return cmd[i + 1 : i + 1 + nargs]


def test_replicas_are_plain_servers_with_their_gpus(docs):
    replica = docs["StatefulSet/nanoserve-replica"]
    labels = replica["spec"]["template"]["metadata"]["labels"]
    assert replica["spec"]["selector"]["matchLabels"] == labels
    container = _container(replica)
    cmd = container["command"]
    assert cmd[:2] == ["nanoserve", "serve"] and "--dp" not in cmd
    assert _flag(cmd, "--host") == ["0.0.0.0"]
    port = int(_flag(cmd, "--port")[0])
    assert [p["containerPort"] for p in container["ports"]] == [port]
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": port}
    assert container["resources"]["limits"]["nvidia.com/gpu"] == int(_flag(cmd, "--tp")[0])
    # The serve command line parses (the model path only has to exist at run time).
    from nanoserve.cli import build_parser

    args = build_parser().parse_args(cmd[1:])
    assert args.host == "0.0.0.0" and args.port == port and args.dp is None


def test_the_gateway_discovers_the_replica_pods(docs):
    replica = docs["StatefulSet/nanoserve-replica"]
    gateway = docs["Deployment/nanoserve-gateway"]
    cmd = _container(gateway)["command"]
    assert cmd[:4] == ["python", "-m", "smg", "launch"] and "--service-discovery" in cmd
    labels = replica["spec"]["template"]["metadata"]["labels"]
    selector = dict(item.split("=", 1) for item in _flag(cmd, "--selector", len(labels)))
    assert selector == labels
    replica_port = _container(replica)["ports"][0]["containerPort"]
    assert int(_flag(cmd, "--service-discovery-port")[0]) == replica_port
    # Namespace from the downward API ($(VAR) is expanded by Kubernetes in command lines).
    assert _flag(cmd, "--service-discovery-namespace") == ["$(POD_NAMESPACE)"]
    env = {e["name"]: e for e in _container(gateway)["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # RBAC: the gateway's service account may watch pods.
    account = gateway["spec"]["template"]["spec"]["serviceAccountName"]
    binding = docs[f"RoleBinding/{account}"]
    assert {"kind": "ServiceAccount", "name": account} in binding["subjects"]
    (rule,) = docs[f"Role/{binding['roleRef']['name']}"]["rules"]
    assert rule["resources"] == ["pods"] and {"get", "list", "watch"} <= set(rule["verbs"])
    # The Service sends clients to the gateway, never straight to a replica.
    service = docs["Service/nanoserve"]
    assert service["spec"]["selector"] == gateway["spec"]["template"]["metadata"]["labels"]
    gateway_port = int(_flag(cmd, "--port")[0])
    assert service["spec"]["ports"][0]["targetPort"] == gateway_port


def test_smg_accepts_the_gateways_arguments(docs):
    """smg's own parser reads the command line (no cluster needed to catch a misspelt flag)."""
    pytest.importorskip("smg")
    from smg.router_args import RouterArgs

    cmd = _container(docs["Deployment/nanoserve-gateway"])["command"]
    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser)
    args, unknown = parser.parse_known_args(cmd[4:])
    assert unknown == [] and args.service_discovery and args.policy == "cache_aware"
