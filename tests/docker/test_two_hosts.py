"""docker/compose.yaml's deployment, for real, on hosts made of network namespaces.

Each compose service runs in its own network namespace with its own address on a bridge the
test makes (and its own PID, UTS and IPC namespaces, its hostname, an /etc/hosts naming every
service), running the command and environment that compose gives it, read from the compose
file and the Dockerfile. Only what must differ is substituted: the image's /opt/venv is this
checkout's .venv, and each mount target (the registry's volume, the tokens secret) is a
directory of the test's. Workers also get `--report-dir` (observation only).

What it shows: the prefill TP group spans two namespaces (torchrun --nnodes 2, rendezvous on
prefill-node0); two decode replicas (`--scale decode=2`) handshake through the registry, pull
every block from both prefill hosts over NIXL and verify every byte; every rank advertises
its own namespace's address; and the registry refuses, with 422 and a detail that says why,
an agent advertising an unspecified or loopback address from a non-loopback client, also
when the rank is a real worker told to advertise 127.0.0.1.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.docker.compose_support import (
    HA_ENV_FILE,
    Service,
    dockerfile_instructions,
    healthcheck_command,
    image_environment,
    load_services,
    read_env_file,
)
from tests.support import netns

SKIP_REASON = netns.unavailable_reason()
pytestmark = [
    pytest.mark.deploy,
    pytest.mark.skipif(SKIP_REASON is not None, reason=f"two-host test: {SKIP_REASON}"),
    pytest.mark.timeout(300),
]

# The environment running the tests stands for the image's /opt/venv (make test: ROOT/.venv).
VENV = Path(sys.prefix)
PREFILL_NODES = ("prefill-node0", "prefill-node1")
IMAGE_VENV = "/opt/venv"
PYTHON = sys.executable

# One HTTP exchange per line of argv[1] (JSON list), answers printed as a JSON list.
HTTP_SCRIPT = r"""
import json, sys, urllib.request, urllib.error
out = []
for r in json.loads(sys.argv[1]):
    headers = {"Content-Type": "application/json"}
    if r.get("token"):
        headers["Authorization"] = "Bearer " + r["token"]
    body = json.dumps(r["body"]).encode() if "body" in r else None
    req = urllib.request.Request(r["url"], data=body, method=r["method"], headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as a:
            status, text = a.status, a.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    out.append({"status": status, "json": json.loads(text) if text else None})
print(json.dumps(out))
"""

# Records GET /tp-groups every 50 ms until the stop file appears (JSON lines).
POLL_SCRIPT = r"""
import json, os, sys, time, urllib.request
url, token, out, stop = sys.argv[1:5]
req = urllib.request.Request(url + "/tp-groups", headers={"Authorization": "Bearer " + token})
deadline = time.monotonic() + 240
with open(out, "a") as f:
    while not os.path.exists(stop) and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(req, timeout=5) as a:
                f.write(a.read().decode().replace("\n", " ") + "\n")
                f.flush()
        except OSError as e:
            f.write(json.dumps({"error": str(e)}) + "\n")
        time.sleep(0.05)
"""


class Deployment:
    """The compose services as processes in namespaces, with what compose would give them."""

    def __init__(self, net: netns.Network, tmp: Path, services: Mapping[str, Service]) -> None:
        self.net = net
        self.tmp = tmp
        self.services = services
        self.image_env = image_environment()
        self.workdir = next(
            i.args for i in reversed(dockerfile_instructions()) if i.keyword == "WORKDIR"
        )
        self.reports = tmp / "reports"
        self.reports.mkdir()
        self.secrets_dir = tmp / "secrets"
        self.secrets_dir.mkdir(mode=0o700)
        self.procs: list[netns.Proc] = []

    # -- what must differ from a container ------------------------------------------------

    def mounts(self, service: Service, instance: str) -> dict[str, Path]:
        """Container path -> the test's directory standing for it."""
        found: dict[str, Path] = {}
        for mount in service.mounts:
            local = self.tmp / "volumes" / mount.source
            local.mkdir(parents=True, exist_ok=True)
            found[mount.target] = local
        for secret in service.secrets:
            found[f"/run/secrets/{secret}"] = self.secrets_dir / secret
        if self.workdir not in found:  # the image's WORKDIR, not a volume: per container
            local = self.tmp / "containers" / instance
            local.mkdir(parents=True, exist_ok=True)
            found[self.workdir] = local
        found[IMAGE_VENV] = VENV
        return found

    @staticmethod
    def substitute(value: str, mounts: Mapping[str, Path]) -> str:
        for target in sorted(mounts, key=len, reverse=True):
            pattern = rf"(?<![\w.-]){re.escape(target)}(?=/|$|[^\w.-])"
            value = re.sub(pattern, str(mounts[target]).replace("\\", "\\\\"), value)
        return value

    def environment(self, service: Service, host: netns.Host, instance: str) -> dict[str, str]:
        mounts = self.mounts(service, instance)
        if "build" in service.raw:  # our image: its ENV, with /opt/venv being .venv
            env = {k: self.substitute(v, mounts) for k, v in self.image_env.items()}
        else:  # another image (etcd): a plain PATH, where Debian's etcd lies
            env = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
        env.update(HOSTNAME=host.hostname, HOME=str(mounts[self.workdir]))
        env.update({k: self.substitute(v, mounts) for k, v in service.environment.items()})
        return env

    def command(self, service: Service, instance: str, *, report: bool) -> list[str]:
        mounts = self.mounts(service, instance)
        argv = [self.substitute(a, mounts) for a in service.command]
        if report:
            extra = f"--report-dir={self.reports}"
            if argv[:2] in (["sh", "-c"], ["/bin/sh", "-c"]):
                argv[2] += f" {extra}"
            else:
                argv.append(extra)
        return argv

    # -- running --------------------------------------------------------------------------

    def start(
        self,
        service_name: str,
        host: netns.Host,
        *,
        instance: str | None = None,
        extra_env: Mapping[str, str] | None = None,
        report: bool = True,
    ) -> netns.Proc:
        service = self.services[service_name]
        instance = instance or host.name
        env = {**self.environment(service, host, instance), **(extra_env or {})}
        argv = self.command(service, instance, report=report)
        cwd = self.mounts(service, instance)[self.workdir]
        proc = host.spawn(instance, argv, env=env, cwd=cwd, log_path=self.tmp / f"{instance}.log")
        self.procs.append(proc)
        return proc

    def health(self, argv: Sequence[str], service_name: str, host: netns.Host) -> bool:
        """Run a health check as Docker does: inside the container, with its environment."""
        service = self.services[service_name]
        env = self.environment(service, host, host.name)
        mounts = self.mounts(service, host.name)
        run = host.run(
            ["/bin/sh", "-c", 'cd "$0" && exec "$@"', str(mounts[self.workdir]), *argv],
            env=env,
            timeout_s=20,
        )
        return run.returncode == 0

    def wait_healthy(
        self,
        argv: Sequence[str],
        service_name: str,
        host: netns.Host,
        timeout_s: float,
        exits: Sequence[netns.Proc] = (),
    ) -> float:
        """Until the service's health check passes; fails at once when a process other than
        ``exits`` (those meant to stop, checked by the caller) has exited."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.health(argv, service_name, host):
                return time.monotonic() - start
            dead = [p for p in self.procs if p.poll() is not None and p not in exits]
            if dead:
                raise AssertionError(f"{dead[0].name} exited early\n{self.logs()}")
            time.sleep(0.5)
        raise AssertionError(f"{service_name} not healthy in {timeout_s:.0f}s\n{self.logs()}")

    def wait(self, proc: netns.Proc, deadline: float) -> int:
        try:
            return proc.wait(deadline - time.monotonic())
        except subprocess.TimeoutExpired:
            message = f"{proc.name} still running at its deadline\n{self.logs()}"
            raise AssertionError(message) from None

    def wait_for(self, condition: Callable[[], bool], what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"waited {timeout_s:.0f}s for {what}\n{self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        return "\n".join(p.tail() for p in self.procs)


def http(host: netns.Host, *requests: dict[str, Any]) -> list[dict[str, Any]]:
    run = host.run([PYTHON, "-c", HTTP_SCRIPT, json.dumps(list(requests))], timeout_s=60)
    assert run.returncode == 0, run.stderr
    answers: list[dict[str, Any]] = json.loads(run.stdout)
    return answers


@contextmanager
def polling(host: netns.Host, url: str, token: str, tmp: Path) -> Iterator[Path]:
    """Record the registry's groups every 50 ms while the block runs."""
    out, stop = tmp / "groups.jsonl", tmp / "groups.stop"
    proc = host.spawn(
        "poller",
        [PYTHON, "-c", POLL_SCRIPT, url, token, str(out), str(stop)],
        env={"PATH": "/usr/bin:/bin"},
        cwd=tmp,
        log_path=tmp / "poller.log",
    )
    try:
        yield out
    finally:
        stop.touch()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def seen_agents(path: Path) -> dict[tuple[str, int], set[str]]:
    """(group, rank) -> every host the registry listed for it."""
    found: dict[tuple[str, int], set[str]] = {}
    for line in path.read_text().splitlines():
        snapshot = json.loads(line)
        for group in snapshot.get("groups", []):
            for agent in group.get("agents", []):
                found.setdefault((group["group_id"], agent["rank"]), set()).add(agent["host"])
    return found


def assert_read_over_the_network(log: str, tail: str) -> None:
    lines = log.splitlines()
    reads = [i for i, line in enumerate(lines) if "remote memory read" in line]
    assert reads, f"UCX printed no protocol for remote reads\n{tail}"
    for i in reads:
        assert "inter-node" in lines[i - 1], lines[i - 1 : i + 8]
        table = " ".join(lines[i : i + 8])
        assert "tcp/eth0" in table, lines[i : i + 8]


def rounds_per_decode(services: Mapping[str, Service]) -> int:
    found = re.search(r"--rounds=(\d+)", " ".join(services["decode"].command))
    assert found is not None, services["decode"].command
    return int(found[1])


def read_reports(directory: Path, role: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob(f"{role}-*-rank*.json"))]


