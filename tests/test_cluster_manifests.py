"""Cluster manifests: KubeRay CRD schema validation, and what a schema cannot check.

Every manifest under ``cluster/kuberay/`` is validated against the KubeRay v1.7.0 CRD schemas kept in
``../shared/schemas/kuberay/`` (each CRD's ``spec.versions[v1].schema.openAPIV3Schema``, JSON Schema
Draft 7). The CRDs allow unknown fields everywhere (the API server prunes them silently), so the test
adds ``additionalProperties: false`` to every object schema that lists ``properties``: a misspelt
field then fails here instead of vanishing on ``kubectl apply``. Broken copies of the manifests,
built in the tests, prove the check bites.

The rest covers what SOURCES.md says plain schema validation cannot catch, plus this project's
contract: Ray versions agree (rayVersion == image tags == pyproject pin), pods run unprivileged as
non-root, requests equal limits, credentials only come from Secrets, the job's config exists and its
placement keys (``data.tokenize.resources``, ``scaling.resources_per_worker``) fit the node groups of
both the KubeRay and the Anyscale cluster, and the pip requirements match pyproject.toml.
"""

from __future__ import annotations

import copy
import json
import math
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from pipelines.config import Config, load_config

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None  # type: ignore[assignment]

REPO = Path(__file__).resolve().parents[1]
CLUSTER_DIR = REPO / "cluster"
KUBERAY_DIR = CLUSTER_DIR / "kuberay"
ANYSCALE_DIR = CLUSTER_DIR / "anyscale"
RAYCLUSTER = KUBERAY_DIR / "raycluster.yaml"
RAYJOB = KUBERAY_DIR / "rayjob.yaml"
RUNTIME_ENV = CLUSTER_DIR / "runtime_env.yaml"
SCHEMA_DIRS = [REPO.parent / "shared" / "schemas" / "kuberay", REPO / "shared" / "schemas" / "kuberay"]
CRD_FILES = {
    "RayCluster": "ray.io_rayclusters.yaml",
    "RayJob": "ray.io_rayjobs.yaml",
    "RayService": "ray.io_rayservices.yaml",
}
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are 1-1.4 MB of YAML
GPU_KEY = "nvidia.com/gpu"
# Env var names that hold credentials: their values must come from a Secret.
SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|ACCESS_KEY|API_KEY|CREDENTIAL|PRIVATE_KEY", re.I)
# A literal credential written next to its name (a `$VAR` reference or a <placeholder> is fine).
LITERAL_SECRET = re.compile(
    r"(SECRET_ACCESS_KEY|SESSION_TOKEN|HF_TOKEN)[\"']?\s*[:=]\s*[\"']?(?![$<{])[A-Za-z0-9/+=_\-]{16,}"
)
AWS_KEY_ID = re.compile(r"\b(AKIA|ASIA)[A-Z0-9]{16}\b")


# --------------------------------------------------------------------------- loading


def load_docs(path: Path) -> list[dict[str, Any]]:
    """All YAML documents of a file, skipping empty ones."""
    with path.open(encoding="utf-8") as f:
        return [d for d in yaml.load_all(f, Loader=_LOADER) if d]


def kuberay_manifests() -> list[tuple[str, dict[str, Any]]]:
    """(``file#index``, document) for every manifest under cluster/kuberay/."""
    out = []
    for path in sorted([*KUBERAY_DIR.rglob("*.yaml"), *KUBERAY_DIR.rglob("*.yml")]):
        for i, doc in enumerate(load_docs(path)):
            out.append((f"{path.relative_to(REPO)}#{i}", doc))
    return out


MANIFESTS = kuberay_manifests()
MANIFEST_IDS = [name for name, _ in MANIFESTS]


def schema_dir() -> Path | None:
    """The KubeRay CRD folder shipped in shared/ (beside the repo in CI), if present."""
    return next((d for d in SCHEMA_DIRS if (d / CRD_FILES["RayJob"]).is_file()), None)


def crd_schema(kind: str) -> dict[str, Any]:
    """``spec.versions[name==v1].schema.openAPIV3Schema`` of the CRD serving ``kind``."""
    folder = schema_dir()
    assert folder is not None
    crd = load_docs(folder / CRD_FILES[kind])[0]
    assert crd["spec"]["names"]["kind"] == kind
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


def strict_schema(schema: Any) -> Any:
    """A copy of ``schema`` where every object that lists ``properties`` forbids other keys.

    Objects marked ``x-kubernetes-preserve-unknown-fields`` keep accepting anything, and objects
    without ``properties`` (free-form maps such as labels or rayStartParams, and the top-level
    ``metadata``, which the CRD leaves as a bare ``type: object``) are left as they are.
    """
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def validators() -> dict[str, tuple[Any, Any]]:
    """kind -> (strict Draft 7 validator, plain Draft 7 validator)."""
    if schema_dir() is None:
        pytest.skip(f"KubeRay CRD schemas not found in {' or '.join(map(str, SCHEMA_DIRS))}")
    out = {}
    for kind in CRD_FILES:
        schema = crd_schema(kind)
        out[kind] = (jsonschema.Draft7Validator(strict_schema(schema)), jsonschema.Draft7Validator(schema))
    return out


