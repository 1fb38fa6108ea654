"""Run configuration: YAML -> validated pydantic models.

Every key is checked before any cluster work starts: an unknown key, a wrong type or an
impossible value raises :class:`ConfigError` naming the dotted key and the file.

Example::

    cfg = load_config("configs/default.yaml", overrides=["data.sequence_len=512"])
    cfg.data.sequence_len   # 512

Names follow axolotl's where one exists (``sequence_len``, ``train_on_inputs``, dataset
``type`` names) so its users feel at home.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file and the dotted key."""


class _Strict(BaseModel):
    """Every key used or rejected: unknown keys are errors, and a removed key's error says what to use instead."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    _removed: ClassVar[dict[str, str]] = {}  # removed key -> what to use instead

    @model_validator(mode="before")
    @classmethod
    def _no_removed_keys(cls, values: Any) -> Any:
        if isinstance(values, dict):
            for key, instead in cls._removed.items():
                if key in values:
                    raise ValueError(f"{key} was removed: {instead}")
        return values


# --------------------------------------------------------------------------- model


class ModelInit(_Strict):
    """A small randomly initialised model described inline (demo runs and tests)."""

    architecture: Literal["llama", "qwen2"] = Field("llama", description="transformers architecture: LlamaConfig or Qwen2Config.")
    hidden_size: int = Field(128, gt=0, description="Model width.")
    intermediate_size: int = Field(256, gt=0, description="MLP width.")
    num_hidden_layers: int = Field(2, gt=0, description="Decoder layers.")
    num_attention_heads: int = Field(4, gt=0, description="Attention heads (must divide hidden_size).")
    num_key_value_heads: int | None = Field(None, gt=0, description="KV heads for grouped-query attention; None: as many as attention heads.")
    max_position_embeddings: int = Field(2048, gt=0, description="Longest position the model supports (>= data.sequence_len).")
    tie_word_embeddings: bool = Field(False, description="Share input and output embeddings.")
    seed: int = Field(0, description="Seed of the random initialisation.")

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelInit:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        kv = self.num_key_value_heads or self.num_attention_heads
        if self.num_attention_heads % kv:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
        return self


class AdapterConfig(_Strict):
    """Parameter-efficient fine-tuning with peft: LoRA on a trainable copy, or QLoRA on a 4-bit base.

    Example (the LoRA of axolotl/TRL defaults)::

        adapter: {type: lora, r: 16, alpha: 32, dropout: 0.05, target_modules: all-linear}

    With ``type: none`` (full fine-tuning) the other keys do not apply and setting any of them is an
    error rather than silently ignored.
    """

    type: Literal["none", "lora", "qlora"] = Field(
        "none", description="none: train every weight; lora: peft LoRA adapters on a frozen base; "
        "qlora: LoRA on a 4-bit (bitsandbytes NF4) base, GPU only."
    )
    r: int | None = Field(None, gt=0, description="LoRA rank; 16 when unset with lora/qlora.")
    alpha: float | None = Field(None, gt=0, description="LoRA alpha (the update is scaled by alpha / r); 2 * r when unset.")
    dropout: float | None = Field(None, ge=0, lt=1, description="Dropout on the LoRA input; 0.05 when unset.")
    target_modules: str | list[str] | None = Field(
        None, description="Modules that get adapters, as in peft: all-linear (every linear layer but the "
        "output head; the default), a list of module names (q_proj, v_proj, ...) or a regex over full names."
    )

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list):
            if not v or any(not t.strip() for t in v):
                raise ValueError("give at least one non-empty module name, or all-linear")
        elif v is not None and not v.strip():
            raise ValueError("empty; use all-linear, a list of module names or a regex")
        return v

    @model_validator(mode="after")
    def _defaults_or_reject(self) -> AdapterConfig:
        """type none: the LoRA keys do not apply, so setting one is an error; lora/qlora: fill defaults.

        Unset keys stay None under none, so a dumped config (``model_dump``) re-validates unchanged.
        """
        keys = ("r", "alpha", "dropout", "target_modules")
        if self.type == "none":
            extra = [k for k in keys if getattr(self, k) is not None]
            if extra:
                raise ValueError(f"{', '.join('model.adapter.' + k for k in extra)} set but model.adapter.type is none (full fine-tuning); "
                                 "set type: lora or qlora, or remove them")
            return self
        defaults = {"r": 16, "dropout": 0.05, "target_modules": "all-linear"}
        for k, v in defaults.items():
            if getattr(self, k) is None:
                object.__setattr__(self, k, v)  # no re-validation loop (validate_assignment)
        if self.alpha is None:
            object.__setattr__(self, "alpha", 2.0 * self.r)
        return self

    @property
    def enabled(self) -> bool:
        return self.type != "none"


class ModelConfig(_Strict):
    """Which causal LM to train and which tokenizer feeds it."""

    name_or_path: str | None = Field(None, description="HF model id or local directory.")
    tokenizer: str | None = Field(None, description="HF tokenizer id or local directory; defaults to name_or_path.")
    init: ModelInit | None = Field(None, description="Inline architecture for a randomly initialised model.")
    trust_remote_code: bool = Field(False, description="Run code shipped with the model/tokenizer. Off unless set.")
    attn_implementation: Literal["auto", "flash_attention_2", "sdpa", "eager"] = Field(
        "auto", description="auto: flash_attention_2 (varlen, padding-free) on GPU when installed, else sdpa."
    )
    adapter: AdapterConfig = Field(default_factory=AdapterConfig, description="LoRA / QLoRA adapters (peft).")

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if self.tokenizer is None and self.name_or_path is None:
            raise ValueError("set model.tokenizer or model.name_or_path")
        return self

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.name_or_path  # type: ignore[return-value]


# --------------------------------------------------------------------------- data

DatasetFormat = Literal["auto", "jsonl", "json", "parquet", "mds"]
DatasetType = Literal["completion", "alpaca", "chat_template", "input_output"]


# DatasetConfig keys that only the chat_template type reads.
CHAT_KEYS = frozenset({"messages_field", "role_key", "content_key", "role_map", "train_turns", "train_reasoning",
                       "train_tool_calls", "chat_template_kwargs", "ignore_fields"})


class DatasetConfig(_Strict):
    """One source of samples and how to turn its records into text and labels."""

    path: str = Field(..., description="File, directory, glob or URL (s3://, gs://). Relative to the config file or cwd.")
    name: str | None = Field(
        None, description="What names this source in the data position and across resumes (run.on_data_change: "
        "continue matches sources by it); default: path as written. Unique within data.datasets."
    )
    format: DatasetFormat = Field("auto", description="auto: from the file extension (or index.json for mds).")
    type: DatasetType = Field("alpaca", description="How a record becomes prompt/response text.")
    weight: float = Field(1.0, gt=0, description="Mixing weight: share of tokens (data.mix_by) from this source.")
    # Field mapping where the data's column names differ.
    text_field: str = Field("text", description="completion: the text column.")
    instruction_field: str = Field("instruction", description="alpaca: the instruction column.")
    input_field: str = Field("input", description="alpaca: the optional input column.")
    output_field: str = Field("output", description="alpaca: the response column.")
    history_field: str | None = Field(
        "history", description="alpaca: optional list of [user, assistant] prior turns (LIMA style)."
    )
    messages_field: str | None = Field(
        None, description="chat_template: the conversation column; None tries 'messages' then 'conversations'."
    )
    role_key: str | None = Field(None, description="chat_template: role key in a turn; None: 'role' or 'from'.")
    content_key: str | None = Field(None, description="chat_template: content key; None: 'content' or 'value'.")
    role_map: dict[str, str] = Field(
        default_factory=lambda: {
            "human": "user",
            "user": "user",
            "gpt": "assistant",
            "assistant": "assistant",
            "system": "system",
            "function_call": "tool_call",
            "observation": "tool",
            "tool": "tool",
        },
        description="chat_template: source role names (ShareGPT's human/gpt/...) to roles. tool_call: an assistant turn "
        "whose value is a JSON call {name, arguments} (ShareGPT function_call); tool: a tool result.",
    )
    train_turns: Literal["all", "last"] = Field(
        "all", description="chat_template: which assistant turns train; a message's own train: true|false (or weight: "
        "1|0) overrides. Tool results, user and system turns train only under data.train_on_inputs."
    )
    train_reasoning: bool = Field(True, description="chat_template: train the reasoning (reasoning_content, thinking, "
                                  "<think>) of trained assistant turns.")
    train_tool_calls: bool = Field(True, description="chat_template: train the tool calls of trained assistant turns.")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="chat_template: extra template variables, e.g. {enable_thinking: false}."
    )
    ignore_fields: list[str] = Field(
        default_factory=list, description="chat_template: record columns to ignore (metadata such as id, source); any "
        "other column the format does not know is a bad record."
    )
    segments_field: str = Field("segments", description="input_output: list of {text, label} segments.")

    _removed: ClassVar[dict[str, str]] = {
        "roles_to_train": "assistant turns train (train_turns: all | last, or a message's own train: true|false); "
                          "user, system and tool turns train only under data.train_on_inputs"}

    @model_validator(mode="after")
    def _chat_keys_for_chat(self) -> DatasetConfig:
        if self.type != "chat_template":  # set to other than its default (a dumped config holds every key)
            fields = type(self).model_fields
            set_here = sorted(k for k in CHAT_KEYS if getattr(self, k) != fields[k].get_default(call_default_factory=True))
            if set_here:
                raise ValueError(f"{', '.join(set_here)} apply to type chat_template only (this dataset is {self.type})")
        return self

    @field_validator("path")
    @classmethod
    def _non_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("path is empty")
        return v


class TokenizeConfig(_Strict):
    """The CPU stage that formats and tokenizes samples: where it runs, how many at once, how big its calls."""

    num_actors: int | Literal["auto"] = Field(
        "auto", description="Tokenizer actors; auto: one per CPU left after reads (at least 1)."
    )
    batch_size: int = Field(
        512, gt=0, description="Samples per tokenizer call; the stage formats and labels the next slice while one encodes."
    )
    num_cpus: float = Field(1.0, gt=0, description="CPUs reserved per tokenizer actor.")
    threads: int | Literal["auto"] = Field(
        "auto", description="Rust tokenizer threads per actor (RAYON_NUM_THREADS); auto: the CPUs per actor "
        "of the pool at its largest, e.g. 2 on a 2-CPU machine (1 actor), 1 on a 16-CPU node (15 actors)."
    )
    resources: dict[str, float] = Field(
        default_factory=dict, description="Extra Ray resources per actor, e.g. {cpu_node: 1} to pin to CPU nodes. "
        "A mix of N sources runs N pools at once, so the nodes must hold N x num_actors (auto: N) of them."
    )
    placement: Literal["auto", "actors", "read_tasks"] = Field(
        "auto", description="Where the tokenizer runs. actors: a pool of num_actors, each num_cpus and resources; "
        "read_tasks: inside the read tasks (no actor to start, blocks never cross the object store), each "
        "then reserving num_cpus and resources instead of read_num_cpus, up to num_actors at once; a file group is "
        "tokenized by its one task. auto: read_tasks where the pool would hold one actor at most and resources is "
        "empty (a lone actor adds a process and an object-store hop, and no parallelism), actors otherwise. "
        "convert.py --tokenize: read_tasks (each task also writes its own part) where auto finds at least as many "
        "files as write tasks, actors otherwise."
    )

    @field_validator("num_actors", "threads")
    @classmethod
    def _positive(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("must be >= 1 or 'auto'")
        return v


class DataConfig(_Strict):
    """What to read, how to format and tokenize it, and how to pack it."""

    sequence_len: int = Field(2048, gt=1, description="Tokens per packed row (the model's context).")
    packing: Literal["none", "concat", "bfd"] = Field(
        "bfd", description="none: a row per sample; concat: join docs with EOS and cut (pretraining); "
        "bfd: best-fit-decreasing bins, samples never split (SFT)."
    )
    pack_buffer_size: int = Field(10000, gt=0, description="Samples held for one best-fit-decreasing packing pass.")
    oversize: Literal["truncate", "drop"] = Field(
        "truncate", description="Samples longer than sequence_len (bfd/none): truncate or drop; counted either way."
    )
    train_on_inputs: bool = Field(False, description="false: only response / assistant tokens carry labels.")
    add_eos: bool = Field(True, description="Append EOS to completion and alpaca samples.")
    shuffle_seed: int = Field(42, description="Seeds file order and the shuffle of packed rows.")
    on_bad_record: Literal["raise", "skip"] = Field(
        "raise", description="raise: stop with file and row; skip: count and report."
    )
    eval_fraction: float = Field(0.0, ge=0, lt=1, description="Held-out share of samples for split='eval'.")
    datasets: list[DatasetConfig] = Field(..., min_length=1, description="Training sources.")
    eval_datasets: list[DatasetConfig] = Field(default_factory=list, description="Evaluation sources.")
    tokenize: TokenizeConfig = Field(
        default_factory=TokenizeConfig,
        description="The tokenizer stage: an actor pool or inside the read tasks (unused when every source is pre-tokenized MDS).",
    )
    read_num_cpus: float = Field(0.25, gt=0, description="CPUs reserved per read task (small so actors never starve reads; read tasks "
                                 "that tokenize reserve data.tokenize.num_cpus instead).")
    read_tasks: int = Field(8, gt=0, description="Read tasks (each owns a contiguous group of whole files); fewer "
                            "where the read tasks tokenize or check ids themselves (see read_concurrency).")
    read_concurrency: int | Literal["auto"] | None = Field(
        "auto", description="Read tasks running at once; auto: one per tokenizer actor of the pool at its largest (1 "
        "on a 2-CPU machine: each read task beside another takes a worker process on the tokenizer's cores), one per CPU of the cluster when every "
        "source is pre-tokenized MDS. Where the read tasks tokenize (data.tokenize.placement) or check ids, auto "
        "also makes no more read tasks than run at once (one round), and for pre-tokenized MDS no more than one per "
        "128 MB of uncompressed shards; null: as many as the CPUs allow (Ray's default). Training reads a "
        "pre-tokenized source in its feeder, with no read tasks; these apply to build_dataset and eval streams."
    )
    mix_by: Literal["tokens", "samples", "none"] = Field(
        "tokens", description="Several datasets: keep each one's share of tokens (or samples) at its weight; "
        "none: one stream over all files, weights ignored."
    )
    mix_exhausted: Literal["stop", "cycle", "drop"] = Field(
        "drop", description="A mixed source runs out: stop the epoch, cycle it (upsample), or drop it and go on."
    )
    deterministic: bool = Field(
        True, description="Keep the stream in read order (needed for exact mid-epoch resume); false trades that for throughput."
    )

    @field_validator("read_concurrency")
    @classmethod
    def _positive(cls, v: int | str | None) -> int | str | None:
        if isinstance(v, int) and v < 1:
            raise ValueError("must be >= 1, 'auto' or null")
        return v

    @model_validator(mode="after")
    def _eval_sources(self) -> DataConfig:
        if self.eval_datasets and self.eval_fraction:
            raise ValueError("set either eval_datasets or eval_fraction, not both")
        keys = [d.name or d.path for d in self.datasets]
        if dupes := sorted({k for k in keys if keys.count(k) > 1}):
            raise ValueError(f"datasets: {', '.join(map(repr, dupes))} names more than one entry; give each a "
                             "distinct name (it names the source in the data position and across resumes)")
        return self


# --------------------------------------------------------------------------- training


class TrainConfig(_Strict):
    """The optimisation loop run by each Ray Train worker."""

    _removed: ClassVar[dict[str, str]] = {
        "local_shuffle_buffer_size": "every rank trains on its slice of one deterministic stream (exactly once, "
                                     "resumable), which is shuffled by data.shuffle_seed (the file order each epoch "
                                     "and the rows of each packing unit); a larger data.pack_buffer_size shuffles "
                                     "over more samples"}

    micro_batch_size: int = Field(1, gt=0, description="Packed rows per worker per forward pass.")
    gradient_accumulation_steps: int = Field(1, gt=0, description="Micro-batches per optimizer step on each worker, "
                                             "at the largest world size (scaling.num_workers, or its max); leave it "
                                             "at 1 with global_batch_size.")
    global_batch_size: int | None = Field(
        None, gt=0, description="Packed rows per optimizer step over all workers, the same at every world size: each "
        "worker takes its share (the first global_batch_size % workers ranks one row more) and accumulates "
        "ceil(share / micro_batch_size) micro-batches. None: micro_batch_size x gradient_accumulation_steps x "
        "scaling.num_workers (its max when elastic). Set it to keep the batch when resuming with another "
        "scaling.num_workers.")
    max_steps: int | None = Field(None, gt=0, description="Optimizer steps; overrides epochs for the LR schedule.")
    epochs: int = Field(1, gt=0, description="Passes over the stream (an epoch ends when the stream is exhausted).")
    learning_rate: float = Field(2e-5, gt=0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_beta1: float = Field(0.9, gt=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.95, gt=0, lt=1, description="AdamW beta2.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    lr_scheduler: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warmup (see docs/training.md for how it is sized).")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final LR as a share of learning_rate.")
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping; 0 turns it off.")
    deepspeed: str | dict[str, Any] = Field(
        "zero2", description="zero0..zero3 (configs/deepspeed/*.json), a JSON path, or an inline dict."
    )
    bf16: bool = Field(True, description="bf16 mixed precision through DeepSpeed.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    seed: int = Field(0, description="Seed of torch on every worker.")
    log_every_steps: int = Field(10, gt=0, description="One log line (and metrics.jsonl record) per this many steps.")
    checkpoint_every_steps: int | None = Field(None, gt=0, description="Checkpoint (model, optimizer, data position) every this many steps; the run always ends on one.")
    checkpoint_every_minutes: float | None = Field(
        None, gt=0, description="Also checkpoint when this many minutes passed since the last checkpoint (at the next "
        "step). A preemption notice (a Ray node drain) always checkpoints at the next step.")
    eval_every_steps: int | None = Field(None, gt=0, description="Evaluate on the eval split every this many steps.")
    eval_max_batches: int | None = Field(None, gt=0, description="Cap on eval micro-batches per rank.")
    prefetch_batches: int = Field(2, ge=0, description="Eval batches each worker prefetches from its eval shard (the "
                                  "training rows come from the feeder, which prefetches whole steps).")
    export_merged: bool = Field(
        False, description="With model.adapter: also export the base with the adapter merged in "
        "(<run dir>/model, a plain Hugging Face model) next to the adapter (<run dir>/adapter)."
    )


class ScalingConfig(_Strict):
    """How many Ray Train workers and what each gets (ray.train.ScalingConfig)."""

    num_workers: int | tuple[int, int] = Field(
        1, description="Ray Train workers (ranks): a number, or [min, max] for an elastic run that shrinks to the "
        "workers it can place when a node is lost (no fewer than min) and grows back when resources return "
        "(docs/training.md, 'Elastic runs').")
    resize_check_s: float = Field(
        60.0, gt=0, description="Elastic runs: how often Ray Train checks whether more workers can be placed "
        "(ScalingConfig.elastic_resize_monitor_interval_s); growing restarts the group from the last checkpoint.")
    min_workers_timeout_s: float = Field(
        600.0, gt=0, description="Elastic runs: how long the run may be without a running worker group before it "
        "fails with an error naming what is missing. The clock runs from a lost worker or node on, through every "
        "start the restart tries: Ray refreshes its view of the cluster every 20 s, so after a node loss the first "
        "try may ask for the old size and wait RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S (Ray's default 60 s) before "
        "it tries with fewer.")
    use_gpu: bool = Field(False, description="One GPU per worker, NCCL; else CPU workers with gloo.")
    resources_per_worker: dict[str, float] | None = Field(
        None, description="e.g. {CPU: 8, GPU: 1, gpu_node: 1} to pin trainers to GPU nodes."
    )

    @field_validator("num_workers", mode="before")
    @classmethod
    def _min_max(cls, v: Any) -> Any:
        if isinstance(v, list):
            v = tuple(v)
        if isinstance(v, tuple) and len(v) == 2 and v[0] == v[1]:
            v = v[0]
        return v

    @field_validator("num_workers")
    @classmethod
    def _positive(cls, v: int | tuple[int, int]) -> int | tuple[int, int]:
        lo, hi = (v, v) if isinstance(v, int) else v
        if lo < 1 or hi < lo:
            raise ValueError(f"{list(v) if isinstance(v, tuple) else v}: a number >= 1, or [min, max] with 1 <= min <= max")
        return v

    @property
    def elastic(self) -> bool:
        return isinstance(self.num_workers, tuple)

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if isinstance(self.num_workers, tuple) else self.num_workers

    @property
    def max_workers(self) -> int:
        return self.num_workers[1] if isinstance(self.num_workers, tuple) else self.num_workers


class WandbConfig(_Strict):
    """Weights & Biases (run.loggers: [wandb]); the API key comes from WANDB_API_KEY or `wandb login`, never from here."""

    project: str = Field("pipelines", min_length=1, description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (team or user); None: WANDB_ENTITY or your default.")
    group: str | None = Field(None, description="W&B run group.")
    tags: list[str] = Field(default_factory=list, description="W&B run tags.")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="None: WANDB_MODE, else online. offline writes the run under <run dir>/wandb (wandb sync).")


class MlflowConfig(_Strict):
    """MLflow (run.loggers: [mlflow]); credentials come from MLFLOW_TRACKING_TOKEN/_USERNAME/_PASSWORD, never from here."""

    tracking_uri: str | None = Field(
        None, description="None: MLFLOW_TRACKING_URI, else MLflow's default. A file: URI uses MLflow's file store.")
    experiment: str = Field("pipelines", min_length=1, description="MLflow experiment (created if missing).")


class RunConfig(_Strict):
    """Where a run writes and how it restarts."""

    name: str = Field("run", min_length=1, description="Run directory name under storage_path.")
    storage_path: str = Field("runs", description="Local directory or s3:// URL for checkpoints and outputs.")
    resume: str = Field("auto", description="auto | never | <checkpoint path>.")
    keep_checkpoints: int = Field(2, gt=0, description="Checkpoints kept in the run directory (CheckpointConfig.num_to_keep).")
    checkpoint_upload: Literal["sync", "async"] = Field(
        "sync", description="sync: every rank waits until its part is copied to the run directory. async: a checkpoint "
        "is written locally and training goes on while Ray Train copies it (registered when every rank's copy is "
        "done), so a step does not wait for object storage; a fault soon after a checkpoint may then resume from the "
        "one before (a checkpoint is only resumed from when complete). Use async for large checkpoints on s3://.")
    max_failures: int = Field(0, ge=-1, description="Ray Train FailureConfig.max_failures (-1: forever).")
    export_model: bool = Field(True, description="Write a Hugging Face model + tokenizer at the end.")
    progress_bars: bool = Field(
        False, description="Ray Data progress bars (and its 'Starting execution' lines) of the training stream (in the "
        "feeder) and eval split; off: one log line per log step instead."
    )
    ray_log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "WARNING", description="Ray Train's console log level (ray.train.LoggingConfig.log_level), also applied in each "
        "worker to Ray's per-report 'Reporting training result ... TrainingReport(...)' lines (INFO, every rank); "
        "INFO or DEBUG to see them."
    )
    loggers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["tensorboard"], description="Experiment trackers rank 0 logs every metrics.jsonl "
        "record to (scalars <kind>/<key>) and the run config to: tensorboard (<run dir>/tensorboard), wandb "
        "(pip install 'pipelines[wandb]'), mlflow (pip install 'pipelines[mlflow]'). One that fails warns once "
        "and is off for the rest of the run; training goes on.")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases settings.")
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig, description="MLflow settings.")
    on_data_change: Literal["fail", "restart", "continue"] = Field(
        "fail", description="Resuming after the row stream changed (data, tokenizer, sequence_len, packing, seed, "
        "mixing): fail names the change before training; restart keeps the weights and restarts the data at the "
        "start of the current epoch; continue, for datasets added, removed or reweighted (mix_by tokens or "
        "samples), keeps every unchanged source's exactly-once position, starts a new one at its beginning and "
        "applies the new weights from the resume step. Restarts and changes are logged and marked in the ledger.")

    @field_validator("loggers")
    @classmethod
    def _loggers_once(cls, v: list[str]) -> list[str]:
        twice = sorted({x for x in v if v.count(x) > 1})
        if twice:
            raise ValueError(f"names {twice} more than once")
        return v


class StorageConfig(_Strict):
    """Object-storage settings. Credentials come from the standard AWS/GCS environment, never from here."""

    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (else AWS_ENDPOINT_URL).")
    region: str | None = Field(None, description="S3 region (else AWS_REGION / AWS_DEFAULT_REGION).")
    retries: int = Field(5, ge=0, description="Retries with backoff for transient object-store errors.")


class Config(_Strict):
    """A whole run: model, data, training, scaling, run directory and storage."""

    model: ModelConfig = Field(..., description="The model and tokenizer.")
    data: DataConfig = Field(..., description="Sources, formats, tokenization, packing.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="The optimisation loop.")
    scaling: ScalingConfig = Field(default_factory=ScalingConfig, description="Workers and their resources.")
    run: RunConfig = Field(default_factory=RunConfig, description="Run directory, resume, failures.")
    storage: StorageConfig = Field(default_factory=StorageConfig, description="Object-store endpoint and retries.")
    # Directory that relative local paths are resolved against (the config file's folder).
    base_dir: str = Field(default_factory=os.getcwd, exclude=True, description="Internal: the config file's folder.")
    source: str | None = Field(None, exclude=True, description="Internal: the config file path.")

    @model_validator(mode="after")
    def _export_merged_needs_adapter(self) -> Config:
        if self.train.export_merged and not self.model.adapter.enabled:
            raise ValueError("train.export_merged: needs model.adapter.type lora or qlora "
                             "(without an adapter the exported model is already the full model)")
        if self.train.export_merged and not self.run.export_model:
            raise ValueError("train.export_merged: needs run.export_model=true")
        return self

    @model_validator(mode="after")
    def _elastic_restarts(self) -> Config:
        if self.scaling.elastic and self.run.max_failures == 0:
            raise ValueError("scaling.num_workers: an elastic run restarts its worker group when a worker or node is "
                             "lost, and run.max_failures=0 forbids any restart; set run.max_failures (e.g. -1: no "
                             "limit, or 10)")
        return self

    @model_validator(mode="after")
    def _one_global_batch(self) -> Config:
        t = self.train
        if t.global_batch_size is None:
            return self
        if t.gradient_accumulation_steps != 1:
            raise ValueError("train.global_batch_size: set it or train.gradient_accumulation_steps, not both (with "
                             "global_batch_size each worker's accumulation follows from its share of the rows)")
        if t.global_batch_size < self.scaling.max_workers:
            raise ValueError(f"train.global_batch_size: {t.global_batch_size} rows per step cannot give each of "
                             f"{self.scaling.max_workers} workers (scaling.num_workers) a row; set at least "
                             f"{self.scaling.max_workers}")
        return self


# --------------------------------------------------------------------------- loading


def _parse_scalar(text: str) -> Any:
    """Parse an override value the way YAML would (``512`` -> int, ``[a, b]`` -> list)."""
    return yaml.safe_load(text) if text != "" else ""


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to a nested dict; list items by index (``data.datasets.0.path=x``)."""
    out = copy.deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, _, value = item.partition("=")
        parts = key.strip().split(".")
        node: Any = out
        for i, part in enumerate(parts[:-1]):
            if isinstance(node, list):
                node = node[_list_index(node, part, parts[: i + 1])]
                continue
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            node = nxt
        last = parts[-1]
        if isinstance(node, list):
            node[_list_index(node, last, parts)] = _parse_scalar(value)
        else:
            node[last] = _parse_scalar(value)
    return out