def test_compose_deployment_runs_across_namespaces_and_every_rank_is_reachable(
    tmp_path: Path,
) -> None:
    started = time.monotonic()
    tokens = {role: secrets.token_urlsafe(24) for role in ("worker", "reader", "admin")}
    # What the README has the operator provide: the tokens secret and WORKER_TOKEN.
    compose_env = {"WORKER_TOKEN": tokens["worker"]}
    services = load_services(compose_env)
    assert set(services) == {"registry", "prefill-node0", "prefill-node1", "decode"}
    registry_svc, node0_svc = services["registry"], services["prefill-node0"]
    assert registry_svc.healthcheck is None  # the image's HEALTHCHECK applies
    prefill_group = next(
        a.split("=", 1)[1] for a in node0_svc.command if a.startswith("--group-id=")
    )
    registry_port = int(registry_svc.environment["REGISTRY_PORT"])

    with netns.Network() as net:
        try:
            hosts = {
                name: net.add_host(name, services[name].hostname)
                for name in ("registry", "prefill-node0", "prefill-node1")
            }
            # `--scale decode=2`: two containers, hostnames like container ids; and a third
            # decode container told to advertise loopback, which the registry must refuse.
            decodes = [net.add_host(f"decode-{i}", secrets.token_hex(6)) for i in (1, 2)]
            loopback = net.add_host("decode-lo", secrets.token_hex(6))
            probe = net.add_host("probe")
            net.write_hosts()
            run_deployment(
                net,
                tmp_path,
                services,
                tokens,
                hosts,
                decodes,
                loopback,
                probe,
                prefill_group=prefill_group,
                port=registry_port,
            )
        finally:
            net.close()
            assert net.leftovers() == []
    print(f"two-host deployment verified in {time.monotonic() - started:.1f}s")


