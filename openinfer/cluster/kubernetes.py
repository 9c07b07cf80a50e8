"""The serving system as Kubernetes resources: one template (`kubernetes.yaml.j2`) and its values (the model, the
pools' sizes and GPU counts; `deploy/values.yaml`), rendered and checked offline (`openinfer deploy render|check`,
docs/deployment.md).

What is rendered: the router (a Deployment and its Service, the front door); each pool of engine instances
(prefill, decode or whole-request `both`) as a StatefulSet whose pods are one instance each, with a headless Service
so the router can address every instance by a stable DNS name (`<pool>-N.<pool>`), or, when an instance needs more
GPUs than a node has, as KubeRay RayClusters (one per instance, the server on the head under the Ray backend); the
prefix-KV store the prefill and decode instances share (a Redis Deployment, or a ReadWriteMany volume); readiness
and liveness from `/health`; Prometheus scrape annotations on `/metrics`, where the `/load` signals are gauges; and
per autoscaled pool an HPA that carries the autoscaler's policy (`cluster/autoscale.py`): bounds, rate limits,
scale-in stabilization, and its target utilization as per-pod metric targets.

What is checked (`check`): every resource against the Kubernetes OpenAPI schemas of two Kubernetes versions
(`kubernetes-validate`, strict: unknown fields are errors); a RayCluster, which those schemas do not cover, against
the fields of KubeRay's CRD used here, and its pod templates against the Kubernetes PodTemplateSpec schema; then the
references between resources, which no schema sees: selectors that select a pod template, Service target ports and
probe ports that name a container port, StatefulSets' governing Services, HPA targets, volumes and claims, and every
`http://` or `redis://` address in a container's arguments (a Service that exists, on a port it exposes; a
StatefulSet pod's name within the pool's largest size).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from openinfer.cluster.autoscale import AutoscaleConfig, PoolBounds

TEMPLATE = Path(__file__).with_name("kubernetes.yaml.j2")
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")     # validated against both: a version still common and the newest
ROLES = ("prefill", "decode", "both")
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


# ---- values ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVStore:
    """The prefix-KV store prefill and decode instances share: `redis` (a Redis Deployment in the cluster) or
    `volume` (a ReadWriteMany claim every pod mounts at /kv-store); `none` without prefill pools."""
    kind: str = "redis"
    size: str = "64gb"                  # Redis: maxmemory (its own units); volume: the claim's storage request
    memory_limit: str = "72Gi"          # Redis: the container's limit (above maxmemory: Redis' own overhead)
    redis_image: str = "redis:7.4-alpine"
    storage_class: str | None = None    # volume: a class that offers ReadWriteMany (NFS, CephFS, ...)


@dataclass(frozen=True)
class Router:
    replicas: int = 2
    port: int = 8080


@dataclass(frozen=True)
class Pool:
    """Engine instances of one role. `min_replicas`/`max_replicas` make it autoscaled (an HPA sets the count; the
    StatefulSet leaves `replicas` out, so applying the resources again does not reset it); without them it keeps
    `replicas` (default 1). `requests_per_instance`: decode, the running requests one instance serves at its TPOT
    target (the autoscaler's decode capacity); `engine_args`: more `openinfer serve` flags."""
    role: str
    replicas: int | None = None
    min_replicas: int | None = None
    max_replicas: int | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    requests_per_instance: int | None = None
    engine_args: tuple[str, ...] = ()

    @property
    def gpus(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size


@dataclass(frozen=True)
class Autoscale:
    """The autoscaler's policy knobs as the HPA can hold them (cluster/autoscale.py's defaults)."""
    interval_s: int = int(AutoscaleConfig.interval_s)
    target_utilization: float = AutoscaleConfig.target_utilization
    scale_in_max_quota_use: float = AutoscaleConfig.scale_in_max_quota_use
    scale_in_stabilization_intervals: int = AutoscaleConfig.scale_in_stabilization_intervals
    max_add_per_interval: int = PoolBounds.max_add_per_interval
    max_remove_per_interval: int = PoolBounds.max_remove_per_interval

    @property
    def scale_in_window_s(self) -> int:
        return self.interval_s * self.scale_in_stabilization_intervals


@dataclass(frozen=True)
class Values:
    image: str
    model: str                          # what `openinfer serve` loads: a path under /models, or a short name
    pools: dict[str, Pool]
    name: str = "openinfer"
    model_claim: str | None = None      # a PersistentVolumeClaim (yours) holding the model, mounted at /models
    served_model_name: str | None = None
    gpu_resource: str = "nvidia.com/gpu"
    gpus_per_node: int = 8
    shm_size: str = "16Gi"
    engine_port: int = 8000
    termination_grace_s: int = 45       # the server's graceful shutdown (30 s) and some
    ray_version: str = "2.60.0"         # RayCluster pools: the Ray in the image
    kv_store: KVStore = field(default_factory=KVStore)
    router: Router = field(default_factory=Router)
    autoscale: Autoscale = field(default_factory=Autoscale)


def _need(module: str):
    """An optional dependency of rendering or checking, or a ValueError naming the extra that brings it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"`openinfer deploy` needs {module.split('.')[0]}: pip install 'openinfer[deploy]'") from None


def _build(cls, data, where: str):
    """A values dataclass from a mapping; unknown or missing keys are errors naming `where`."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(fields)}")
    kwargs = dict(data)
    for name, sub in (("kv_store", KVStore), ("router", Router), ("autoscale", Autoscale)):
        if name in kwargs and name in fields:
            kwargs[name] = _build(sub, kwargs[name], f"{where}.{name}")
    if "engine_args" in kwargs:
        kwargs["engine_args"] = tuple(str(a) for a in kwargs["engine_args"])
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing}")
    return cls(**kwargs)