def _list_index(node: list, part: str, path: list[str]) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"override key {'.'.join(path)!r}: no list item {part!r}")
    return int(part)


def _format_errors(err: ValidationError, where: str) -> str:
    lines = [f"invalid config {where}:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"  {key}: {msg}")
    return "\n".join(lines)


def config_from_dict(raw: dict[str, Any], source: str | None = None, base_dir: str | None = None) -> Config:
    """Validate a plain dict as a :class:`Config`; errors name the key (and ``source``)."""
    where = f"in {source}" if source else "(inline)"
    if not isinstance(raw, dict):
        raise ConfigError(f"invalid config {where}: the top level must be a mapping, got {type(raw).__name__}")
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, where)) from None
    cfg.base_dir = base_dir or os.getcwd()
    cfg.source = source
    return cfg


def load_config(path: str | os.PathLike[str], overrides: list[str] | None = None) -> Config:
    """Load a YAML config (safely) and apply dotted ``key=value`` overrides."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config {p} is not valid YAML: {err}") from None
    raw = apply_overrides(raw, overrides or [])
    return config_from_dict(raw, source=str(p), base_dir=str(p.resolve().parent))


def dump_config(cfg: Config) -> dict[str, Any]:
    """The config as plain data (for saving into the run directory)."""
    return cfg.model_dump(mode="json")