def run_deployment(
    net: netns.Network,
    tmp: Path,
    services: Mapping[str, Service],
    tokens: Mapping[str, str],
    hosts: Mapping[str, netns.Host],
    decodes: Sequence[netns.Host],
    loopback: netns.Host,
    probe: netns.Host,
    *,
    prefill_group: str,
    port: int,
) -> None:
    deploy = Deployment(net, tmp, services)
    token_file = deploy.secrets_dir / "registry_tokens"
    token_file.write_text("".join(f"{role}:{tok}\n" for role, tok in tokens.items()))
    token_file.chmod(0o600)
    url = f"http://registry:{port}"

    # The registry, healthy by the image's own HEALTHCHECK, run inside its namespace.
    deploy.start("registry", hosts["registry"], report=False)
    deploy.wait_healthy(healthcheck_command(), "registry", hosts["registry"], 30)

    check_registry_refuses_unreachable_hosts(probe, hosts["registry"], url, port, tokens)

    with polling(probe, url, tokens["reader"], tmp) as groups_log:
        # The prefill group over two hosts; node1 after node0 (depends_on: service_started).
        node0 = deploy.start("prefill-node0", hosts["prefill-node0"])
        node1 = deploy.start("prefill-node1", hosts["prefill-node1"])
        # A decode container that advertises loopback: refused by the registry (exit 3).
        refused = deploy.start(
            "decode",
            loopback,
            extra_env={"WORKERS_ADVERTISE_HOST": "127.0.0.1"},
            report=False,
        )
        # decode depends_on prefill-node0 healthy: its compose health check, run as Docker does.
        assert node0.name == "prefill-node0"
        ready_s = deploy.wait_healthy(  # the refused decode may exit first (checked below)
            services["prefill-node0"].healthcheck or [],
            "prefill-node0",
            node0.host,
            120,
            exits=[refused],
        )
        engine = http(
            probe,
            {
                "method": "GET",
                "url": f"{url}/tp-groups/{prefill_group}/engine",
                "token": tokens["reader"],
            },
        )[0]
        assert engine["status"] == 200, engine
        assert engine["json"]["ready"], engine
        prefill = engine["json"]
        # UCX_PROTO_INFO (observation only) makes UCX print the transports it picked.
        decoders = [
            deploy.start("decode", host, extra_env={"UCX_PROTO_INFO": "y"}) for host in decodes
        ]
        deadline = time.monotonic() + 150
        codes = [deploy.wait(p, deadline) for p in decoders]
        assert codes == [0, 0], deploy.logs()
        # torchrun exits 1 when a rank fails; the rank itself exits 3 (refused by the registry).
        assert deploy.wait(refused, deadline) != 0, refused.tail()
        # Each decode round notifies both prefill ranks; let the last notifications land.
        expected_notifs = len(decoders) * rounds_per_decode(services)
        deploy.wait_for(
            lambda: all(
                r.get("verified_notifs", 0) >= expected_notifs
                for r in read_reports(deploy.reports, "prefill")
            ),
            "prefill ranks to receive every decode notification",
            20,
        )
        # `docker compose stop`: SIGTERM to each prefill container's PID 1 (torchrun, through
        # workers.torchrun), which stops its ranks (they deregister) and exits 0, saying so.
        for proc in (node0, node1):
            proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + 40
        for proc in (node0, node1):
            assert deploy.wait(proc, deadline) == 0, proc.tail()
            assert "INFO shut down" in proc.log(), proc.tail()
            assert "torchrun stopped by SIGTERM" in proc.log(), proc.tail()
            assert "Traceback" not in proc.log(), proc.tail()
        after = http(
            probe,
            {
                "method": "GET",
                "url": f"{url}/tp-groups/{prefill_group}/engine",
                "token": tokens["reader"],
            },
        )[0]
        assert after["json"]["registered_ranks"] == [], after  # deregistered, not expired
    registry_proc = deploy.procs[0]
    assert registry_proc.poll() is None, registry_proc.tail()

    # -- what happened --------------------------------------------------------------------
    address = {h.name: h.address for h in [*hosts.values(), *decodes, loopback, probe]}
    assert prefill["tp_size"] == 2
    assert prefill["registered_ranks"] == [0, 1]
    prefill_hosts = {a["rank"]: a["host"] for a in prefill["agents"]}
    assert prefill_hosts == {0: address["prefill-node0"], 1: address["prefill-node1"]}

    pre = {r["rank"]: r for r in read_reports(deploy.reports, "prefill")}
    assert sorted(pre) == [0, 1]
    for rank, node in ((0, "prefill-node0"), (1, "prefill-node1")):
        assert pre[rank]["host"] == address[node]
        assert pre[rank]["engine_id"] == prefill["engine_id"]
        assert pre[rank]["status"] == "done"

    rounds = rounds_per_decode(services)
    dec = read_reports(deploy.reports, "decode")
    assert {r["group_id"] for r in dec} == {f"decode-{h.hostname}" for h in decodes}
    total = 0
    for report in dec:
        assert report["status"] == "done", report
        assert len(report["rounds"]) == rounds
        for figures in report["rounds"]:
            assert figures["engine_id"] == prefill["engine_id"]
            assert sorted(figures["targets"]) == [0, 1]  # decode TP 1 reads both prefill hosts
            assert figures["bytes"] > 0
            assert figures["verified_bytes"] == figures["bytes"]
            total += figures["bytes"]
    for rank in (0, 1):  # every round of every decode replica told both prefill ranks
        assert pre[rank]["verified_notifs"] == rounds * len(decodes)

    # Every rank the registry ever listed advertised its own namespace's address.
    seen = seen_agents(groups_log)
    expected = {
        (prefill_group, 0): {address["prefill-node0"]},
        (prefill_group, 1): {address["prefill-node1"]},
        **{(f"decode-{h.hostname}", 0): {h.address} for h in decodes},
    }
    assert seen == expected, seen

    # The blocks crossed the bridge: UCX read them as another node's, over TCP on eth0.
    for proc in decoders:
        assert_read_over_the_network(proc.log(), proc.tail())

    refusal = refused.log()
    assert "REGISTRY REFUSED THE AGENTS" in refusal, refused.tail()
    assert "loopback" in refusal, refused.tail()
    assert f"reached the registry from {loopback.address}" in refusal, refused.tail()
    assert re.search(r"exitcode\s*:\s*3\b", refusal), refused.tail()
    print(
        f"prefill ready in {ready_s:.1f}s; {len(dec)} decode replicas x {rounds} "
        f"rounds verified {total} bytes from ranks at {sorted(prefill_hosts.values())}"
    )