def parse_values(data: dict) -> Values:
    """Values from their YAML mapping, checked: names, roles, pools the engine can run as asked."""
    pools = data.get("pools") if isinstance(data, dict) else None
    if not isinstance(pools, dict) or not pools:
        raise ValueError("values: `pools` must map pool names to pools (at least one)")
    values = _build(Values, {**data, "pools": {n: _build(Pool, p, f"pools.{n}") for n, p in pools.items()}},
                    "values")
    _check_values(values)
    return values


def _check_values(v: Values) -> None:
    if not _DNS_LABEL.match(v.name) or len(v.name) > 40:
        raise ValueError(f"name must be a DNS label of at most 40 characters (resources are named after it), "
                         f"got {v.name!r}")
    if v.kv_store.kind not in ("redis", "volume", "none"):
        raise ValueError(f"kv_store.kind must be redis, volume or none, got {v.kv_store.kind!r}")
    roles = [p.role for p in v.pools.values()]
    if not any(r in ("decode", "both") for r in roles):
        raise ValueError("pools: the router needs a decode or both pool (prefill instances only compute prompts)")
    if "prefill" in roles and v.kv_store.kind == "none":
        raise ValueError("a prefill pool hands its KV to the decode pool through the prefix-KV store: set "
                         "kv_store.kind to redis or volume")
    for name, p in v.pools.items():
        where = f"pools.{name}"
        if not _DNS_LABEL.match(name):
            raise ValueError(f"{where}: a pool name must be a DNS label")
        if p.role not in ROLES:
            raise ValueError(f"{where}.role must be one of {ROLES}, got {p.role!r}")
        if (p.replicas is not None and p.replicas < 1) or p.gpus < 1:
            raise ValueError(f"{where}: replicas and the parallel sizes must be >= 1")
        if p.role in ("prefill", "decode") and p.gpus > 1:
            raise ValueError(f"{where}: a {p.role} instance shares KV through the prefix-KV store, a one-process "
                             f"feature for now: tensor_parallel_size x data_parallel_size must be 1, got {p.gpus}")
        if (p.min_replicas is None) != (p.max_replicas is None):
            raise ValueError(f"{where}: give both min_replicas and max_replicas (autoscaled), or neither (fixed)")
        if p.min_replicas is not None:
            if p.replicas is not None:
                raise ValueError(f"{where}: an autoscaled pool's replicas are the HPA's to set, between min_replicas "
                                 f"and max_replicas: leave replicas out")
            if not 1 <= p.min_replicas <= p.max_replicas:
                raise ValueError(f"{where}: need 1 <= min_replicas <= max_replicas, got {p.min_replicas}, "
                                 f"{p.max_replicas}")
        if p.gpus > v.gpus_per_node:
            if p.gpus % v.gpus_per_node:
                raise ValueError(f"{where}: an instance over several nodes takes whole nodes: {p.gpus} GPUs is not "
                                 f"a multiple of gpus_per_node={v.gpus_per_node}")
            if p.min_replicas is not None:
                raise ValueError(f"{where}: instances over several nodes (RayClusters) are not autoscaled by an "
                                 f"HPA: leave out min_replicas/max_replicas")


