"""The Helm chart (helm/tandem), linted and rendered with Helm's own Go SDK (helm-python-sdk, no helm binary),
and the facts that make the pipeline work checked on the objects: GPUs only on the workers, probes everywhere,
every address a component is given served by a rendered Service on the port its container listens on, nothing
as root. Every rendered object against the Kubernetes schemas (slow): tests/e2e/test_helm_chart.py.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from tandem.launcher import kv_block_bytes

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "tandem"
RELEASE, NAMESPACE = "demo", "llm"
KUBE_VERSIONS = ("1.28.0", "1.33.0")  # the chart's minimum (Chart.yaml kubeVersion) and a recent release
SUFFIX = f".{NAMESPACE}.svc.cluster.local"
CRD_KINDS = {"ServiceMonitor"}  # not in the Kubernetes schemas
EXTERNAL_REDIS = "redis://redis-master.cache.svc.cluster.local:6379/0"

VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "external-redis": {"redis": {"enabled": False, "externalUrl": EXTERNAL_REDIS}, "kvstore": {"replicas": 2}},
    "redis-secret": {"redis": {"enabled": False, "existingSecret": "tandem-redis", "existingSecretKey": "url"}},
    "no-collector": {"otelCollector": {"enabled": False}},
    "own-collector-no-metrics": {
        "otelCollector": {"enabled": False}, "metrics": {"enabled": False},
        "telemetry": {"otlpEndpoint": "http://otel-collector.observability.svc.cluster.local:4317"},
    },
    "4-prefill-2-decode": {"prefill": {"replicas": 4},
                           "decode": {"replicas": 2, "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}},
    "aggregated": {"mode": "aggregated", "decode": {"replicas": 3}},
    "pvc-rdma-monitoring": {
        "model": {"storage": {"type": "pvc", "storageClassName": "shared-nfs"}, "download": {"enabled": False}},
        "rdma": {"enabled": True},
        "ucx": {"netDevices": "mlx5_0:1"},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
        "gateway": {"autoscaling": {"enabled": False}, "replicas": 3, "service": {"type": "LoadBalancer"},
                    "discoveryIntervalS": 2.5},
        "otelCollector": {"exporterEndpoint": "tempo.observability.svc.cluster.local:4317"},
        "image": {"registry": "ghcr.io/acme", "tag": "0.1.0-rc1"},
        "engine": {"dtype": "float16", "maxModelLen": 8192},
        "kvstore": {"capacityGb": 64.5, "blockBytes": 2097152},
    },
    "tls": {
        "tls": {"public": {"secretName": "tandem-gateway-tls", "clientCASecretName": "tandem-clients-ca",
                           "serverName": "llm.example.com"},
                "internal": {"secretName": "tandem-mtls", "componentSecrets": {"gateway": "tandem-gateway-mtls"},
                             "serverName": "tandem.internal"}},
    },
    "aggregated-mtls-only": {"mode": "aggregated", "tls": {"internal": {"secretName": "tandem-mtls"}}},
    "api-keys": {"gateway": {"apiKeys": {"existingSecret": "tandem-api-keys", "secretKey": "keys.json"},
                             "maxPromptTokens": 4096},
                 "tests": {"apiKeySecret": "tandem-test-key"}},
    "http-off": {"gateway": {"http": {"enabled": False}}},
    "http-nodeport": {"gateway": {"service": {"type": "NodePort", "nodePort": 30051, "httpPort": 80,
                                              "httpNodePort": 30080},
                                  "http": {"port": 8080, "keepaliveS": 0.5, "streamBuffer": 64}}},
}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values=copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith(".yaml"):
            objects += [o for o in yaml.safe_load_all(text) if o]
    return objects


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: render(values) for name, values in VALUE_SETS.items()}


@pytest.fixture(scope="module")
def default_values() -> dict[str, Any]:
    with helm.Chart.load(CHART) as chart:
        return chart.values


# ---- helpers over rendered objects ----------------------------------------------------------------------------


def kind(objects, k: str) -> list[dict]:
    return [o for o in objects if o["kind"] == k]


def by_name(objects, k: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in kind(objects, k)}


def is_hook(obj) -> bool:
    return "helm.sh/hook" in obj["metadata"].get("annotations", {})


def workloads(objects) -> list[dict]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def pod_specs(objects) -> list[tuple[str, dict]]:
    """(name, pod spec) of every workload and hook pod."""
    out = [(w["metadata"]["name"], w["spec"]["template"]["spec"]) for w in workloads(objects)]
    return out + [(p["metadata"]["name"], p["spec"]) for p in kind(objects, "Pod")]


def component(obj) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


def workload(objects, comp: str) -> dict:
    [w] = [w for w in workloads(objects) if component(w) == comp]
    return w


def container_env(objects, container: dict) -> dict[str, str]:
    """The container's variables: its ConfigMaps (envFrom) overlaid by env values."""
    maps = by_name(objects, "ConfigMap")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]]["data"])
    for var in container.get("env", []):
        env[var["name"]] = var["value"] if "value" in var else f"<from {next(iter(var['valueFrom']))}>"
    return env