def check_registry_refuses_unreachable_hosts(
    probe: netns.Host, registry: netns.Host, url: str, port: int, tokens: Mapping[str, str]
) -> None:
    """A remote client's agent must name an address its peers can reach."""
    group = "reachability-check"
    opened = http(
        probe,
        {
            "method": "PUT",
            "url": f"{url}/tp-groups/{group}/engine",
            "token": tokens["worker"],
            "body": {"launch_id": "probe", "tp_size": 1, "role": "prefill"},
        },
    )[0]
    assert opened["status"] == 201, opened
    engine_id = opened["json"]["engine_id"]

    def agent(host: str) -> dict[str, Any]:
        return {
            "method": "PUT",
            "url": f"{url}/tp-groups/{group}/engine/agents/0",
            "token": tokens["worker"],
            "body": {
                "engine_id": engine_id,
                "agent_name": "probe",
                "agent_metadata": "aGVsbG8=",
                "host": host,
                "kv": {
                    "mem_type": "DRAM",
                    "device_id": 0,
                    "base_addrs": [4096],
                    "num_blocks": 1,
                    "block_len": 64,
                },
            },
        }

    unspecified, unspecified6, loop, own = http(
        probe, agent("0.0.0.0"), agent("::"), agent("127.0.0.1"), agent(probe.address)
    )
    for answer in (unspecified, unspecified6):
        assert answer["status"] == 422, answer
        assert answer["json"]["code"] == "invalid_request"
        assert "unspecified" in json.dumps(answer["json"]).lower(), answer
    assert loop["status"] == 422, loop
    detail = loop["json"]["detail"]
    assert "loopback" in detail, detail
    assert probe.address in detail, detail
    assert loop["json"]["errors"][0]["type"] == "unreachable_host"
    assert own["status"] == 201, own
    # The same loopback address from a client on the registry's own loopback is fine.
    on_loopback = f"http://127.0.0.1:{port}/tp-groups/{group}/engine/agents/0"
    local = http(registry, agent("127.0.0.1") | {"url": on_loopback})[0]
    assert local["status"] == 200, local
    deleted = http(
        probe,
        {"method": "DELETE", "url": f"{url}/tp-groups/{group}", "token": tokens["admin"]},
    )[0]
    assert deleted["status"] == 204, deleted