# ---- rendering -----------------------------------------------------------------------------------------------
def _serve_args(v: Values, p: Pool) -> list[str]:
    args = ["serve", v.model, "--host", "0.0.0.0", "--port", str(v.engine_port), "--role", p.role]
    if v.served_model_name:
        args += ["--served-model-name", v.served_model_name]
    if p.gpus > 1:
        args += ["--tensor-parallel-size", str(p.tensor_parallel_size),
                 "--data-parallel-size", str(p.data_parallel_size)]
    if p.enable_expert_parallel:
        args.append("--enable-expert-parallel")
    if p.gpus > v.gpus_per_node:
        args += ["--distributed-executor-backend", "ray"]
    if p.role in ("prefill", "decode"):
        args += (["--kv-store-url", f"redis://{v.name}-redis:6379/0"] if v.kv_store.kind == "redis"
                 else ["--kv-store-dir", "/kv-store"])
    return args + list(p.engine_args)


def _hpa_metrics(v: Values, p: Pool) -> list[tuple[str, str]]:
    """(Prometheus gauge, per-pod target) pairs. Prefill demand is compute: the busy fractions' sum is the
    instances' worth of work, so a per-pod target of the target utilization sizes the pool as `decide` does.
    Decode demand is running requests against requests_per_instance at the target utilization; the busy
    fraction at the scale-in limit keeps an HPA, which takes the largest of its metrics' counts, from scaling
    in while the pool is that busy (the policy's scale-in block)."""
    a = v.autoscale
    if p.role == "prefill":
        return [("openinfer:engine_busy_fraction", _quantity(a.target_utilization))]
    metrics = []
    if p.requests_per_instance:
        metrics.append(("openinfer:num_requests_running", _quantity(p.requests_per_instance * a.target_utilization)))
    metrics.append(("openinfer:engine_busy_fraction",
                    _quantity(a.scale_in_max_quota_use if p.requests_per_instance else a.target_utilization)))
    return metrics


def _quantity(x: float) -> str:
    """A Kubernetes quantity ("45", "44.8", "0.7"), to the thousandth the HPA reads it in."""
    return f"{round(x, 3):g}"


def _url(host: str, port: int) -> str:
    return f"http://{host}:{port}"


def render(values: Values) -> str:
    """The resources as one YAML stream."""
    import jinja2

    pools, router_urls = [], {r: [] for r in ROLES}
    for name, p in values.pools.items():
        workload = f"{values.name}-{name}"
        multi_host = p.gpus > values.gpus_per_node
        replicas = p.replicas or 1
        if multi_host:
            hosts = [f"{workload}-{i}" for i in range(replicas)]
        else:   # every name the pool can reach: the router drains the ones not (yet) there
            hosts = [f"{workload}-{i}.{workload}" for i in range(p.max_replicas or replicas)]
        router_urls[p.role] += [_url(h, values.engine_port) for h in hosts]
        pools.append(dict(name=name, role=p.role, replicas=replicas, gpus=p.gpus, workload=workload,
                          multi_host=multi_host, nodes=p.gpus // values.gpus_per_node if multi_host else 1,
                          args=_serve_args(values, p), uses_store=p.role in ("prefill", "decode"),
                          autoscaled=p.min_replicas is not None, min_replicas=p.min_replicas,
                          max_replicas=p.max_replicas, hpa_metrics=_hpa_metrics(values, p)))
    router_args = ["router", "--host", "0.0.0.0", "--port", str(values.router.port)]
    for role in ROLES:
        if router_urls[role]:
            router_args += [f"--{role}", *router_urls[role]]
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["q"] = lambda x: json.dumps(x, ensure_ascii=False)    # JSON scalars and lists are YAML
    body = env.from_string(TEMPLATE.read_text()).render(v=values, pools=pools, router_args=router_args)
    return body.strip() + "\n"


def load_values(path: str | Path, overrides: list[str] = ()) -> Values:
    """Values from a YAML file, with `key.sub=value` overrides (the value read as YAML)."""
    yaml = _need("yaml")
    data = yaml.safe_load(Path(path).read_text())
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set takes key.sub=value, got {item!r}")
        node = data
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = yaml.safe_load(raw)
    return parse_values(data)


def resources_of(text: str) -> list[dict]:
    yaml = _need("yaml")
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


# ---- checking ----------------------------------------------------------------------------------------------------
# KubeRay's RayCluster CRD (ray.io/v1), the fields used here; pod templates are checked against Kubernetes' own schema
_GROUP = {"rayStartParams": {"type": "object", "additionalProperties": {"type": "string"}},
          "template": {"type": "object"}}
