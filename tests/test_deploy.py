"""The serving system as Kubernetes resources (`openinfer deploy`, cluster/kubernetes.py): what deploy/values*.yaml
render to is what deploy/ holds, and it passes the offline check (Kubernetes schemas of two versions, KubeRay's
RayCluster fields, cross references); a broken reference of each kind fails it, naming the resource; values the
engine cannot run are refused by name; the HPA sizes a pool exactly as the autoscaler's policy does; the image
installs extras that exist."""

from __future__ import annotations

import copy
import math
import re
import tomllib
from pathlib import Path

import pytest

from openinfer.cluster import kubernetes as k8s
from openinfer.cluster.autoscale import DECODE, PREFILL, AutoscaleConfig, PoolBounds, PoolSignals, decide
from openinfer.entrypoints.cli import main

REPO = Path(__file__).resolve().parents[1]
RENDERED = {"values.yaml": "openinfer.yaml", "values-ray.yaml": "deepseek-v4-ray.yaml"}


@pytest.fixture(scope="module")
def pd():
    """The prefill/decode example's values and resources."""
    values = k8s.load_values(REPO / "deploy/values.yaml")
    return values, k8s.resources_of(k8s.render(values))


def find(resources, kind: str, name: str) -> dict:
    (res,) = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    return res