ETCD = shutil.which("etcd")


@pytest.mark.skipif(ETCD is None, reason="the ha profile needs an etcd binary (etcd-server)")
def test_ha_profile_keeps_serving_when_a_registry_replica_is_killed(tmp_path: Path) -> None:
    started = time.monotonic()
    tokens = {role: secrets.token_urlsafe(24) for role in ("worker", "reader", "admin")}
    # `docker compose --env-file docker/ha.env up`, with WORKER_TOKEN set.
    compose_env = {"WORKER_TOKEN": tokens["worker"], **read_env_file(HA_ENV_FILE)}
    services = load_services(compose_env)
    names = ["etcd-1", "etcd-2", "etcd-3", "registry", "registry-2", *PREFILL_NODES]
    assert set(services) == {*names, "decode"}
    with netns.Network() as net:
        try:
            hosts = {name: net.add_host(name, services[name].hostname) for name in names}
            hosts["decode"] = net.add_host("decode-1", secrets.token_hex(6))
            hosts["probe"] = net.add_host("probe")
            net.write_hosts()
            run_ha(tmp_path, net, services, tokens, hosts)
        finally:
            net.close()
            assert net.leftovers() == []
    print(f"ha deployment verified in {time.monotonic() - started:.1f}s")


def run_ha(
    tmp: Path,
    net: netns.Network,
    services: Mapping[str, Service],
    tokens: Mapping[str, str],
    hosts: Mapping[str, netns.Host],
) -> None:
    deploy = Deployment(net, tmp, services)
    token_file = deploy.secrets_dir / "registry_tokens"
    token_file.write_text("".join(f"{role}:{tok}\n" for role, tok in tokens.items()))
    token_file.chmod(0o600)
    probe = hosts["probe"]
    replicas = {
        name: f"http://{name}:{services[name].environment['REGISTRY_PORT']}"
        for name in ("registry", "registry-2")
    }
    assert services["decode"].environment["WORKERS_REGISTRY_URL"] == ",".join(replicas.values())

    for member in ("etcd-1", "etcd-2", "etcd-3"):
        deploy.start(member, hosts[member], report=False)
    registry = {name: deploy.start(name, hosts[name], report=False) for name in replicas}
    for name in replicas:
        deploy.wait_healthy(healthcheck_command(), name, hosts[name], 30)
    deploy.wait_for(
        lambda: all(
            a["status"] == 200
            for a in http(
                probe, *({"method": "GET", "url": f"{u}/readyz"} for u in replicas.values())
            )
        ),
        "both replicas' store (the etcd cluster) to answer",
        30,
    )

    node0 = deploy.start("prefill-node0", hosts["prefill-node0"])
    node1 = deploy.start("prefill-node1", hosts["prefill-node1"])
    deploy.wait_healthy(
        services["prefill-node0"].healthcheck or [], "prefill-node0", node0.host, 120
    )
    group = next(
        a.split("=", 1)[1] for a in services["prefill-node0"].command if a.startswith("--group-id=")
    )
    seen = http(
        probe,
        *(
            {"method": "GET", "url": f"{u}/tp-groups/{group}/engine", "token": tokens["reader"]}
            for u in replicas.values()
        ),
    )
    assert [a["status"] for a in seen] == [200, 200], seen
    assert seen[0]["json"]["engine_id"] == seen[1]["json"]["engine_id"]  # one truth
    assert seen[1]["json"]["ready"], seen[1]
    engine_id = seen[0]["json"]["engine_id"]

    # `docker compose kill registry`: the workers carry on through registry-2.
    registry["registry"].kill()
    decode = deploy.start("decode", hosts["decode"])
    deadline = time.monotonic() + 150
    assert deploy.wait(decode, deadline) == 0, deploy.logs()
    (report,) = read_reports(deploy.reports, "decode")
    assert len(report["rounds"]) == rounds_per_decode(services)
    for figures in report["rounds"]:
        assert figures["engine_id"] == engine_id
        assert figures["verified_bytes"] == figures["bytes"] > 0

    for proc in (node0, node1):
        proc.signal(signal.SIGTERM)
    deadline = time.monotonic() + 40
    for proc in (node0, node1):
        assert deploy.wait(proc, deadline) == 0, proc.tail()
        assert "INFO shut down" in proc.log(), proc.tail()
    after = http(
        probe,
        {
            "method": "GET",
            "url": f"{replicas['registry-2']}/tp-groups/{group}/engine",
            "token": tokens["reader"],
        },
    )[0]
    assert after["json"]["engine_id"] == engine_id
    assert after["json"]["registered_ranks"] == [], after  # deregistered through registry-2
    assert registry["registry-2"].poll() is None, registry["registry-2"].tail()