_RAYCLUSTER_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "ray.io/v1"}, "kind": {"const": "RayCluster"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "required": ["headGroupSpec"], "additionalProperties": False, "properties": {
            "rayVersion": {"type": "string"},
            "headGroupSpec": {"type": "object", "required": ["rayStartParams", "template"],
                              "additionalProperties": False, "properties": _GROUP},
            "workerGroupSpecs": {"type": "array", "items": {
                "type": "object", "required": ["groupName", "rayStartParams", "template"],
                "additionalProperties": False,
                "properties": {**_GROUP, "groupName": {"type": "string"},
                               **{k: {"type": "integer", "minimum": 0}
                                  for k in ("replicas", "minReplicas", "maxReplicas", "numOfHosts")}}}}}}}}


def _name(res: dict) -> str:
    return f"{res.get('kind')}/{res.get('metadata', {}).get('name')}"


def _pod_templates(res: dict) -> list[tuple[str, dict]]:
    """(where, PodTemplateSpec) of a workload."""
    kind, spec = res.get("kind"), res.get("spec") or {}
    if kind in ("Deployment", "StatefulSet"):
        return [(_name(res), spec.get("template") or {})]
    if kind == "RayCluster":
        out = [(f"{_name(res)} head", (spec.get("headGroupSpec") or {}).get("template") or {})]
        out += [(f"{_name(res)} group {g.get('groupName')}", g.get("template") or {})
                for g in spec.get("workerGroupSpecs") or []]
        return out
    return []


@functools.lru_cache(maxsize=256)
def _kubernetes_problem(doc_json: str) -> str | None:
    """The first schema violation of one resource (given as JSON: a pure function of it, so a resource checked
    again, as after `render`, is not validated twice), over KUBERNETES_VERSIONS; None if it validates."""
    kv = _need("kubernetes_validate")
    doc = json.loads(doc_json)
    for version in KUBERNETES_VERSIONS:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:
            path = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path)
            return f"{path or '(top)'}: {e.message} (Kubernetes {version} schema)"
        except kv.SchemaNotFoundError:
            return f"no Kubernetes {version} schema for {doc.get('apiVersion')} {doc.get('kind')}"
    return None


def _schema_problems(res: dict) -> list[str]:
    import jsonschema

    problems = []

    def validate(doc: dict, where: str) -> None:
        problem = _kubernetes_problem(json.dumps(doc, sort_keys=True))
        if problem is not None:
            problems.append(f"{where}: {problem}")

    if res.get("kind") == "RayCluster":
        for e in jsonschema.Draft202012Validator(_RAYCLUSTER_SCHEMA).iter_errors(res):
            problems.append(f"{_name(res)}: {'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message} "
                            f"(KubeRay RayCluster fields)")
        for where, template in _pod_templates(res):
            validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"},
                      "template": template}, where)
    else:
        validate(res, _name(res))
    return problems


def _selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _container_ports(template: dict) -> list[dict]:
    return [p for c in (template.get("spec") or {}).get("containers") or [] for p in c.get("ports") or []]


def _port_matches(ref, ports: list[dict]) -> bool:
    if isinstance(ref, int):
        return any(p.get("containerPort") == ref for p in ports)
    return any(p.get("name") == ref for p in ports)


