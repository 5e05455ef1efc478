"""deploy/k8s's pods, run for real on hosts made of network namespaces.

Rendered by `kubectl kustomize deploy/k8s/overlays/sqlite`; each pod gets its own network
namespace with its own address (tests/support/netns.py), and runs its container's own command and
environment as LWS and the kubelet would make them (tests/deploy/k8s_support.py: LWS_* first,
downward API, the Secrets' values, `$(VAR)` expanded). Substituted, as in the compose test:
the image's /opt/venv is this checkout's .venv, volumes are the test's directories, Service and
pod DNS names are /etc/hosts lines, and `vllm` is tests/deploy/vllm_standin.py (the workers'
torchrun entrypoints, real NIXL on DRAM, standing in for vLLM). The readiness gate is the
containers' own exec probe, run inside the pod's namespace with the pod's environment.

What it shows: the prefill LWS group (size 2) forms one TP group across two pods, every rank
on one registry engine_id, advertising its pod IP; the leader's probe is not ready before all
ranks registered and ready after; a restarted container of the still-running group gets the
same engine back; a decode pod reads every block and verifies it; recreating the group as LWS
does (every pod deleted, new ones with new UIDs and the same LWS_*) opens generation 2,
whose leader is not ready while the engine is the old launch's, and the decode follows
it to the new engine.
"""

from __future__ import annotations

import json
import secrets
import signal
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.deploy import k8s_support as k8s
from tests.docker.compose_support import image_environment
from tests.docker.test_two_hosts import Deployment, http
from tests.support import netns

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(240)]

VENV = Path(sys.prefix)
NAMESPACE = "engine-registry"


class Cluster:
    """The pods of one rendered overlay as processes in network namespaces."""

    def __init__(self, net: netns.Network, tmp: Path, objects: list[dict[str, Any]]) -> None:
        self.net = net
        self.tmp = tmp
        self.objects = objects
        self.procs: list[netns.Proc] = []
        self.killed: list[netns.Proc] = []  # on purpose: a pod deleted, a container restarted
        self.reports = tmp / "reports"
        self.reports.mkdir()
        self.bin = tmp / "bin"  # `vllm`: the stand-in
        self.bin.mkdir()
        shim = self.bin / "vllm"
        shim.write_text(
            f'#!/bin/sh\nPYTHONPATH="{k8s.ROOT}" exec "{sys.executable}" '
            '-m tests.deploy.vllm_standin "$@"\n'
        )
        shim.chmod(0o755)

    def start_registry(self, host: netns.Host) -> tuple[netns.Proc, k8s.Container]:
        sts = k8s.find(self.objects, "StatefulSet", "engine-registry")
        pod = sts["spec"]["template"]["spec"]
        (spec,) = pod["containers"]
        container = k8s.plain_container(spec)
        mounts: dict[str, Path] = {"/opt/venv": VENV}
        volumes = {v["name"]: v for v in pod["volumes"]}
        for mount in spec["volumeMounts"]:
            if mount["mountPath"] == "/tmp":  # the test's own /tmp serves (paths lie under it)
                continue
            local = self.tmp / "volumes" / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            secret = volumes.get(mount["name"], {}).get("secret")
            if secret:  # the kubelet writes each key of the Secret as a file
                local.chmod(0o700)
                data = k8s.find(self.objects, "Secret", secret["secretName"])["data"]
                for key in data:
                    (local / key).write_text(
                        k8s.secret_value(self.objects, secret["secretName"], key)
                    )
            mounts[mount["mountPath"]] = local
        env = {k: Deployment.substitute(v, mounts) for k, v in image_environment().items()}
        env.update({k: Deployment.substitute(v, mounts) for k, v in container.env.items()})
        env["HOSTNAME"] = host.hostname
        argv = [Deployment.substitute(a, mounts) for a in container.argv]
        proc = host.spawn(
            "registry", argv, env=env, cwd=mounts["/data"], log_path=self.tmp / "registry.log"
        )
        self.procs.append(proc)
        return proc, container

    def pod_env(
        self, pod: k8s.PodIdentity, container: k8s.Container, extra: dict[str, str]
    ) -> dict[str, str]:
        home = self.tmp / "home" / f"{pod.name}-{pod.uid[:8]}"
        home.mkdir(parents=True, exist_ok=True)
        image = {  # the vllm target's ENV, /opt/venv being .venv, `vllm` the stand-in
            "PATH": f"{self.bin}:{VENV}/bin:/usr/local/bin:/usr/bin:/bin",
            "PYTHONUNBUFFERED": "1",
            "HOME": str(home),
        }
        return {**image, **container.env, "HOSTNAME": pod.name, **extra}

    def start_pod(
        self,
        lws_name: str,
        pod: k8s.PodIdentity,
        host: netns.Host,
        extra: dict[str, str] | None = None,
    ) -> tuple[netns.Proc, k8s.Container, dict[str, str]]:
        lws = k8s.find(self.objects, "LeaderWorkerSet", lws_name)
        container = k8s.lws_pod(lws, pod, self.objects)
        env = self.pod_env(
            pod, container, {"STANDIN_REPORT_DIR": str(self.reports), **(extra or {})}
        )
        name = f"{pod.name}-{pod.uid[:8]}"
        proc = host.spawn(
            name, container.argv, env=env, cwd=Path(env["HOME"]), log_path=self.tmp / f"{name}.log"
        )
        self.procs.append(proc)
        return proc, container, env

    def probe(
        self, host: netns.Host, container: k8s.Container, env: dict[str, str]
    ) -> tuple[int, str]:
        """The container's readiness probe, as the kubelet execs it inside the container."""
        run = host.run(container.probe_argv("readinessProbe"), env=env, timeout_s=20)
        return run.returncode, (run.stdout + run.stderr).strip()

    def wait_for(
        self, what: str, condition: Callable[[], bool], timeout_s: float, every_s: float = 0.5
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"waited {timeout_s:.0f}s for {what}\n{self.logs()}")
            dead = [p for p in self.procs if p.poll() not in (None, 0) and p not in self.killed]
            if dead:
                raise AssertionError(f"{dead[0].name} exited\n{self.logs()}")
            time.sleep(every_s)

    def kill(self, *procs: netns.Proc) -> None:
        """SIGKILL the pod's processes (its PID namespace), as a node losing it would."""
        for proc in procs:
            self.killed.append(proc)
            proc.kill()

    def logs(self) -> str:
        return "\n".join(p.tail(40) for p in self.procs)