@pytest.mark.parametrize("values", list(RENDERED))
def test_deploy_holds_what_its_values_render_to_and_it_checks(values, tmp_path, monkeypatch):
    """`openinfer deploy render` (as the docs run it) writes what deploy/ holds; `openinfer deploy check` passes."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "out.yaml"
    assert main(["deploy", "render", f"deploy/{values}", "-o", str(out)]) == 0
    committed = (REPO / "deploy" / RENDERED[values]).read_text()
    assert out.read_text() == committed, f"deploy/{RENDERED[values]} is stale: render it again (docs/deployment.md)"
    assert main(["deploy", "check", str(out), "--claim", "openinfer-models"]) == 0


def test_every_store_and_pool_kind_renders_valid_resources(pd):
    values, resources = pd
    assert k8s.check(resources, external_claims=(values.model_claim,)) == []
    kinds = sorted(r["kind"] for r in resources)
    assert kinds == sorted(["Deployment", "Service", "Deployment", "Service", "StatefulSet", "Service",
                            "HorizontalPodAutoscaler", "StatefulSet", "Service", "HorizontalPodAutoscaler"])
    volume = k8s.load_values(REPO / "deploy/values.yaml", ["kv_store.kind=volume", "kv_store.size=500Gi"])
    on_volume = k8s.resources_of(k8s.render(volume))
    assert k8s.check(on_volume, external_claims=(values.model_claim,)) == []
    args = find(on_volume, "StatefulSet", "openinfer-decode")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--kv-store-dir") + 1] == "/kv-store"
    ray = k8s.load_values(REPO / "deploy/values-ray.yaml")
    on_ray = k8s.resources_of(k8s.render(ray))
    assert k8s.check(on_ray, external_claims=(ray.model_claim,)) == []
    cluster = find(on_ray, "RayCluster", "deepseek-v4-ep16-0")
    assert cluster["spec"]["workerGroupSpecs"][0]["replicas"] == 1                  # 16 GPUs: head + one node
    assert "--distributed-executor-backend ray" in cluster["spec"]["headGroupSpec"]["template"]["spec"][
        "containers"][0]["args"][0]


def _router(resources):
    return find(resources, "Deployment", "openinfer-router")["spec"]["template"]["spec"]["containers"][0]


def _decode_pod(resources):
    return find(resources, "StatefulSet", "openinfer-decode")["spec"]["template"]["spec"]


def _set_router_arg(resources, old, new):
    args = _router(resources)["args"]
    args[args.index(old)] = new


BROKEN = {
    # the router's Service forwards to a port name its pods do not have
    "service target port": (lambda r: find(r, "Service", "openinfer-router")["spec"]["ports"][0].update(
        targetPort="htp"), "Service/openinfer-router: port 'http' targets 'htp', which the pods it selects do not"),
    # the router addresses a decode instance on a port its Service does not expose
    "router url port": (lambda r: _set_router_arg(r, "http://openinfer-decode-0.openinfer-decode:8000",
                                                  "http://openinfer-decode-0.openinfer-decode:8001"),
                        "container 'router' addresses openinfer-decode-0.openinfer-decode:8001: Service "
                        "'openinfer-decode' exposes no port 8001"),
    # ... or an instance the pool can never have
    "router url beyond max": (lambda r: _set_router_arg(r, "http://openinfer-decode-0.openinfer-decode:8000",
                                                        "http://openinfer-decode-16.openinfer-decode:8000"),
                              "StatefulSet 'openinfer-decode' has at most 16 pods"),
    "store url service": (lambda r: _decode_pod(r)["containers"][0]["args"].__setitem__(
        _decode_pod(r)["containers"][0]["args"].index("redis://openinfer-redis:6379/0"), "redis://redis:6379/0"),
                          "addresses redis:6379: no Service 'redis' here"),
    "probe port": (lambda r: _decode_pod(r)["containers"][0]["readinessProbe"]["httpGet"].update(port="web"),
                   "readinessProbe port 'web' is not one of its ports"),
    "selector": (lambda r: find(r, "Service", "openinfer-decode")["spec"]["selector"].update(
        {"app.kubernetes.io/component": "decoder"}), "Service/openinfer-decode: its selector"),
    "governing service": (lambda r: find(r, "Service", "openinfer-decode")["spec"].pop("clusterIP"),
                          "StatefulSet/openinfer-decode: its Service 'openinfer-decode' must be headless"),
    "hpa target": (lambda r: find(r, "HorizontalPodAutoscaler", "openinfer-decode")["spec"]["scaleTargetRef"].update(
        kind="Deployment"), "HorizontalPodAutoscaler/openinfer-decode: scaleTargetRef"),
    "hpa owns replicas": (lambda r: find(r, "StatefulSet", "openinfer-decode")["spec"].update(replicas=2),
                          "StatefulSet/openinfer-decode sets replicas, which the HPA owns"),
    "volume mount": (lambda r: _decode_pod(r)["containers"][0]["volumeMounts"].append(
        {"name": "scratch", "mountPath": "/scratch"}), "mounts 'scratch', no volume of its pod"),
    "schema type": (lambda r: _decode_pod(r)["containers"][0]["ports"][0].update(containerPort="8000"),
                    "StatefulSet/openinfer-decode: .spec.template.spec.containers[0].ports[0].containerPort: '8000' "
                    "is not of type 'integer'"),
    "schema field": (lambda r: find(r, "Service", "openinfer-router")["spec"].update(selectors={}),
                     "Service/openinfer-router: .spec: Additional properties are not allowed"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_reference_fails_the_check_naming_the_resource(pd, case):
    values, resources = pd
    broken = copy.deepcopy(resources)
    breaks, expected = BROKEN[case]
    breaks(broken)
    problems = k8s.check(broken, external_claims=(values.model_claim,))
    assert any(expected in p for p in problems), problems


def test_the_check_command_fails_on_a_broken_file_and_a_raycluster_field(tmp_path, capsys):
    text = (REPO / "deploy/openinfer.yaml").read_text().replace("targetPort: http}", "targetPort: 8001}", 1)
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    assert main(["deploy", "check", str(path), "--claim", "openinfer-models"]) == 1
    assert "Service/openinfer-router: port 'http' targets 8001" in capsys.readouterr().out
    ray = k8s.resources_of((REPO / "deploy/deepseek-v4-ray.yaml").read_text())
    ray[2]["spec"]["headGroupSpec"]["rayStartParams"] = {"num-gpus": 8}     # KubeRay takes strings only
    problems = k8s.check(ray, external_claims=("openinfer-models",))
    assert any("RayCluster/deepseek-v4-ep16-0: spec.headGroupSpec.rayStartParams.num-gpus: 8 is not of type "
               "'string'" in p for p in problems), problems


@pytest.mark.parametrize("override,message", [
    (["pools.prefill.tensor_parallel_size=2"], "pools.prefill: a prefill instance shares KV through the prefix-KV "
                                               "store, a one-process feature"),
    (["kv_store.kind=none"], "a prefill pool hands its KV to the decode pool through the prefix-KV store"),
    (["pools.decode.replicas=2"], "pools.decode: an autoscaled pool's replicas are the HPA's to set"),
    (["pools.decode.min_replicas=20"], "pools.decode: need 1 <= min_replicas <= max_replicas, got 20, 16"),
    (["pools.decode.gpu=1"], "pools.decode: unknown key(s) ['gpu']"),
    (["name=Open_Infer"], "name must be a DNS label"),
    (["pools={big: {role: both, tensor_parallel_size: 12}}"], "pools.big: an instance over several nodes takes "
                                                              "whole nodes: 12 GPUs"),
])
def test_values_the_engine_cannot_run_are_refused_by_name(override, message):
    with pytest.raises(ValueError) as err:
        k8s.load_values(REPO / "deploy/values.yaml", override)
    assert message in str(err.value)


def test_the_hpa_sizes_a_pool_as_the_autoscaler_policy_does(pd):
    """An HPA asks ceil(sum of a per-pod metric / its per-pod target) replicas (the largest over its metrics),
    within [min, max], at most `value` pods added or removed per period, scale-in no lower than the window's
    highest recommendation (and no change within its 10% tolerance). The rendered targets make that count the
    policy's `decide` for the same demand."""
    values, resources = pd
    policy = AutoscaleConfig(prefill=PoolBounds(1, 8), decode=PoolBounds(1, 16))     # the pools' min and max
    decode = find(resources, "HorizontalPodAutoscaler", "openinfer-decode")["spec"]
    prefill = find(resources, "HorizontalPodAutoscaler", "openinfer-prefill")["spec"]
    assert (decode["minReplicas"], decode["maxReplicas"]) == (1, 16)
    assert decode["behavior"] == {
        "scaleUp": {"stabilizationWindowSeconds": 0, "policies": [{"type": "Pods", "value": 4, "periodSeconds": 60}]},
        "scaleDown": {"stabilizationWindowSeconds": 300,
                      "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]}}

    def target(spec, metric):
        (t,) = [m["pods"]["target"]["averageValue"] for m in spec["metrics"] if m["pods"]["metric"]["name"] == metric]
        return float(t)

    per_pod = target(decode, "openinfer:num_requests_running")
    for running in (1, 30, 44.8, 45, 200, 700, 5000):
        signals = PoolSignals(demand=running, capacity_per_instance=64, quota_use=0.5)
        hpa = min(max(math.ceil(running / per_pod - 1e-9), decode["minReplicas"]), decode["maxReplicas"])
        assert hpa == decide(policy, DECODE, signals, online=hpa).needed
    # decode's busy-fraction metric holds the scale-in back above the policy's quota limit: 0.85 busy on 4 pods
    # asks for ceil(4 * 0.85 / 0.8) = 5 >= 4, whatever fewer requests ask for; the policy blocks that scale-in too
    assert target(decode, "openinfer:engine_busy_fraction") == policy.scale_in_max_quota_use
    assert math.ceil(4 * 0.85 / policy.scale_in_max_quota_use) >= 4
    assert decide(policy, DECODE, PoolSignals(demand=10, capacity_per_instance=64, quota_use=0.85), online=4,
                  recent_targets=[1] * 5).scale_in_blocked
    # prefill: the busy fractions sum to the instances' worth of compute demanded; at the target utilization per
    # pod that is the policy's count for the same demand in instance units
    busy_target = target(prefill, "openinfer:engine_busy_fraction")
    assert busy_target == policy.target_utilization
    for busy_sum in (0.2, 0.7, 0.71, 2.8, 5.0):
        hpa = min(max(math.ceil(busy_sum / busy_target - 1e-9), prefill["minReplicas"]), prefill["maxReplicas"])
        assert hpa == decide(policy, PREFILL, PoolSignals(demand=busy_sum, capacity_per_instance=1.0,
                                                          quota_use=0.5), online=hpa).needed


def test_the_image_installs_extras_that_exist():
    """deploy/Dockerfile is not built here (no container daemon): what can be checked is that it installs the
    package with extras pyproject.toml declares, the ones the resources need."""
    dockerfile = (REPO / "deploy/Dockerfile").read_text()
    (extras,) = re.findall(r'pip install "\.\[([a-z,]+)\]"', dockerfile)
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras.split(",")) == {"ray", "redis"} and set(extras.split(",")) <= set(declared)
    assert "NOT BUILT HERE" in dockerfile