def check(resources: list[dict], external_claims: tuple[str, ...] = ()) -> list[str]:
    """Everything wrong with `resources`, one line each naming the resource (empty: all good).
    `external_claims`: PersistentVolumeClaims that exist outside these resources (the model's)."""
    problems = [p for res in resources for p in _schema_problems(res)]
    by_kind: dict[str, dict[str, dict]] = {}
    for res in resources:
        by_kind.setdefault(res.get("kind"), {})[res.get("metadata", {}).get("name")] = res
    services = by_kind.get("Service", {})
    templates = [(where, res, t) for res in resources for where, t in _pod_templates(res)]

    # workloads: selectors, probes, volumes
    for kind in ("Deployment", "StatefulSet"):
        for name, res in by_kind.get(kind, {}).items():
            spec = res.get("spec") or {}
            labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
            if not _selects((spec.get("selector") or {}).get("matchLabels") or {}, labels):
                problems.append(f"{kind}/{name}: spec.selector does not select its own pod template's labels")
            if kind == "StatefulSet":
                svc = services.get(spec.get("serviceName"))
                if svc is None:
                    problems.append(f"StatefulSet/{name}: serviceName {spec.get('serviceName')!r} is no Service here")
                elif (svc["spec"].get("clusterIP") != "None"
                      or not _selects(svc["spec"].get("selector") or {}, labels)):
                    problems.append(f"StatefulSet/{name}: its Service {svc['metadata']['name']!r} must be headless "
                                    f"(clusterIP: None) and select its pods")
    claims = set(by_kind.get("PersistentVolumeClaim", {})) | set(external_claims)
    for where, _, template in templates:
        spec = template.get("spec") or {}
        volumes = {vol.get("name"): vol for vol in spec.get("volumes") or []}
        for vol in volumes.values():
            claim = (vol.get("persistentVolumeClaim") or {}).get("claimName")
            if claim is not None and claim not in claims:
                problems.append(f"{where}: volume {vol.get('name')!r} claims {claim!r}, which is neither rendered "
                                f"here nor declared as existing (model_claim)")
        for c in spec.get("containers") or []:
            for mount in c.get("volumeMounts") or []:
                if mount.get("name") not in volumes:
                    problems.append(f"{where}: container {c.get('name')!r} mounts {mount.get('name')!r}, no volume "
                                    f"of its pod")
            for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(probe_name) or {}
                port = (probe.get("httpGet") or probe.get("tcpSocket") or {}).get("port")
                if port is not None and not _port_matches(port, c.get("ports") or []):
                    problems.append(f"{where}: container {c.get('name')!r} {probe_name} port {port!r} is not one "
                                    f"of its ports")

    # Services: what they select, and the ports they forward to
    for name, svc in services.items():
        spec = svc.get("spec") or {}
        selected = [t for _, _, t in templates if _selects(spec.get("selector") or {},
                                                           (t.get("metadata") or {}).get("labels") or {})]
        if not selected:
            problems.append(f"Service/{name}: its selector {spec.get('selector')} selects no pod template here")
            continue
        for port in spec.get("ports") or []:
            target = port.get("targetPort", port.get("port"))
            if not all(_port_matches(target, _container_ports(t)) for t in selected):
                problems.append(f"Service/{name}: port {port.get('name')!r} targets {target!r}, which the pods it "
                                f"selects do not expose")

    # HPAs: their targets
    for name, hpa in by_kind.get("HorizontalPodAutoscaler", {}).items():
        ref = (hpa.get("spec") or {}).get("scaleTargetRef") or {}
        target = by_kind.get(ref.get("kind"), {}).get(ref.get("name"))
        if target is None or target.get("apiVersion") != ref.get("apiVersion"):
            problems.append(f"HorizontalPodAutoscaler/{name}: scaleTargetRef {ref} is not a resource here")
            continue
        lo, hi = hpa["spec"].get("minReplicas", 1), hpa["spec"].get("maxReplicas")
        if "replicas" in target["spec"]:
            problems.append(f"HorizontalPodAutoscaler/{name}: {_name(target)} sets replicas, which the HPA owns "
                            f"(applying the resources again would reset its count)")
        if not 1 <= lo <= hi:
            problems.append(f"HorizontalPodAutoscaler/{name}: minReplicas {lo} > maxReplicas {hi}")

    # addresses in container arguments: a Service here, on a port it exposes
    max_replicas = {hpa["spec"]["scaleTargetRef"].get("name"): hpa["spec"].get("maxReplicas")
                    for hpa in by_kind.get("HorizontalPodAutoscaler", {}).values()}
    for where, _, template in templates:
        for c in (template.get("spec") or {}).get("containers") or []:
            for arg in [*(c.get("command") or []), *(c.get("args") or [])]:
                for host, port in re.findall(r"(?:https?|rediss?)://([A-Za-z0-9.-]+):(\d+)", str(arg)):
                    why = _address_problem(host, int(port), services, by_kind.get("StatefulSet", {}), max_replicas)
                    if why:
                        problems.append(f"{where}: container {c.get('name')!r} addresses {host}:{port}: {why}")
    return problems


def _address_problem(host: str, port: int, services: dict, statefulsets: dict, max_replicas: dict) -> str | None:
    """Why `host:port` is not reachable inside these resources: `service` or `pod.service` (a StatefulSet's pod
    under its headless Service)."""
    parts = host.split(".")
    svc = services.get(parts[-1]) if len(parts) <= 2 else None
    if svc is None:
        return f"no Service {parts[-1]!r} here"
    if port not in [p.get("port") for p in svc["spec"].get("ports") or []]:
        return f"Service {svc['metadata']['name']!r} exposes no port {port}"
    if len(parts) == 2:
        owner, _, index = parts[0].rpartition("-")
        sts = statefulsets.get(owner)
        if sts is None or sts["spec"].get("serviceName") != parts[1] or not index.isdigit():
            return f"{parts[0]!r} is no pod of a StatefulSet governed by Service {parts[1]!r}"
        most = max_replicas.get(owner) or sts["spec"].get("replicas", 1)    # the HPA's bound, else its own count
        if int(index) >= most:
            return f"StatefulSet {owner!r} has at most {most} pods"
    return None