def test_lws_pods_share_one_engine_gate_readiness_and_follow_a_group_recreation(
    tmp_path: Path,
) -> None:
    reason = netns.unavailable_reason()
    k8s.require_tools(
        [*k8s.kubectl_missing(), *([f"the topology test {reason}"] if reason else [])]
    )
    started = time.monotonic()
    tokens = {role: secrets.token_urlsafe(24) for role in ("reader", "worker", "admin")}
    objects = k8s.render("sqlite", tmp_path, tokens)
    with netns.Network(subnet="10.232.0") as net:
        try:
            hosts = {
                "registry": net.add_host("registry", "engine-registry-0"),
                "leader": net.add_host("prefill-0", "prefill-0"),
                "worker": net.add_host("prefill-0-1", "prefill-0-1"),
                "decode": net.add_host("decode-0", "decode-0"),
                "client": net.add_host("client"),
            }
            net.write_hosts(
                {  # the Service, and LWS's leader address (headless Service)
                    "engine-registry": hosts["registry"].address,
                    f"prefill-0.prefill.{NAMESPACE}": hosts["leader"].address,
                    f"decode-0.decode.{NAMESPACE}": hosts["decode"].address,
                }
            )
            run_topology(Cluster(net, tmp_path, objects), hosts, tokens)
        finally:
            net.close()
            assert net.leftovers() == []
    print(f"k8s topology verified in {time.monotonic() - started:.1f}s")