def schema_errors(validator: Any, doc: dict[str, Any]) -> list[str]:
    """Readable ``path: message`` lines for every schema violation in ``doc``."""
    return sorted(
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(doc)
    )


# --------------------------------------------------------------------------- walking manifests


def cluster_spec(doc: dict[str, Any]) -> dict[str, Any]:
    """The RayCluster spec of a RayCluster or RayJob manifest."""
    return doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]


def groups_of(spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(name, group spec) for the head group and every worker group."""
    return [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec.get("workerGroupSpecs", [])]


def pod_specs(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, pod spec) for every pod template in a manifest, the RayJob submitter included."""
    if doc["kind"] in ("RayCluster", "RayJob"):
        for name, group in groups_of(cluster_spec(doc)):
            yield f"{doc['kind']} group {name}", group["template"]["spec"]
    if doc["kind"] == "RayJob" and "submitterPodTemplate" in doc["spec"]:
        yield "RayJob submitter", doc["spec"]["submitterPodTemplate"]["spec"]


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """Init and regular containers of a pod spec."""
    return [*pod.get("initContainers", []), *pod["containers"]]


def all_containers(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(where, pod spec, container) for every container of a manifest."""
    for where, pod in pod_specs(doc):
        for c in containers(pod):
            yield f"{where} container {c['name']}", pod, c


def image_tag(image: str) -> str:
    """The tag of an image reference (``rayproject/ray:2.60.0-py311-gpu`` -> ``2.60.0-py311-gpu``)."""
    name = image.rsplit("/", 1)[-1]
    assert ":" in name, f"image {image!r} has no tag: pin one"
    return name.split(":", 1)[1]


_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
           "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18, "m": 1e-3}  # fmt: skip


def parse_quantity(q: str | int | float) -> float:
    """A Kubernetes resource quantity as a number (``64Gi`` -> bytes, ``500m`` -> 0.5)."""
    text = str(q)
    m = re.fullmatch(r"([0-9.]+(?:[eE][-+]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?", text)
    assert m, f"not a Kubernetes quantity: {q!r}"
    return float(m.group(1)) * _SUFFIX.get(m.group(2) or "", 1)


def ray_custom_resources(group: dict[str, Any]) -> dict[str, float]:
    """Custom Ray resources a group advertises, read the way the KubeRay autoscaler reads them.

    KubeRay >= 1.4's group-level ``resources`` map wins; otherwise ``rayStartParams.resources`` must
    follow the KubeRay convention: a JSON object wrapped in one more pair of double quotes.
    """
    standard = {"CPU", "GPU", "TPU", "memory"}
    if group.get("resources"):
        return {k: parse_quantity(v) for k, v in group["resources"].items() if k not in standard}
    raw = group.get("rayStartParams", {}).get("resources")
    if raw is None:
        return {}
    assert raw.startswith('"') and raw.endswith('"'), (
        f"rayStartParams.resources {raw!r}: wrap the JSON in quotes"
    )
    parsed = json.loads(raw[1:-1].replace("\\", ""))
    assert isinstance(parsed, dict) and all(isinstance(v, (int, float)) for v in parsed.values()), raw
    return {k: float(v) for k, v in parsed.items()}


# --------------------------------------------------------------------------- placement model


@dataclass
class NodeGroup:
    """A group of identical Ray nodes and the logical resources each one advertises."""

    name: str
    count: int
    resources: dict[str, float]

    def fits(self, request: dict[str, float]) -> int:
        """How many bundles of ``request`` one node of this group can hold."""
        needs = [(k, v) for k, v in request.items() if v > 0]
        return min((math.floor(self.resources.get(k, 0.0) / v + 1e-9) for k, v in needs), default=0)


def kuberay_node_groups(spec: dict[str, Any]) -> list[NodeGroup]:
    """Ray logical resources per node of a RayCluster spec, as `ray start` would set them."""
    out = []
    for name, group in groups_of(spec):
        params = group.get("rayStartParams", {})
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        res = {"CPU": float(params.get("num-cpus", parse_quantity(limits["cpu"])))}
        res["GPU"] = float(params.get("num-gpus", parse_quantity(limits.get(GPU_KEY, 0))))
        res.update(ray_custom_resources(group))
        count = 1 if name == "head" else int(group.get("replicas", group["minReplicas"]))
        out.append(NodeGroup(name, count, res))
    return out


def anyscale_node_groups(compute: dict[str, Any]) -> list[NodeGroup]:
    """Ray logical resources per node of an Anyscale compute config (fixed-size groups only)."""
    out = [NodeGroup("head", 1, {k: float(v) for k, v in compute["head_node"].get("resources", {}).items()})]
    for g in compute.get("worker_nodes", []):
        assert g["min_nodes"] == g["max_nodes"], f"{g['name']}: the configs are sized for a fixed shape"
        out.append(NodeGroup(g["name"], g["min_nodes"], {k: float(v) for k, v in g["resources"].items()}))
    return out


def placement_problems(cfg: Config, groups: list[NodeGroup]) -> list[str]:
    """Why ``cfg``'s tokenizers and trainers would not land where intended on ``groups`` (empty: fine).

    Tokenizer actors must be pinned by a custom resource that only CPU-only nodes advertise, trainers by
    one that only GPU nodes advertise, and each pool must fit the nodes it is pinned to.
    """
    problems = []
    tok = cfg.data.tokenize
    trainer_request = dict(
        cfg.scaling.resources_per_worker or {"CPU": 1.0, "GPU": float(cfg.scaling.use_gpu)}
    )
    # A mix streams its sources side by side, one tokenizer pool each (pipelines.stream.spec.MixSource).
    streams = len(cfg.data.datasets) if cfg.data.mix_by != "none" else 1
    pools = {
        "tokenizer": ({"CPU": tok.num_cpus, **tok.resources},
                      tok.num_actors * streams if isinstance(tok.num_actors, int) else tok.num_actors),
        "trainer": (trainer_request, cfg.scaling.num_workers),
    }
    hosts: dict[str, set[str]] = {}
    for pool, (request, count) in pools.items():
        if not set(request) - {"CPU", "GPU", "memory"}:
            problems.append(f"{pool}s request no custom resource, so nothing pins them to a node type")
        fitting = [g for g in groups if g.fits(request) > 0]
        hosts[pool] = {g.name for g in fitting}
        if not fitting:
            problems.append(f"no node group can hold one {pool} {request}")
        wants_gpu = pool == "trainer"
        wrong = [g.name for g in fitting if (g.resources.get("GPU", 0) > 0) != wants_gpu]
        if wrong:
            problems.append(f"{pool}s {request} could land on {wrong}")
        capacity = sum(g.count * g.fits(request) for g in fitting)
        if isinstance(count, int) and count > capacity:
            problems.append(f"{count} {pool}s {request} but room for {capacity}")
    if hosts["tokenizer"] & hosts["trainer"]:
        problems.append(f"tokenizers and trainers share node groups {hosts['tokenizer'] & hosts['trainer']}")
    per_worker = cfg.scaling.resources_per_worker or {}
    if per_worker.get("GPU", 0) > 0 and not cfg.scaling.use_gpu:
        problems.append("scaling.resources_per_worker asks for GPUs but scaling.use_gpu is false")
    return problems


# --------------------------------------------------------------------------- project facts


def pyproject() -> dict[str, Any]:
    """pyproject.toml as data."""
    if tomllib is None:
        pytest.skip("tomllib needs Python >= 3.11")
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def pinned_ray_version() -> str:
    """The exact Ray version pinned in pyproject's dependencies (``ray[...]==X``)."""
    for dep in pyproject()["project"]["dependencies"]:
        m = re.fullmatch(r"ray(\[[^\]]*\])?==([0-9][^;\s]*)", dep.replace(" ", ""))
        if m:
            return m.group(2)
    raise AssertionError("pyproject.toml does not pin ray with ==")


def runtime_requirements() -> list[str]:
    """pyproject's dependencies without ray itself: what a Ray image still needs installed."""
    deps = pyproject()["project"]["dependencies"]
    return [d for d in deps if re.match(r"[A-Za-z0-9_.\-]+", d).group(0).lower() != "ray"]


def entrypoint_config(entrypoint: str) -> Path:
    """The file passed as ``--config`` in ``python ray_jobs/sft.py --config X``."""
    argv = shlex.split(entrypoint)
    assert argv[:2] == ["python", "ray_jobs/sft.py"], entrypoint
    assert "--config" in argv, entrypoint
    return REPO / argv[argv.index("--config") + 1]


def configs_for_kuberay_cluster() -> list[Path]:
    """configs/*.yaml whose header comment says it expects cluster/kuberay/raycluster.yaml."""
    out = []
    for path in sorted((REPO / "configs").rglob("*.yaml")):
        header = []
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.startswith("#"):
                break
            header.append(line)
        if "cluster/kuberay/raycluster.yaml" in "\n".join(header):
            out.append(path)
    return out


def only(kind: str, elastic: bool = False) -> dict[str, Any]:
    """The single manifest of ``kind`` under cluster/kuberay/ (``elastic``: of the spot-node run, ``*-elastic.yaml``)."""
    docs = [d for name, d in MANIFESTS if d.get("kind") == kind and ("-elastic." in name) == elastic]
    assert len(docs) == 1, f"expected one {kind} manifest, found {len(docs)}"
    return docs[0]


# --------------------------------------------------------------------------- schema validation


def test_manifests_present() -> None:
    """Both manifests exist, and every document is a ray.io/v1 kind the CRDs describe."""
    assert RAYCLUSTER.is_file() and RAYJOB.is_file()
    kinds = {d.get("kind") for _, d in MANIFESTS}
    assert {"RayCluster", "RayJob"} <= kinds
    for name, doc in MANIFESTS:
        assert doc.get("apiVersion") == "ray.io/v1", name
        assert doc.get("kind") in CRD_FILES, f"{name}: no CRD schema for kind {doc.get('kind')!r}"


@pytest.mark.parametrize("name,doc", MANIFESTS, ids=MANIFEST_IDS)
def test_manifest_matches_crd_schema(validators: dict, name: str, doc: dict[str, Any]) -> None:
    """Each manifest validates against its strict (typo-rejecting) KubeRay v1.7.0 CRD schema."""
    strict, _ = validators[doc["kind"]]
    assert schema_errors(strict, doc) == [], name


@pytest.mark.parametrize("name,doc", MANIFESTS, ids=MANIFEST_IDS)
def test_manifest_metadata_name_is_valid(name: str, doc: dict[str, Any]) -> None:
    """metadata.name is a DNS-1123 label short enough for the Services KubeRay derives from it.

    The CRD leaves metadata unchecked; KubeRay appends suffixes such as ``-head-svc`` (and, for a
    RayJob's cluster, a random suffix) to names that must stay within 63 characters.
    """
    meta_name = doc["metadata"]["name"]
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", meta_name), meta_name
    assert len(meta_name) <= 40, meta_name


def _rename(d: dict[str, Any], old: str, new: str) -> None:
    d[new] = d.pop(old)


def _head(doc: dict[str, Any]) -> dict[str, Any]:
    return cluster_spec(doc)["headGroupSpec"]


# Each breaks one manifest the way a person would, and names what the error must mention.
BREAKAGES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "misspelt cluster field": (lambda d: _rename(cluster_spec(d), "rayVersion", "rayVerison"), "rayVerison"),
    "misspelt container field": (
        lambda d: _rename(_head(d)["template"]["spec"]["containers"][0], "securityContext", "securityContex"),
        "securityContex",
    ),
    "misspelt volume field": (
        lambda d: _rename(_head(d)["template"]["spec"]["volumes"][0]["emptyDir"], "sizeLimit", "sizelimit"),
        "sizelimit",
    ),
    "unquoted rayStartParams number": (
        lambda d: _head(d)["rayStartParams"].__setitem__("num-cpus", 0),
        "is not of type 'string'",
    ),
    "auth mode not in enum": (
        lambda d: cluster_spec(d)["authOptions"].__setitem__("mode", "tokens"),
        "is not one of",
    ),
    "worker group without groupName": (
        lambda d: cluster_spec(d)["workerGroupSpecs"][0].pop("groupName"),
        "'groupName' is a required property",
    ),
}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
@pytest.mark.parametrize("name,doc", MANIFESTS, ids=MANIFEST_IDS)
def test_broken_copy_fails_schema(validators: dict, name: str, doc: dict[str, Any], breakage: str) -> None:
    """A copy of each manifest with one realistic mistake is rejected, naming the mistake."""
    broken = copy.deepcopy(doc)
    mutate, expected = BREAKAGES[breakage]
    mutate(broken)
    errors = schema_errors(validators[doc["kind"]][0], broken)
    assert errors, f"{name} with {breakage} passed validation"
    assert any(expected in e for e in errors), errors


def test_misspelt_rayjob_field_needs_strict_schema(validators: dict) -> None:
    """A misspelt RayJob field passes the CRD as shipped and fails only once objects are closed.

    ``shutdownAfterJobFinish`` (missing the s) would be pruned silently by the API server and the
    cluster would never be deleted: this is why the test closes every object.
    """
    broken = copy.deepcopy(only("RayJob"))
    _rename(broken["spec"], "shutdownAfterJobFinishes", "shutdownAfterJobFinish")
    strict, plain = validators["RayJob"]
    assert schema_errors(plain, broken) == []
    assert any("shutdownAfterJobFinish" in e for e in schema_errors(strict, broken))


def test_strict_schema_keeps_free_form_maps_open(validators: dict) -> None:
    """Closing objects does not close maps: new labels, rayStartParams and metadata keys still pass."""
    doc = copy.deepcopy(only("RayCluster"))
    doc["metadata"]["annotations"] = {"team": "ml"}
    _head(doc)["rayStartParams"]["metrics-export-port"] = "8080"
    _head(doc)["template"]["metadata"]["labels"]["extra"] = "yes"
    assert schema_errors(validators["RayCluster"][0], doc) == []


def test_strict_schema_respects_preserve_unknown_fields() -> None:
    """Objects marked x-kubernetes-preserve-unknown-fields stay open; maps are untouched."""
    schema = {
        "type": "object",
        "properties": {
            "open": {"type": "object", "properties": {"a": {}}, "x-kubernetes-preserve-unknown-fields": True},
            "map": {"type": "object", "additionalProperties": {"type": "string"}},
            "items": {"type": "array", "items": {"type": "object", "properties": {"b": {}}}},
        },
    }
    strict = strict_schema(schema)
    assert strict["additionalProperties"] is False
    assert "additionalProperties" not in strict["properties"]["open"]
    assert strict["properties"]["map"]["additionalProperties"] == {"type": "string"}
    assert strict["properties"]["items"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the input is not modified


# --------------------------------------------------------------------------- versions and images


@pytest.mark.parametrize("name,doc", MANIFESTS, ids=MANIFEST_IDS)
def test_ray_version_matches_images_and_pyproject(name: str, doc: dict[str, Any]) -> None:
    """rayVersion == every image's Ray version == the ray pin in pyproject.toml."""
    version = cluster_spec(doc)["rayVersion"]
    assert version == pinned_ray_version(), name
    for where, _, c in all_containers(doc):
        tag = image_tag(c["image"])
        assert tag == version or tag.startswith(f"{version}-"), f"{where}: {c['image']} is not Ray {version}"


@pytest.mark.parametrize("name,doc", MANIFESTS, ids=MANIFEST_IDS)
def test_images_share_python_and_match_gpu_use(name: str, doc: dict[str, Any]) -> None:
    """All images run one Python version; GPU images exactly where GPUs are requested."""
    pythons = set()
    for where, _, c in all_containers(doc):
        tag = image_tag(c["image"])
        pythons.update(re.findall(r"py3\d+", tag))
        wants_gpu = GPU_KEY in c["resources"].get("limits", {})
        has_gpu_image = bool(re.search(r"-(gpu|cu\d+)", tag))
        assert wants_gpu == has_gpu_image, f"{where}: image {c['image']} with GPU limit {wants_gpu}"
    assert len(pythons) == 1, f"{name}: mixed Python versions {pythons} break pickling between nodes"


# --------------------------------------------------------------------------- pod security and resources


@pytest.mark.parametrize("name,doc", MANIFESTS, ids=MANIFEST_IDS)
def test_pods_unprivileged_and_non_root(name: str, doc: dict[str, Any]) -> None:
    """No host namespaces or hostPath; each container non-root, unprivileged, no escalation, caps dropped.

    ``runAsUser`` must be numeric and non-zero: the Ray images name their user (``ray``), which the
    kubelet cannot verify against ``runAsNonRoot`` on its own.
    """
    checked = 0
    for where, pod in pod_specs(doc):
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            assert not pod.get(key), f"{where}: {key}"
        assert not [v for v in pod.get("volumes", []) if "hostPath" in v], f"{where}: hostPath volume"
        pod_sc = pod.get("securityContext", {})
        for c in containers(pod):
            sc = c.get("securityContext", {})
            effective = {**pod_sc, **sc}
            assert sc.get("privileged") is False, f"{where}/{c['name']}: set privileged: false"
            assert sc.get("allowPrivilegeEscalation") is False, (
                f"{where}/{c['name']}: allowPrivilegeEscalation"
            )
            assert effective.get("runAsNonRoot") is True, f"{where}/{c['name']}: runAsNonRoot"
            assert isinstance(effective.get("runAsUser"), int) and effective["runAsUser"] > 0, where
            assert "ALL" in sc.get("capabilities", {}).get("drop", []), f"{where}/{c['name']}: drop ALL"
            assert not sc.get("capabilities", {}).get("add"), f"{where}/{c['name']}: adds capabilities"
            checked += 1
    assert checked >= (4 if doc["kind"] == "RayJob" else 3)


@pytest.mark.parametrize("name,doc", MANIFESTS, ids=MANIFEST_IDS)
def test_requests_equal_limits(name: str, doc: dict[str, Any]) -> None:
    """Every container sets cpu and memory, with requests equal to limits (Guaranteed QoS)."""
    for where, _, c in all_containers(doc):
        res = c.get("resources", {})
        requests, limits = res.get("requests", {}), res.get("limits", {})
        assert {"cpu", "memory"} <= set(limits), f"{where}: set cpu and memory limits"
        assert {k: parse_quantity(v) for k, v in requests.items()} == {
            k: parse_quantity(v) for k, v in limits.items()
        }, f"{where}: requests {requests} != limits {limits}"


@pytest.mark.parametrize("name,doc", MANIFESTS, ids=MANIFEST_IDS)
def test_gpu_group_tolerates_gpu_taint(name: str, doc: dict[str, Any]) -> None:
    """Groups that request GPUs tolerate the nvidia.com/gpu taint; CPU groups do not (they stay off GPU nodes)."""
    gpu_groups = 0
    for group_name, group in groups_of(cluster_spec(doc)):
        pod = group["template"]["spec"]
        wants_gpu = any(GPU_KEY in c["resources"]["limits"] for c in pod["containers"])
        tolerated = any(t.get("key") == GPU_KEY for t in pod.get("tolerations", []))
        assert wants_gpu == tolerated, f"{name} group {group_name}"
        gpu_groups += wants_gpu
    assert gpu_groups >= 1, f"{name}: no GPU worker group"


@pytest.mark.parametrize("name,doc", MANIFESTS, ids=MANIFEST_IDS)
def test_shm_holds_object_store(name: str, doc: dict[str, Any]) -> None:
    """Each Ray pod mounts a bounded in-memory /dev/shm that fits the object store and fits in the pod.

    Ray's object store and NCCL both live in /dev/shm; a container's default 64 MiB makes Ray fall back
    to disk and NCCL fail. The emptyDir counts against the memory limit, so it must fit under it.
    """
    for group_name, group in groups_of(cluster_spec(doc)):
        pod = group["template"]["spec"]
        c = pod["containers"][0]
        mounts = {m["name"] for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"}
        vols = [v for v in pod.get("volumes", []) if v["name"] in mounts and "emptyDir" in v]
        assert len(vols) == 1, f"{name} group {group_name}: mount an emptyDir at /dev/shm"
        empty_dir = vols[0]["emptyDir"]
        assert empty_dir.get("medium") == "Memory" and "sizeLimit" in empty_dir, f"{name} group {group_name}"
        shm = parse_quantity(empty_dir["sizeLimit"])
        assert shm <= parse_quantity(c["resources"]["limits"]["memory"]), f"{name} group {group_name}"
        store = group.get("rayStartParams", {}).get("object-store-memory")
        if store is not None:
            assert int(store) <= shm, f"{name} group {group_name}: object store {store} > /dev/shm {shm:.0f}"


# --------------------------------------------------------------------------- secrets


@pytest.mark.parametrize("name,doc", MANIFESTS, ids=MANIFEST_IDS)
def test_credentials_only_from_secrets(name: str, doc: dict[str, Any]) -> None:
    """Credential-like env vars come from secretKeyRef; Ray pods get S3 credentials from a Secret."""
    for where, _, c in all_containers(doc):
        for env in c.get("env", []):
            if SECRET_NAME.search(env["name"]):
                assert "value" not in env, f"{where}: {env['name']} has an inline value"
                assert "secretKeyRef" in env.get("valueFrom", {}), f"{where}: {env['name']} not from a Secret"
    for group_name, group in groups_of(cluster_spec(doc)):
        c = group["template"]["spec"]["containers"][0]
        secret_refs = [e["secretRef"]["name"] for e in c.get("envFrom", []) if "secretRef" in e]
        assert secret_refs, f"{name} group {group_name}: no object-store credentials Secret in envFrom"
    if doc["kind"] == "RayJob":
        env_vars = yaml.safe_load(doc["spec"].get("runtimeEnvYAML", "")).get("env_vars", {})
        assert not [k for k in env_vars if SECRET_NAME.search(k)], (
            "runtime env values are shown in the dashboard"
        )


def test_no_literal_credentials_in_cluster_files() -> None:
    """No file under cluster/ (manifests, Anyscale YAML, README) contains a credential value."""
    files = [p for p in CLUSTER_DIR.rglob("*") if p.is_file()]
    assert len(files) >= 5
    for path in files:
        text = path.read_text(encoding="utf-8")
        assert not LITERAL_SECRET.search(text), f"{path}: literal credential"
        assert not AWS_KEY_ID.search(text), f"{path}: AWS access key id"
        assert not re.search(r"AWS_SECRET_ACCESS_KEY\s*\n?\s*value:", text), f"{path}: inline AWS secret"


def test_literal_credential_detector_bites(tmp_path: Path) -> None:
    """The credential patterns catch a pasted key and let `$VAR` references through."""
    pasted = "AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    assert LITERAL_SECRET.search(pasted)
    assert AWS_KEY_ID.search("id: AKIAIOSFODNN7EXAMPLE")
    assert not LITERAL_SECRET.search('--from-literal=AWS_SECRET_ACCESS_KEY="$AWS_SECRET_ACCESS_KEY"')


# --------------------------------------------------------------------------- the job itself


def test_rayjob_runs_the_raycluster() -> None:
    """The RayJob creates exactly the cluster of raycluster.yaml (one shape to keep in mind)."""
    assert only("RayJob")["spec"]["rayClusterSpec"] == only("RayCluster")["spec"]


def test_rayjob_lifecycle_and_runtime_env() -> None:
    """The job tears its cluster down, ships code from a remote zip and installs pyproject's deps.

    In K8sJobMode the submitter pod has no copy of the repo, so ``working_dir`` must be a remote
    ``.zip`` URI; the pip list must match pyproject.toml (minus ray, which the image provides).
    """
    spec = only("RayJob")["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert isinstance(spec["ttlSecondsAfterFinished"], int) and spec["ttlSecondsAfterFinished"] > 0
    assert spec.get("submissionMode", "K8sJobMode") == "K8sJobMode"
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert re.fullmatch(r"(https|s3|gs)://\S+\.zip", runtime_env["working_dir"]), runtime_env["working_dir"]
    assert runtime_env["pip"] == runtime_requirements()


def test_token_auth_on_and_submitter_authenticates() -> None:
    """Ray token auth is on, and the RayJob's submitter sends the token from the cluster's Secret.

    With ``authOptions.secretName`` the token lives in one known Secret (key ``auth_token``) rather
    than in one generated per cluster, so the submitter can reference it by name.
    """
    job = only("RayJob")
    auth = job["spec"]["rayClusterSpec"]["authOptions"]
    assert auth["mode"] == "token"
    (submitter,) = job["spec"]["submitterPodTemplate"]["spec"]["containers"]
    env = {e["name"]: e for e in submitter.get("env", [])}
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == (auth["secretName"], "auth_token")


def test_runtime_env_file_matches_pyproject() -> None:
    """cluster/runtime_env.yaml (for `ray job submit`) installs exactly pyproject's non-ray deps."""
    runtime_env = yaml.safe_load(RUNTIME_ENV.read_text(encoding="utf-8"))
    assert runtime_env["pip"] == runtime_requirements()
    assert "working_dir" not in runtime_env, "pass --working-dir on the command line instead"
    assert not [k for k in runtime_env.get("env_vars", {}) if SECRET_NAME.search(k)]


def test_entrypoint_config_exists_and_loads() -> None:
    """The RayJob's ``--config`` file is in configs/ and passes pipelines.config validation."""
    path = entrypoint_config(only("RayJob")["spec"]["entrypoint"])
    assert path.is_file(), path
    assert path.resolve().is_relative_to((REPO / "configs").resolve())
    load_config(path)


def test_entrypoint_script_exists() -> None:
    """The script the entrypoint runs is in the repository."""
    script = REPO / shlex.split(only("RayJob")["spec"]["entrypoint"])[1]
    if not script.exists():
        pytest.skip(f"{script.relative_to(REPO)} is not in the tree yet (written under the training issue)")
    assert script.is_file()


def test_configs_fit_kuberay_cluster() -> None:
    """Each config written for raycluster.yaml pins tokenizers to CPU nodes and trainers to GPU nodes."""
    paths = configs_for_kuberay_cluster()
    job_config = entrypoint_config(only("RayJob")["spec"]["entrypoint"])
    assert job_config in paths, f"{job_config} should say in its header that it expects raycluster.yaml"
    groups = kuberay_node_groups(only("RayCluster")["spec"])
    for path in paths:
        assert placement_problems(load_config(path), groups) == [], path


def test_placement_check_catches_misplacement() -> None:
    """The placement check flags unpinned tokenizers, a GPU node advertising cpu_node and too many trainers."""
    cfg = load_config(entrypoint_config(only("RayJob")["spec"]["entrypoint"]))
    groups = kuberay_node_groups(only("RayCluster")["spec"])
    unpinned = cfg.model_copy(deep=True)
    unpinned.data.tokenize.resources = {}
    assert any("tokenizers request no custom resource" in p for p in placement_problems(unpinned, groups))
    leaky = copy.deepcopy(groups)
    next(g for g in leaky if g.resources["GPU"] > 0).resources["cpu_node"] = 8.0
    assert any("tokenizers" in p and "could land on" in p for p in placement_problems(cfg, leaky))
    greedy = cfg.model_copy(deep=True)
    greedy.scaling.num_workers = 9
    assert any("9 trainers" in p for p in placement_problems(greedy, groups))
    mixed = cfg.model_copy(deep=True)  # two mixed sources: two pools of num_actors each
    mixed.data.datasets = [mixed.data.datasets[0], mixed.data.datasets[0].model_copy(update={"weight": 0.5, "name": "again"})]
    assert placement_problems(cfg, groups) == []
    assert any(f"{2 * cfg.data.tokenize.num_actors} tokenizers" in p for p in placement_problems(mixed, groups))


def test_rayjob_custom_resources_parse() -> None:
    """The rayStartParams custom resources parse the way the autoscaler reads them."""
    spec = only("RayCluster")["spec"]
    advertised = {name: ray_custom_resources(group) for name, group in groups_of(spec)}
    assert advertised["head"] == {}
    assert any("cpu_node" in r for r in advertised.values())
    assert any("gpu_node" in r for r in advertised.values())


# --------------------------------------------------------------------------- Anyscale


def anyscale_job() -> dict[str, Any]:
    return yaml.safe_load((ANYSCALE_DIR / "job.yaml").read_text(encoding="utf-8"))


def anyscale_compute() -> dict[str, Any]:
    return yaml.safe_load((ANYSCALE_DIR / "compute.yaml").read_text(encoding="utf-8"))


def test_anyscale_job_matches_rayjob() -> None:
    """The Anyscale job runs the same entrypoint, Ray version and requirements as the RayJob."""
    job, rayjob = anyscale_job(), only("RayJob")
    assert job["entrypoint"] == rayjob["spec"]["entrypoint"]
    assert job["requirements"] == runtime_requirements()
    tag = image_tag(job["image_uri"])
    assert tag.startswith(f"{pinned_ray_version()}-"), job["image_uri"]
    kuberay_pythons = {p for _, _, c in all_containers(rayjob) for p in re.findall(r"py3\d+", c["image"])}
    assert set(re.findall(r"py3\d+", tag)) == kuberay_pythons
    assert not [k for k in job.get("env_vars", {}) if SECRET_NAME.search(k)]
    assert job["working_dir"] == "."


def test_configs_fit_anyscale_compute() -> None:
    """The job's config places tokenizers and trainers correctly on the Anyscale compute config too."""
    compute = anyscale_compute()
    groups = anyscale_node_groups(compute)
    assert groups[0].resources.get("CPU") == 0, "keep tasks and actors off the head node"
    cfg = load_config(entrypoint_config(anyscale_job()["entrypoint"]))
    assert placement_problems(cfg, groups) == []


def test_anyscale_sdk_accepts_configs() -> None:
    """Anyscale's own models accept job.yaml and compute.yaml, and reject a misspelt field.

    Needs the `anyscale` package (not a project dependency): skipped without it.
    """
    job_models = pytest.importorskip("anyscale.job.models")
    compute_models = pytest.importorskip("anyscale.compute_config.models")
    job_models.JobConfig.from_yaml(str(ANYSCALE_DIR / "job.yaml"))
    compute_models.ComputeConfig.from_yaml(str(ANYSCALE_DIR / "compute.yaml"))
    broken = anyscale_job()
    _rename(broken, "entrypoint", "entrypoints")
    with pytest.raises(TypeError, match="entrypoints"):
        job_models.JobConfig.from_dict(broken)


# --------------------------------------------------------------------------- the elastic run on spot nodes


def _gpu_group(spec: dict[str, Any]) -> dict[str, Any]:
    (group,) = [g for _, g in groups_of(spec) if GPU_KEY in containers(g["template"]["spec"])[0]["resources"]["limits"]]
    return group


def test_elastic_rayjob_scales_its_spot_gpu_group_over_the_configs_worker_range() -> None:
    """The elastic RayJob autoscales a spot GPU group whose replicas hold exactly ``scaling.num_workers``'
    [min, max] trainers, and its config restarts without limit and checkpoints by the clock too."""
    job = only("RayJob", elastic=True)
    spec = job["spec"]["rayClusterSpec"]
    cfg = load_config(entrypoint_config(job["spec"]["entrypoint"]))
    assert spec["enableInTreeAutoscaling"] is True and cfg.scaling.elastic
    assert cfg.run.max_failures == -1 and cfg.train.checkpoint_every_minutes
    assert cfg.train.global_batch_size is not None and cfg.train.global_batch_size >= cfg.scaling.max_workers
    gpu = _gpu_group(spec)
    per_node = NodeGroup("gpu", 1, {"CPU": float(gpu["rayStartParams"]["num-cpus"]),
                                    "GPU": parse_quantity(containers(gpu["template"]["spec"])[0]["resources"]
                                                          ["limits"][GPU_KEY]), **ray_custom_resources(gpu)})
    trainers = per_node.fits(cfg.scaling.resources_per_worker)
    assert (gpu["minReplicas"] * trainers, gpu["maxReplicas"] * trainers) == cfg.scaling.num_workers
    assert gpu["template"]["spec"]["nodeSelector"], "the GPU group is pinned to spot nodes"
    shape = kuberay_node_groups(spec)  # with the GPU group at its max: the tokenizers still fit their nodes
    for g in shape:
        if g.name == "gpu-train":
            g.count = gpu["maxReplicas"]
    assert placement_problems(cfg, shape) == []


def test_elastic_gpu_pods_turn_their_termination_into_a_preemption_drain() -> None:
    """A reclaimed GPU pod drains its Ray node (reason preemption, with a deadline) before it goes, and
    gets the grace period to let the trainers checkpoint; the other pods have no such hook."""
    spec = only("RayJob", elastic=True)["spec"]["rayClusterSpec"]
    pod = _gpu_group(spec)["template"]["spec"]
    command = " ".join(containers(pod)[0]["lifecycle"]["preStop"]["exec"]["command"])
    assert "ray drain-node" in command and "--reason DRAIN_NODE_REASON_PREEMPTION" in command
    deadline = int(re.search(r"--deadline-remaining-seconds (\d+)", command).group(1))
    sleep = int(re.search(r"sleep (\d+)", command).group(1))
    assert sleep < deadline <= pod["terminationGracePeriodSeconds"], (sleep, deadline)
    for name, group in groups_of(spec):
        if group is not _gpu_group(spec):
            assert "lifecycle" not in containers(group["template"]["spec"])[0], name


def test_elastic_anyscale_compute_prefers_spot_gpus_over_the_worker_range() -> None:
    compute = yaml.safe_load((ANYSCALE_DIR / "compute-elastic.yaml").read_text(encoding="utf-8"))
    job = yaml.safe_load((ANYSCALE_DIR / "job-elastic.yaml").read_text(encoding="utf-8"))
    cfg = load_config(entrypoint_config(job["entrypoint"]))
    assert job["entrypoint"] == only("RayJob", elastic=True)["spec"]["entrypoint"]
    assert {k: v for k, v in job.items() if k not in ("name", "entrypoint", "compute_config")} == {
        k: v for k, v in anyscale_job().items() if k not in ("name", "entrypoint", "compute_config")}
    (gpu,) = [g for g in compute["worker_nodes"] if g["resources"].get("GPU")]
    assert gpu["market_type"] == "PREFER_SPOT"
    trainers = NodeGroup("gpu", 1, {k: float(v) for k, v in gpu["resources"].items()}).fits(
        cfg.scaling.resources_per_worker)
    assert (gpu["min_nodes"] * trainers, gpu["max_nodes"] * trainers) == cfg.scaling.num_workers
    assert all(g.get("market_type") == "ON_DEMAND" for g in compute["worker_nodes"] if g is not gpu)