def main_container(w: dict) -> dict:
    [c] = w["spec"]["template"]["spec"]["containers"]
    return c


def env_of(objects, comp: str) -> dict[str, str]:
    return container_env(objects, main_container(workload(objects, comp)))


def selects(service: dict, w: dict) -> bool:
    labels = w["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in service["spec"]["selector"].items())


def resolve(objects, address: str) -> tuple[dict, dict]:
    """The (Service, workload) that serve ``address``, checking that the port reaches the container's port.

    ``host:port`` (or a URL) names a ClusterIP Service, host <service>.<ns>.svc.cluster.local; ``dns:///host:port``
    (the gateway's worker entries) a headless Service that publishes not-ready pods: the gateway resolves it to
    every pod's IP and health-checks them itself."""
    dns = address.startswith("dns:///")
    address = address.removeprefix("dns:///") if dns else re.sub(r"^[a-z]+://", "", address).split("/")[0]
    host, port = address.rsplit(":", 1)
    assert host.endswith(SUFFIX), f"{address}: not a Service of the release's namespace"
    name = host[: -len(SUFFIX)]
    services = by_name(objects, "Service")
    assert name in services, f"{address}: no Service {name} is rendered"
    service = services[name]
    [target] = [w for w in workloads(objects) if selects(service, w)]
    headless = service["spec"].get("clusterIP") == "None"
    assert headless == dns, f"{address}: a dns:/// entry needs a headless Service, one address a ClusterIP"
    if dns:
        assert service["spec"]["publishNotReadyAddresses"] is True, f"{address}: loading pods must resolve"
    [svc_port] = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
    ports = {p["name"]: p["containerPort"] for c in target["spec"]["template"]["spec"]["containers"]
             for p in c.get("ports", [])}
    assert svc_port["targetPort"] in ports, f"{address}: target port {svc_port['targetPort']} is no container port"
    return service, target


# ---- lint ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", VALUE_SETS)
def test_lint_is_clean(name):
    report = helm.lint(CHART, copy.deepcopy(VALUE_SETS[name]), strict=True, namespace=NAMESPACE,
                       kube_version=f"v{KUBE_VERSIONS[0]}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors
    assert not report["errors"] and not problems, json.dumps(report, indent=1)


def test_chart_packages_and_installs_from_the_archive(tmp_path):
    archive = helm.package(CHART, destination=tmp_path)
    with helm.Chart.load(archive) as chart:
        assert chart.metadata["appVersion"] == "0.1.0" and chart.schema is not None
        names = {t["name"] for t in chart.templates}
        manifests = chart.render(name=RELEASE, namespace=NAMESPACE, is_install=True)
    assert "templates/tests/test-generate.yaml" in names
    assert "tandem generate --gateway 127.0.0.1:50051" in manifests["tandem/templates/NOTES.txt"]


def test_values_schema_rejects_mistakes():
    for values, message in [
        ({"gateway": {"replica": 3}}, "replica"),  # a typo is an error, not a silently ignored key
        ({"mode": "both"}, "mode"),
        ({"engine": {"kv_cache_gb": 4}}, "kv_cache_gb"),
        ({"prefill": {"gpu": {"count": -1}}}, "count"),
        ({"redis": {"enabled": False, "externalUrl": "redis-master:6379"}}, "externalUrl"),
        ({"decode": {"rollingUpdate": {"maxSurge": "one"}}}, "maxSurge"),
        ({"gateway": {"discoveryIntervalS": 0}}, "discoveryIntervalS"),
        ({"gateway": {"http": {"port": 0}}}, "http/port"),  # 0 would be a random port
        ({"gateway": {"http": {"port": "8000"}}}, "http/port"),
        ({"gateway": {"http": {"keepaliveS": 0}}}, "keepaliveS"),
        ({"gateway": {"http": {"streamBuffer": 0}}}, "streamBuffer"),
        ({"gateway": {"http": {"enable": False}}}, "enable"),
        ({"gateway": {"service": {"httpPort": 70000}}}, "httpPort"),
    ]:
        with pytest.raises(helm.HelmError, match=message):
            render(values)


def test_impossible_layouts_fail_with_an_explanation():
    for values, message in [
        ({"redis": {"enabled": False}, "kvstore": {"replicas": 2}}, "shared Redis index"),
        ({"decode": {"engine": {"dtype": "float32"}}}, "same engine dtype and blockSize"),
        ({"prefill": {"replicas": 0}}, "prefill.replicas"),
        ({"prefill": {"rollingUpdate": {"maxSurge": 0}}}, "maxSurge and maxUnavailable cannot both be 0"),
        ({"gateway": {"http": {"port": 9090}}}, "gateway.http.port 9090 is already a port of the gateway container"),
        ({"gateway": {"http": {"port": 50051}}}, "gateway.http.port 50051 is already a port"),
        ({"tls": {"public": {"secretName": "gw"}, "healthPort": 8000}}, "gateway.http.port 8000 is already a port"),
        ({"gateway": {"service": {"httpPort": 50051}}}, "gateway.service.httpPort 50051 is already a port"),
    ]:
        with pytest.raises(helm.HelmError, match=message):
            render(values)
    render({"mode": "aggregated", "prefill": {"replicas": 0}, "redis": {"enabled": False}})  # nothing to check there
    render({"gateway": {"http": {"enabled": False, "port": 9090}}})  # an API that is off takes no port


# ---- the facts that matter -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", VALUE_SETS)
def test_gpus_only_on_prefill_and_decode(rendered, name):
    objects = rendered[name]
    gpu_components = set()
    for w in workloads(objects):
        spec = w["spec"]["template"]["spec"]
        for c in spec["containers"] + spec.get("initContainers", []):
            resources = c.get("resources", {})
            gpus = {side: resources.get(side, {}).get("nvidia.com/gpu") for side in ("requests", "limits")}
            if any(gpus.values()):
                assert c in spec["containers"], "an init container holds no GPU"
                assert gpus["requests"] == gpus["limits"] == 1
                gpu_components.add(component(w))
                assert component(w) in ("prefill", "decode")
                assert c["image"].split("/")[-1].startswith("tandem-cuda:")
                tolerated = {t.get("key") for t in spec.get("tolerations", [])}
                assert "nvidia.com/gpu" in tolerated
                assert env_of(objects, component(w))["TANDEM_DEVICE"] == "cuda"
            elif component(w) not in ("otel-collector", "redis"):
                assert c["image"].split("/")[-1].startswith("tandem:")
    expected = {"decode"} if VALUE_SETS[name].get("mode") == "aggregated" else {"prefill", "decode"}
    assert gpu_components == expected


def test_a_tensor_parallel_worker_asks_for_one_gpu_per_rank():
    objects = render({"prefill": {"engine": {"tensorParallelSize": 1}},
                      "decode": {"engine": {"tensorParallelSize": 2}}})
    for comp, ranks in (("prefill", 1), ("decode", 2)):
        resources = main_container(workload(objects, comp))["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == ranks
        assert env_of(objects, comp)["TANDEM_TENSOR_PARALLEL_SIZE"] == str(ranks)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_container_has_probes(rendered, name):
    objects = rendered[name]
    for w in workloads(objects):
        for c in w["spec"]["template"]["spec"]["containers"]:
            assert "livenessProbe" in c and "readinessProbe" in c, f"{w['metadata']['name']}/{c['name']}"
            if c.get("command", [None])[0] != "tandem":
                continue
            # tandem services: gRPC probes on grpc.health.v1.Health ("" = the whole server) at the port they serve,
            # or, when that port has TLS (which the probes cannot speak), at the plaintext health port beside it
            env = container_env(objects, c)
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert int(env["TANDEM_PORT"]) == ports["grpc"]
            port = ports["grpc"]
            if "TANDEM_HEALTH_PORT" in env:
                assert int(env["TANDEM_HEALTH_PORT"]) == ports["health"] != port
                port = ports["health"]
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                assert c[probe]["grpc"] == {"port": port, "service": ""}, probe


@pytest.mark.parametrize("name", VALUE_SETS)
def test_addresses_match_the_rendered_services(rendered, name):
    objects = rendered[name]
    aggregated = VALUE_SETS[name].get("mode") == "aggregated"
    gateway = env_of(objects, "gateway")
    given = {"tokenizer": [gateway["TANDEM_TOKENIZER"]], "decode": gateway["TANDEM_DECODE_WORKERS"].split(",")}
    assert float(gateway["TANDEM_DISCOVERY_INTERVAL_S"]) > 0
    if aggregated:
        assert "TANDEM_PREFILL_WORKERS" not in gateway and "TANDEM_KVSTORE" not in gateway
        assert gateway["TANDEM_MODE"] == "aggregated"
        assert not [w for w in workloads(objects) if component(w) in ("prefill", "kvstore", "redis")]
    else:
        given["prefill"] = gateway["TANDEM_PREFILL_WORKERS"].split(",")
        given["kvstore"] = [gateway["TANDEM_KVSTORE"]]
        for worker in ("prefill", "decode"):
            given["kvstore"].append(env_of(objects, worker)["TANDEM_KVSTORE"])
    for comp, addresses in given.items():
        for address in addresses:
            _, target = resolve(objects, address)
            assert component(target) == comp, address
            assert int(address.rsplit(":", 1)[1]) == int(env_of(objects, comp)["TANDEM_PORT"])
        if comp in ("prefill", "decode"):  # one dns:/// entry: every pod of the worker Deployment, however many
            assert addresses == [f"dns:///demo-tandem-{comp}{SUFFIX}:{env_of(objects, comp)['TANDEM_PORT']}"]
            assert workload(objects, comp)["kind"] == "Deployment"
    if aggregated:
        assert "TANDEM_KVSTORE" not in env_of(objects, "decode")
    # Every tandem service binds all interfaces, except the kvstore: its --host is also the data-plane address
    # it advertises to the workers, so it must be the pod's own IP.
    for w in workloads(objects):
        if component(w) in ("gateway", "tokenizer", "prefill", "decode"):
            assert env_of(objects, component(w))["TANDEM_HOST"] == "0.0.0.0"
    if not aggregated:
        [host] = [e for e in main_container(workload(objects, "kvstore"))["env"] if e["name"] == "TANDEM_HOST"]
        assert host["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


@pytest.mark.parametrize("name", VALUE_SETS)
def test_telemetry_reaches_a_collector(rendered, name):
    objects = rendered[name]
    values = VALUE_SETS[name]
    in_chart = values.get("otelCollector", {}).get("enabled", True)
    own = values.get("telemetry", {}).get("otlpEndpoint")
    collectors = [w for w in workloads(objects) if component(w) == "otel-collector"]
    assert bool(collectors) == in_chart
    for w in workloads(objects):
        if component(w) in ("otel-collector", "redis"):
            continue
        env = env_of(objects, component(w))
        assert env["OTEL_SERVICE_NAME"] == f"tandem-{component(w)}"
        assert "service.instance.id=$(POD_NAME)" in env["OTEL_RESOURCE_ATTRIBUTES"]
        if in_chart:
            _, target = resolve(objects, env["OTEL_EXPORTER_OTLP_ENDPOINT"])
            assert target is collectors[0]
            assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].endswith(":4317")
        elif own:
            assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == own
        else:
            assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env
        # metrics: TANDEM_METRICS_PORT is what each service serves /metrics on, and a container port
        ports = {p["name"]: p["containerPort"] for p in main_container(w)["ports"]}
        if values.get("metrics", {}).get("enabled", True):
            assert int(env["TANDEM_METRICS_PORT"]) == ports["metrics"] == 9090
            assert w["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9090"
        else:
            assert env["TANDEM_METRICS_PORT"] == "-1" and "metrics" not in ports  # off, not a random port
    if in_chart:
        [config] = [m for m in kind(objects, "ConfigMap") if component(m) == "otel-collector"]
        pipelines = yaml.safe_load(config["data"]["config.yaml"])["service"]["pipelines"]
        assert pipelines["traces"]["receivers"] == ["otlp"]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_redis_index_where_the_kvstore_expects_it(rendered, name):
    objects = rendered[name]
    values = VALUE_SETS[name]
    if values.get("mode") == "aggregated":
        return
    env = main_container(workload(objects, "kvstore"))["env"]
    url = env_of(objects, "kvstore").get("TANDEM_REDIS_URL")
    redis = values.get("redis", {})
    if redis.get("existingSecret"):
        [var] = [e for e in env if e["name"] == "TANDEM_REDIS_URL"]
        assert var["valueFrom"]["secretKeyRef"] == {"name": "tandem-redis", "key": "url"}
    elif redis.get("externalUrl"):
        assert url == EXTERNAL_REDIS
        assert not [w for w in workloads(objects) if component(w) == "redis"]
    else:
        _, target = resolve(objects, url)
        assert component(target) == "redis"


@pytest.mark.parametrize("name", VALUE_SETS)
def test_nothing_runs_as_root(rendered, name):
    for pod, spec in pod_specs(rendered[name]):
        ctx = spec["securityContext"]
        assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] != 0, pod
        assert ctx["seccompProfile"]["type"] == "RuntimeDefault"
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc.get("runAsUser", ctx["runAsUser"]) != 0 and not sc.get("privileged"), f"{pod}/{c['name']}"
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert set(sc["capabilities"].get("add", [])) <= {"IPC_LOCK"}
            mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
            if c["image"].split("/")[-1].startswith("tandem"):
                assert "/tmp" in mounts, "a read-only root needs a writable /tmp"
        assert spec.get("hostNetwork") is not True and spec.get("hostPID") is not True
        # Kubernetes' service links would define TANDEM_<SERVICE>_PORT-style variables, which tandem reads as flags.
        assert spec["enableServiceLinks"] is False, pod


def test_workers_are_deployments_the_gateway_finds_by_dns(rendered):
    objects = rendered["4-prefill-2-decode"]
    gateway = env_of(objects, "gateway")
    assert gateway["TANDEM_PREFILL_WORKERS"] == f"dns:///demo-tandem-prefill{SUFFIX}:50061"
    assert gateway["TANDEM_DECODE_WORKERS"] == f"dns:///demo-tandem-decode{SUFFIX}:50062"
    assert gateway["TANDEM_DISCOVERY_INTERVAL_S"] == "5"
    surge = {"prefill": {"maxSurge": 1, "maxUnavailable": 0}, "decode": {"maxSurge": 0, "maxUnavailable": 1}}
    for comp, replicas in (("prefill", 4), ("decode", 2)):
        deployment = workload(objects, comp)
        assert deployment["kind"] == "Deployment" and deployment["spec"]["replicas"] == replicas
        assert deployment["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": surge[comp]}
        service, target = resolve(objects, gateway[f"TANDEM_{comp.upper()}_WORKERS"])
        assert target is deployment and service["spec"]["clusterIP"] == "None"
    assert workload(objects, "kvstore")["kind"] == "StatefulSet"
    # The worker counts are in no ConfigMap: scaling (helm upgrade or kubectl scale) restarts nothing.
    default = rendered["default"]

    def checksum(objs, comp):
        return workload(objs, comp)["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    for comp in ("gateway", "tokenizer", "prefill", "decode", "kvstore"):
        assert checksum(objects, comp) == checksum(default, comp)
    assert env_of(default, "gateway")["TANDEM_DECODE_WORKERS"] == gateway["TANDEM_DECODE_WORKERS"]
    fast = env_of(rendered["pvc-rdma-monitoring"], "gateway")
    assert fast["TANDEM_DISCOVERY_INTERVAL_S"] == "2.5"


def test_gateway_autoscaling_and_disruption_budgets(rendered):
    objects = rendered["default"]
    [hpa] = kind(objects, "HorizontalPodAutoscaler")
    gateway = workload(objects, "gateway")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": gateway["metadata"]["name"]}
    assert "replicas" not in gateway["spec"], "the HPA owns the gateway's replica count"
    pdbs = {component(p): p for p in kind(objects, "PodDisruptionBudget")}
    assert set(pdbs) == {"gateway", "tokenizer", "prefill", "decode", "kvstore"}
    for comp, pdb in pdbs.items():
        assert pdb["spec"]["selector"]["matchLabels"] == workload(objects, comp)["spec"]["selector"]["matchLabels"]
    fixed = rendered["pvc-rdma-monitoring"]
    assert not kind(fixed, "HorizontalPodAutoscaler") and workload(fixed, "gateway")["spec"]["replicas"] == 3
    assert by_name(fixed, "Service")["demo-tandem-gateway"]["spec"]["type"] == "LoadBalancer"


def test_engine_variables_are_real_flags(rendered):
    """Every TANDEM_* variable the chart sets is a flag of the service it configures, so the chart cannot drift
    from `tandem serve <name> --help`."""
    from common.settings import env_name
    from tandem.cli import build_parser

    parser = build_parser()
    serve = next(a for a in parser._subparsers._group_actions[0].choices["serve"]._actions
                 if a.dest == "service").choices
    for name, objects in rendered.items():
        for w in workloads(objects):
            comp = component(w)
            if comp not in serve:
                continue
            flags = {env_name(s) for a in serve[comp]._actions for s in a.option_strings if s.startswith("--")}
            tandem_vars = {k for k in env_of(objects, comp) if k.startswith("TANDEM_")}
            assert tandem_vars <= flags, f"{name}/{comp}: {sorted(tandem_vars - flags)} are no flags"


def test_kvstore_block_and_memory_sizing(rendered, default_values):
    config = json.loads((ROOT / "tandem" / "configs" / "smollm2-135m" / "config.json").read_text())
    layers, kv_heads = config["num_hidden_layers"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    model = default_values["model"]
    assert (model["numLayers"], model["numKvHeads"], model["headDim"]) == (layers, kv_heads, head_dim)
    block = default_values["engine"]["blockSize"]
    expected = kv_block_bytes(config, "bfloat16", block)  # the chart's formula is a copy of engine/kv_blocks.py's
    assert int(env_of(rendered["default"], "kvstore")["TANDEM_BLOCK_BYTES"]) == expected
    resources = main_container(workload(rendered["default"], "kvstore"))["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == "10Gi"  # 8 GiB pool + 2
    big = rendered["pvc-rdma-monitoring"]
    assert env_of(big, "kvstore")["TANDEM_BLOCK_BYTES"] == "2097152"  # no "2.097152e+06"
    assert env_of(big, "kvstore")["TANDEM_CAPACITY_GB"] == "64.5"
    assert main_container(workload(big, "kvstore"))["resources"]["limits"]["memory"] == "66.5Gi"
    assert env_of(big, "prefill")["TANDEM_MAX_MODEL_LEN"] == "8192"
    assert "TANDEM_MAX_MODEL_LEN" not in env_of(rendered["default"], "prefill")  # null: the service's default


def test_model_volume_and_download(rendered):
    objects = rendered["default"]
    for comp in ("tokenizer", "prefill", "decode"):
        spec = workload(objects, comp)["spec"]["template"]["spec"]
        assert env_of(objects, comp)["TANDEM_MODEL"] == "/models/models/SmolLM2-135M-Instruct"
        [init] = spec["initContainers"]
        assert init["command"] == ["tandem", "fetch-model"]
        assert {"name": "TANDEM_HOME", "value": "/models"} in init["env"]
        assert not init["volumeMounts"][0].get("readOnly")
        [mount] = [m for m in main_container(workload(objects, comp))["volumeMounts"] if m["name"] == "model"]
        assert mount["readOnly"] is True and mount["mountPath"] == "/models"
    for comp in ("gateway", "kvstore"):
        assert "initContainers" not in workload(objects, comp)["spec"]["template"]["spec"]
    pvc = rendered["pvc-rdma-monitoring"]
    [claim] = kind(pvc, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    for comp in ("tokenizer", "prefill", "decode"):
        spec = workload(pvc, comp)["spec"]["template"]["spec"]
        assert "initContainers" not in spec
        [volume] = [v for v in spec["volumes"] if v["name"] == "model"]
        assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]


def test_ucx_and_rdma_settings(rendered):
    plain = rendered["default"]
    for comp in ("prefill", "decode", "kvstore"):
        assert env_of(plain, comp)["UCX_TLS"] == "tcp"
        assert "rdma/rdma_shared_device_a" not in main_container(workload(plain, comp))["resources"]["limits"]
    assert "UCX_TLS" not in env_of(plain, "gateway")
    assert "UCX_TLS" not in env_of(rendered["aggregated"], "decode")  # no data plane without the kvstore
    rdma = rendered["pvc-rdma-monitoring"]
    for comp in ("prefill", "decode", "kvstore"):
        c = main_container(workload(rdma, comp))
        assert env_of(rdma, comp)["UCX_TLS"] == "rc,tcp" and env_of(rdma, comp)["UCX_NET_DEVICES"] == "mlx5_0:1"
        assert c["resources"]["requests"]["rdma/rdma_shared_device_a"] == 1
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    [monitor] = kind(rdma, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    wanted = monitor["spec"]["selector"]["matchLabels"].items()
    scraped = [s for s in kind(rdma, "Service") if all(s["metadata"]["labels"].get(k) == v for k, v in wanted)]
    assert {component(s) for s in scraped} == {"gateway", "tokenizer", "prefill", "decode", "kvstore"}
    assert all("metrics" in {p["name"] for p in s["spec"]["ports"]} for s in scraped)
    assert workload(rdma, "prefill")["spec"]["template"]["spec"]["containers"][0]["image"] == \
        "ghcr.io/acme/tandem-cuda:0.1.0-rc1"


def documented_values(text: str) -> dict[str, str]:
    """Keys of values.yaml with a ``# --`` comment (helm-docs' convention) and that comment."""
    path: list[tuple[int, str]] = []
    pending: list[str] | None = None
    out = {}
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            pending = None
        elif stripped.startswith("# --"):
            pending = [stripped[4:].strip()]
        elif stripped.startswith("#"):
            if pending is not None:
                pending.append(stripped[1:].strip())
        elif (m := re.match(r"^(\s*)([\w.\-/]+):", line)) and not stripped.startswith("- "):
            while path and path[-1][0] >= len(m.group(1)):
                path.pop()
            path.append((len(m.group(1)), m.group(2)))
            if pending:
                out[".".join(k for _, k in path)] = " ".join(pending)
            pending = None
    return out


def test_readme_documents_every_value():
    text = (CHART / "values.yaml").read_text()
    documented = documented_values(text)
    rows = dict(re.findall(r"^\| `([^`]+)` \| [^|]+ \| `.*?` \| (.+) \|$", (CHART / "README.md").read_text(), re.M))
    assert set(rows) == set(documented), "regenerate the README's values table"
    for key, description in documented.items():
        assert rows[key] == description.replace("|", "\\|"), key

    def leaves(values: Any, prefix: str = "") -> set[str]:
        if isinstance(values, dict) and values:
            return set().union(*(leaves(v, f"{prefix}.{k}" if prefix else k) for k, v in values.items()))
        return {prefix}

    for leaf in leaves(yaml.safe_load(text)):  # each value is documented, or inside a documented one
        parts = leaf.split(".")
        assert any(".".join(parts[:i]) in documented for i in range(1, len(parts) + 1)), f"{leaf} is undocumented"


def test_tls_from_secrets(rendered):
    """TLS on the public port and mutual TLS inside: every service reads its certificate files from a Secret
    mounted read-only where its TANDEM_TLS_* variables point, and is probed on its plaintext health port."""
    objects = rendered["tls"]
    tls_dir = "/etc/tandem/tls"

    def mounted(comp: str) -> dict[str, tuple[str, set[str]]]:
        """mount path -> (Secret, keys) of a component's Secret volumes."""
        spec = workload(objects, comp)["spec"]["template"]["spec"]
        volumes = {v["name"]: v["secret"] for v in spec["volumes"] if "secret" in v}
        out = {}
        for m in main_container(workload(objects, comp))["volumeMounts"]:
            if m["name"] in volumes:
                assert m["readOnly"] is True
                secret = volumes[m["name"]]
                assert secret["defaultMode"] == 0o440, "keys readable by the pod's group (fsGroup) only"
                out[m["mountPath"]] = (secret["secretName"], {i["path"] for i in secret["items"]})
        return out

    def file_of(comp: str, path: str) -> str:
        """The Secret behind a file a TANDEM_TLS_* variable names, checking that the file is mounted."""
        folder, name = path.rsplit("/", 1)
        secret, keys = mounted(comp)[folder]
        assert name in keys, path
        return secret

    gateway = env_of(objects, "gateway")
    assert file_of("gateway", gateway["TANDEM_TLS_CERT"]) == "tandem-gateway-tls"
    assert file_of("gateway", gateway["TANDEM_TLS_KEY"]) == "tandem-gateway-tls"
    assert file_of("gateway", gateway["TANDEM_TLS_CLIENT_CA"]) == "tandem-clients-ca"
    assert file_of("gateway", gateway["TANDEM_TLS_INTERNAL_CERT"]) == "tandem-gateway-mtls"
    assert file_of("gateway", gateway["TANDEM_TLS_INTERNAL_KEY"]) == "tandem-gateway-mtls"
    assert file_of("gateway", gateway["TANDEM_TLS_CA"]) == "tandem-gateway-mtls"
    for comp in ("tokenizer", "prefill", "decode", "kvstore"):
        env = env_of(objects, comp)
        for var in ("TANDEM_TLS_CERT", "TANDEM_TLS_KEY", "TANDEM_TLS_CA"):
            assert env[var].startswith(f"{tls_dir}/internal/") and file_of(comp, env[var]) == "tandem-mtls"
        assert "TANDEM_TLS_CLIENT_CA" not in env and "TANDEM_TLS_INTERNAL_CERT" not in env
    for comp in ("gateway", "tokenizer", "prefill", "decode", "kvstore"):
        env = env_of(objects, comp)
        assert env["TANDEM_TLS_SERVER_NAME"] == "tandem.internal" and env["TANDEM_HEALTH_PORT"] == "8081"
    # The helm test verifies the gateway with the public Secret's CA, and mounts nothing else of it.
    [pod] = kind(objects, "Pod")
    args = pod["spec"]["containers"][0]["args"]
    assert args[args.index("--tls-ca") + 1] == f"{tls_dir}/public/ca.crt"
    assert args[args.index("--tls-server-name") + 1] == "llm.example.com"
    [secret] = [v["secret"] for v in pod["spec"]["volumes"] if "secret" in v]
    assert secret["secretName"] == "tandem-gateway-tls" and secret["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    # mutual TLS only: the gateway's public port stays plaintext (and is probed there), the rest is mTLS
    inside = rendered["aggregated-mtls-only"]
    gateway = env_of(inside, "gateway")
    assert "TANDEM_TLS_CERT" not in gateway and "TANDEM_HEALTH_PORT" not in gateway
    assert gateway["TANDEM_TLS_INTERNAL_CERT"] == f"{tls_dir}/internal/tls.crt"
    assert env_of(inside, "decode")["TANDEM_HEALTH_PORT"] == "8081"
    # no TLS: no TLS variables, no health port, no Secret volumes
    for comp in ("gateway", "tokenizer", "prefill", "decode", "kvstore"):
        assert not [k for k in env_of(rendered["default"], comp) if k.startswith("TANDEM_TLS") or "HEALTH" in k]


def test_tls_mistakes_fail_with_an_explanation():
    for values, message in [
        ({"tls": {"public": {"clientCASecretName": "ca"}}}, "needs tls.public.secretName"),
        ({"tls": {"internal": {"componentSecrets": {"gateway": "gw-mtls"}}}}, "every component needs a certificate"),
    ]:
        with pytest.raises(helm.HelmError, match=message):
            render(values)
    for values, message in [
        ({"tls": {"internal": {"componentSecrets": {"redis": "x"}}}}, "redis"),
        ({"tls": {"healthPort": 0}}, "healthPort"),
    ]:
        with pytest.raises(helm.HelmError, match=message):
            render(values)


def test_api_keys_from_a_secret(rendered):
    """The gateway reads its API keys file from a Secret mounted as a directory (a subPath mount would never see
    the Secret's updates, which the gateway picks up by itself); no other component sees it."""
    objects = rendered["api-keys"]
    env = env_of(objects, "gateway")
    assert env["TANDEM_API_KEYS_FILE"] == "/etc/tandem/api-keys/keys.json"
    assert env["TANDEM_MAX_PROMPT_TOKENS"] == "4096"
    spec = workload(objects, "gateway")["spec"]["template"]["spec"]
    [volume] = [v for v in spec["volumes"] if v["name"] == "api-keys"]
    assert volume["secret"]["secretName"] == "tandem-api-keys"
    assert [i["path"] for i in volume["secret"]["items"]] == ["keys.json"]
    [mount] = [m for m in main_container(workload(objects, "gateway"))["volumeMounts"] if m["name"] == "api-keys"]
    assert mount == {"name": "api-keys", "mountPath": "/etc/tandem/api-keys", "readOnly": True}
    for w in workloads(objects):
        if component(w) != "gateway":
            assert "TANDEM_API_KEYS_FILE" not in container_env(objects, main_container(w))
            assert "api-keys" not in {v["name"] for v in w["spec"]["template"]["spec"].get("volumes", [])}
    assert "TANDEM_API_KEYS_FILE" not in env_of(rendered["default"], "gateway")
    [test_pod] = kind(objects, "Pod")  # `helm test` sends a key of its own, from another Secret
    [key_env] = [e for e in test_pod["spec"]["containers"][0]["env"] if e["name"] == "TANDEM_API_KEY"]
    assert key_env["valueFrom"]["secretKeyRef"] == {"name": "tandem-test-key", "key": "key"}


def test_openai_http_api_on_the_gateway(rendered):
    """The OpenAI-compatible HTTP API the gateway serves beside gRPC: TANDEM_HTTP_PORT is the container port
    `http`, which the gateway Service exposes; disabled, the gateway is told -1 (off, not a random port: 0 would
    be one) and no port is rendered. The probes stay on gRPC, and no other component gets any of it."""
    objects = rendered["default"]
    env = env_of(objects, "gateway")
    c = main_container(workload(objects, "gateway"))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert env["TANDEM_HTTP_PORT"] == "8000" and ports["http"] == 8000
    assert env["TANDEM_HTTP_KEEPALIVE_S"] == "5" and env["TANDEM_HTTP_STREAM_BUFFER"] == "1024"
    service = by_name(objects, "Service")["demo-tandem-gateway"]
    [http] = [p for p in service["spec"]["ports"] if p["name"] == "http"]
    assert http == {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
    _, target = resolve(objects, f"demo-tandem-gateway{SUFFIX}:8000")
    assert component(target) == "gateway"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["grpc"]["port"] == 50051, probe
    for w in workloads(objects):
        if component(w) != "gateway":
            assert not [k for k in container_env(objects, main_container(w)) if k.startswith("TANDEM_HTTP")]
            assert "http" not in {p["name"] for p in main_container(w).get("ports", [])}
    # HTTPS through the public port's flags: the same TANDEM_TLS_* the gateway already reads
    tls = env_of(rendered["tls"], "gateway")
    assert tls["TANDEM_HTTP_PORT"] == "8000" and tls["TANDEM_TLS_CERT"].endswith("/public/tls.crt")

    off = rendered["http-off"]
    assert env_of(off, "gateway")["TANDEM_HTTP_PORT"] == "-1"
    assert "http" not in {p["name"] for p in main_container(workload(off, "gateway"))["ports"]}
    assert "http" not in {p["name"] for p in by_name(off, "Service")["demo-tandem-gateway"]["spec"]["ports"]}
    checksum = "checksum/config"  # turning it on or off rolls the gateways
    assert workload(off, "gateway")["spec"]["template"]["metadata"]["annotations"][checksum] != \
        workload(objects, "gateway")["spec"]["template"]["metadata"]["annotations"][checksum]

    custom = rendered["http-nodeport"]
    env = env_of(custom, "gateway")
    assert (env["TANDEM_HTTP_PORT"], env["TANDEM_HTTP_KEEPALIVE_S"], env["TANDEM_HTTP_STREAM_BUFFER"]) == \
        ("8080", "0.5", "64")
    service = by_name(custom, "Service")["demo-tandem-gateway"]
    [http] = [p for p in service["spec"]["ports"] if p["name"] == "http"]
    assert http == {"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP", "nodePort": 30080}
    _, target = resolve(custom, f"demo-tandem-gateway{SUFFIX}:80")
    ports = {p["name"]: p["containerPort"] for p in main_container(target)["ports"]}
    assert ports["http"] == 8080


def test_notes_show_the_http_api():
    def notes(values: dict[str, Any]) -> str:
        with helm.Chart.load(CHART) as chart:
            manifests = chart.render(values=copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE,
                                     is_install=True)
        return manifests["tandem/templates/NOTES.txt"]

    text = notes({})
    assert "port-forward svc/demo-tandem-gateway 8000:8000" in text
    assert "curl http://127.0.0.1:8000/v1/models" in text
    assert 'curl -H "Authorization: Bearer $TANDEM_API_KEY" http://127.0.0.1:8000/v1/models' in notes(
        {"gateway": {"apiKeys": {"existingSecret": "tandem-api-keys"}}})
    tls = notes(VALUE_SETS["tls"])
    assert "--cacert ca.crt --cert client.crt --key client.key" in tls
    assert "https://llm.example.com:8000/v1/models" in tls
    off = notes(VALUE_SETS["http-off"])
    assert "/v1/models" not in off and "8000" not in off