def run_topology(cluster: Cluster, hosts: dict[str, netns.Host], tokens: dict[str, str]) -> None:
    client = hosts["client"]
    registry_proc, registry = cluster.start_registry(hosts["registry"])
    url = f"http://engine-registry:{registry.env['REGISTRY_PORT']}"

    def engine(group: str) -> dict[str, Any]:
        answer = http(
            client,
            {"method": "GET", "url": f"{url}/tp-groups/{group}/engine", "token": tokens["reader"]},
        )[0]
        return answer

    # The registry container's own readiness probe (httpGet), from another pod.
    readyz = f"{url}{registry.spec['readinessProbe']['httpGet']['path']}"
    answers = [
        sys.executable,
        "-c",
        f"import urllib.request as u; u.urlopen({readyz!r}, timeout=3)",
    ]
    cluster.wait_for("the registry's readiness", lambda: client.run(answers).returncode == 0, 30)

    def prefill_pods(uids: tuple[str, str]) -> list[k8s.PodIdentity]:
        return [
            k8s.PodIdentity("prefill", 0, i, 2, NAMESPACE, uid, hosts[h].address)
            for i, (uid, h) in enumerate(zip(uids, ("leader", "worker"), strict=True))
        ]

    # -- launch 1: the leader alone is not ready; with its worker, ready on one engine ---------
    gen1 = (str(uuid.uuid4()), str(uuid.uuid4()))
    leader_pod, worker_pod = prefill_pods(gen1)
    leader, leader_c, leader_env = cluster.start_pod("prefill", leader_pod, hosts["leader"])
    assert leader_env["ENGINE_REGISTRY_GROUP"] == "prefill-0"
    assert leader_env["ENGINE_REGISTRY_LAUNCH_ID"] == gen1[0]
    cluster.wait_for("the leader's torchrun", lambda: "vllm stand-in:" in leader.log(), 30)
    code, said = cluster.probe(hosts["leader"], leader_c, leader_env)
    assert code == 1, said  # rank 0 waits in the rendezvous for node 1: nothing opened
    assert "no engine" in said, said
    worker, worker_c, worker_env = cluster.start_pod("prefill", worker_pod, hosts["worker"])
    seen: list[str] = []

    def leader_ready() -> bool:
        code, said = cluster.probe(hosts["leader"], leader_c, leader_env)
        seen.append(said)
        return code == 0

    cluster.wait_for("the prefill leader's readiness probe", leader_ready, 90, every_s=2)
    first = engine("prefill-0")["json"]
    assert first["ready"], first
    assert first["registered_ranks"] == [0, 1], first  # ready only with every rank
    assert all(s.startswith("not ready") for s in seen[:-1]), seen
    assert first["generation"] == 1
    assert first["launch_id"] == gen1[0]  # the leader pod's UID
    hosts_of = {a["rank"]: a["host"] for a in first["agents"]}
    assert hosts_of == {0: hosts["leader"].address, 1: hosts["worker"].address}
    assert cluster.probe(hosts["worker"], worker_c, worker_env)[0] == 0
    reports = {
        r: json.loads((cluster.reports / f"prefill-prefill-0-rank{r}.json").read_text())
        for r in (0, 1)
    }
    assert {r["engine_id"] for r in reports.values()} == {first["engine_id"]}

    # -- the containers crash and restart, the pods (and their UIDs) stay: the same engine ---
    cluster.kill(leader, worker)
    # The killed ranks' agents stay leased (expires_at) until new processes replace them.
    leased = max(a["expires_at"] for a in engine("prefill-0")["json"]["agents"])
    leader, leader_c, leader_env = cluster.start_pod("prefill", leader_pod, hosts["leader"])
    worker, worker_c, worker_env = cluster.start_pod("prefill", worker_pod, hosts["worker"])

    def re_registered() -> bool:
        agents = engine("prefill-0")["json"].get("agents", [])
        return len(agents) == 2 and all(a["expires_at"] > leased for a in agents)

    cluster.wait_for("the restarted ranks to register again", re_registered, 90, every_s=1)
    again = engine("prefill-0")["json"]
    assert (again["engine_id"], again["generation"]) == (first["engine_id"], 1), again
    assert cluster.probe(hosts["leader"], leader_c, leader_env)[0] == 0

    # -- a decode pod reads from it ---------------------------------------------------------
    decode_pod = k8s.PodIdentity(
        "decode", 0, 0, 1, NAMESPACE, str(uuid.uuid4()), hosts["decode"].address
    )
    decode, decode_c, decode_env = cluster.start_pod(
        "decode",
        decode_pod,
        hosts["decode"],
        {"STANDIN_PREFILL_GROUP": "prefill-0", "STANDIN_DECODE_ENGINES": "2"},
    )
    decode_report = cluster.reports / "decode-decode-0-rank0.json"

    def decode_read(engine_id: str) -> bool:
        if not decode_report.exists():
            return False
        rounds = json.loads(decode_report.read_text()).get("rounds", [])
        return any(r["engine_id"] == engine_id for r in rounds)

    cluster.wait_for(
        "the decode to verify a round", lambda: decode_read(first["engine_id"]), 60, every_s=1
    )
    assert cluster.probe(hosts["decode"], decode_c, decode_env)[0] == 0
    assert engine("decode-0")["json"]["launch_id"] == decode_pod.uid

    # -- LWS recreates the group: it deletes every pod (SIGTERM, grace period), then makes new
    # pods (new UIDs) with the same LWS_* ------------------------------------------------------
    for proc in (leader, worker):
        proc.signal(signal.SIGTERM)
    cluster.killed += [leader, worker]
    cluster.wait_for(  # within terminationGracePeriodSeconds (60)
        "the deleted pods to stop", lambda: None not in (leader.poll(), worker.poll()), 40
    )
    gone = engine("prefill-0")["json"]
    assert gone["registered_ranks"] == [], gone  # a deleted pod's ranks deregister
    gen2 = (str(uuid.uuid4()), str(uuid.uuid4()))
    leader_pod, worker_pod = prefill_pods(gen2)
    leader, leader_c, leader_env = cluster.start_pod("prefill", leader_pod, hosts["leader"])
    code, said = cluster.probe(hosts["leader"], leader_c, leader_env)
    assert code == 1, said  # the group's current engine is the old launch's
    assert f"belongs to launch {gen1[0]}" in said, said
    worker, worker_c, worker_env = cluster.start_pod("prefill", worker_pod, hosts["worker"])
    cluster.wait_for("the recreated group's readiness", leader_ready, 90, every_s=2)
    second = engine("prefill-0")["json"]
    assert second["generation"] == 2, second
    assert second["launch_id"] == gen2[0]
    assert second["engine_id"] != first["engine_id"]
    assert second["registered_ranks"] == [0, 1]

    # The decode follows: 410 for the old engine, then every byte of the new one verified.
    assert decode.wait(120) == 0, cluster.logs()
    final = json.loads(decode_report.read_text())
    assert final["engines_seen"] == [first["engine_id"], second["engine_id"]], final
    for figures in final["rounds"]:
        assert figures["verified_bytes"] == figures["bytes"] > 0, figures
    assert registry_proc.poll() is None, registry_proc.tail()
