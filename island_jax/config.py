"""The configuration schema of a run, and its validation.

This module is where the schema is documented: every key, with its meaning,
units and default, is in `default_config` (one helper per section) and, for an
island's entry, in `island`. A run is described by one
`ml_collections.ConfigDict`, nested by concern:

  seed        seeds parameter initialisation and data order.
  model       decoder-only transformer shapes and dtypes (`_model`).
  moe         Mixture-of-Experts feed-forward layers (Switch Transformer, arXiv
              2101.03961; ST-MoE router z-loss, arXiv 2202.08906) (`_moe`).
  islands     a ConfigDict keyed by island name, so `--config.islands.b.batch_size=8`
              works; each entry is made by `island(...)`, whose arguments
              document its keys. Empty by default: experiment configs add islands.
  inner       AdamW inner optimizer, warm-up + cosine schedule over all inner
              steps, gradient clipping (`_inner`).
  outer       the DiLoCo outer loop (arXiv 2311.08105), round planning
              (island_jax/planning.py), quorum, and Streaming DiLoCo fragments
              (arXiv 2501.18512) (`_outer`).
  codec       the pseudo-gradient wire format (island_jax/outer/codec.py) (`_codec`).
  data        the corpus (bytes of text files, or a prepared dataset of token records) and its held-out split
              (island_jax/data.py) (`_data`).
  eval        held-out evaluation between rounds (`_eval`).
  comm        the gRPC exchange between islands and the coordinator, and the
              emulated WAN link of every island (island_jax/comm/link.py) (`_comm`).
  checkpoint  orbax checkpoints of every role (island_jax/checkpoint.py) (`_checkpoint`).
  distributed the `jax.distributed` job of an island of several processes: its
              timeouts (island_jax/distributed.py, docs/cluster.md) (`_distributed`).
  metrics     where every role's records go besides metrics.jsonl: TensorBoard,
              Weights & Biases, another tracker (island_jax/metrics.py) (`_metrics`).

`validate(config)` checks everything that can be checked before JAX compiles
anything and raises `ConfigError` naming the field and the fix.
"""

from __future__ import annotations

import json

import ml_collections

from island_jax.hardware import CATALOG

# The values two fields may take. They live here, not beside the code that implements them (island_jax/model/moe.py
# and island_jax/outer/codec.py import them from here), so that reading and checking a config imports no JAX
# (the launcher does only that).
DISPATCH = ("capacity", "dropless")  # `moe.dispatch` (island_jax/model/moe.py)
CODEC_KINDS = ("none", "bf16", "int8", "int4", "topk")  # `codec.kind`, every codec (island_jax/outer/codec.py)

SYNC = ("steps", "auto", "time")  # values of outer.sync (island_jax/planning.py)
AUTO_FROM = ("catalog", "measured")  # values of outer.auto_from
WEIGHTINGS = ("tokens", "uniform")  # values of outer.weighting
MIB = 1 << 20
MAX_CHUNK_BYTES = 64 * MIB  # far below protobuf's 2 GiB message ceiling
MAX_CONNECTIONS = 256
KEEPALIVE_SECONDS = 10.0  # default of comm.keepalive_seconds (island_jax/comm/grpc_server.py), seconds
RECONNECT_BACKOFF_CAP_SECONDS = 8.0  # default of comm.reconnect_backoff_cap_seconds (island_jax/comm/grpc_client.py)
DTYPES = ("float32", "bfloat16")  # values of model.param_dtype and model.compute_dtype
# Values of model.remat: "none" keeps every activation, "full" recomputes each block's from its input, and the
# others are `jax.checkpoint_policies` of those names (what a block keeps; the rest is recomputed)
POSITIONS = ("learned", "rope")  # values of model.positions
REMAT = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable", "everything_saveable",
         "nothing_saveable")
BYTE_SYMBOLS = 256  # symbols of the byte-level data (island_jax/data.py): model.vocab_size must hold them all


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""

    def __str__(self) -> str:
        return f"ConfigError: {super().__str__()}"


def island(
    num_devices: int,
    data: int,
    expert: int,
    batch_size: int,
    inner_steps: int,
    hardware: str = "cpu",
    crash_at_round: int = 0,
    simulated_speed: float = 1.0,
    num_processes: int = 1,
    devices_per_process: int = 0,
    fsdp: int = 1,
    memory_gb: float = 0.0,
    dataset: str = "",
) -> ml_collections.ConfigDict:
    """One island's entry for `config.islands` (keys as the arguments; `data`, `fsdp` and `expert` under `mesh`).

    Args:
      num_devices: devices in the island's mesh; must equal data x fsdp x expert.
      data: size of the `data` mesh axis (splits the batch; parameters replicated over it).
      expert: size of the `expert` mesh axis (expert parallelism; also splits
        the batch outside MoE layers).
      batch_size: sequences per inner step for the whole island, a multiple of
        num_devices.
      inner_steps: H, inner AdamW steps per round (with `outer.sync = "time"`,
        the expected steps per round, which sets the learning-rate schedule's length).
      hardware: hardware kind of the island's devices, a name in the catalog of
        island_jax/hardware.py (e.g. "cpu", "h100").
      crash_at_round: fault injection for tests of launchers and recovery: the
        island's process fails at the start of this round (1-based; 0 = never).
      simulated_speed: s in (0, 1]; on one machine, makes the island s times as
        fast by sleeping (1/s - 1) x its recent median step time after each step.
      num_processes: the island's processes (hosts): one `jax.distributed` job whose mesh spans them all
        (docs/cluster.md).
      devices_per_process: the devices of each of those processes; 0 (the default) is num_devices /
        num_processes, and a value set must make num_devices = num_processes x devices_per_process.
      fsdp: size of the `fsdp` mesh axis: splits the batch, and shards parameters, gradients, AdamW moments
        and anchor on their `embed` dimension (docs/island.md); 1 replicates them.
      memory_gb: memory per device in GB for the budget checked before compiling (`island.memory`); 0 (the
        default) takes the catalog's figure for `hardware`, and a catalog figure of 0 (cpu) means unknown: no check.
      dataset: the island's own training data, the field `data`: "" (its share of `data.prepared`'s training
        records, or of the byte corpus), a prepared dataset's folder, or a mixture "PATH,WEIGHT;PATH,WEIGHT"
        (`data.parse_mixture`); needs `data.prepared`, whose tokenizer it must share.
    """
    return ml_collections.ConfigDict(
        dict(
            num_devices=num_devices,
            mesh=dict(data=data, fsdp=fsdp, expert=expert),
            batch_size=batch_size,
            inner_steps=inner_steps,
            hardware=hardware,
            crash_at_round=crash_at_round,
            simulated_speed=simulated_speed,
            num_processes=num_processes,
            devices_per_process=devices_per_process,
            memory_gb=float(memory_gb),
            data=dataset,
        )
    )


def default_config() -> ml_collections.ConfigDict:
    """Defaults for every field; experiment configs start from this and add islands."""
    c = ml_collections.ConfigDict()
    c.seed = 0  # seeds parameter initialisation (on the CPU backend) and the data order
    c.model = _model()
    c.moe = _moe()
    c.islands = ml_collections.ConfigDict()  # name -> island(...); none by default
    c.inner = _inner()
    c.outer = _outer()
    c.codec = _codec()
    c.data = _data()
    c.eval = _eval()
    c.comm = _comm()
    c.checkpoint = _checkpoint()
    c.distributed = _distributed()
    c.metrics = _metrics()
    return c


def _metrics() -> dict:
    """`metrics`: the trackers every role writes its records to (island_jax/metrics.py)."""
    return dict(
        # comma-separated: jsonl (always; the run's own record), tensorboard, wandb, or MODULE:CLASS of another
        writers="jsonl,tensorboard",
        # a log line with the step time every this many seconds of a round's inner steps (a shorter round logs
        # none); 0: none
        progress_seconds=30.0,
        wandb=dict(  # with "wandb" in writers (pip install island_jax[wandb])
            project="island_jax",  # the W&B project of the run's runs (one per role, grouped by the workdir's name)
            entity="",  # the W&B entity (team or user); "": the account's default
            mode="",  # online | offline | disabled; "": WANDB_MODE, else online
        ),
    )


def _distributed() -> dict:
    """`distributed`: the `jax.distributed` job of an island of several processes (island_jax/distributed.py)."""
    return dict(
        initialization_timeout_seconds=300,  # how long process 0 waits for the others to come up, s
        heartbeat_timeout_seconds=30,  # a process whose heartbeats stop this long counts as dead; its peers end, s
        shutdown_timeout_seconds=30,  # how long a process that ends waits for its peers at shutdown, s
    )


def _model() -> dict:
    """`model`: the decoder-only byte-level transformer (island_jax/model/transformer.py)."""
    return dict(
        vocab_size=256,  # tokens in the vocabulary; 256 = byte-level
        seq_len=128,  # tokens (bytes) per sequence
        num_layers=4,  # transformer blocks
        d_model=128,  # residual stream width D
        num_heads=4,  # attention heads; must divide d_model
        param_dtype="float32",  # dtype the parameters are stored in: float32 | bfloat16 (routers stay float32)
        compute_dtype="float32",  # dtype of activations and matmuls: float32 | bfloat16
        mlp_hidden_dim=512,  # SwiGLU width of the dense feed-forward layers between MoE layers
        remat="none",  # rematerialization per block (jax.checkpoint policy): none | full | dots_saveable | ...
        positions="learned",  # learned: a position embedding of seq_len rows; rope: rotary (RoFORMER) in attention
        rope_theta=10_000.0,  # with positions=rope: the base of the rotary frequencies
    )


def _moe() -> dict:
    """`moe`: the Mixture-of-Experts feed-forward layers (island_jax/model/moe.py)."""
    return dict(
        num_experts=4,  # E routed experts per MoE layer; a multiple of every island's mesh.expert
        num_experts_per_token=2,  # top-k, in 1..num_experts
        expert_hidden_dim=256,  # SwiGLU hidden width per expert
        capacity_factor=1.0,  # slots per expert = ceil(cf * tokens_per_shard * k / E); <= 0: nothing dropped
        renormalize=True,  # rescale the top-k router weights to sum to 1
        load_balancing_loss_coef=0.01,  # weight of the load-balancing loss in the training loss (Switch eq. 4)
        router_z_loss_coef=1e-3,  # weight of the router z-loss in the training loss (ST-MoE eq. 5)
        dispatch="capacity",  # capacity buckets + all_to_all; "dropless": ragged_dot (+ ragged_all_to_all off CPU)
        jitter_noise=0.0,  # eps of U(1 - eps, 1 + eps) on the router input while training (Switch: 0.01)
        num_shared_experts=0,  # experts every token passes through (DeepSeekMoE)
        routing_bias_update_rate=0.0,  # gamma of auxiliary-loss-free balancing (DeepSeek-V3: 0.001); 0 = off
        every_n_layers=1,  # an MoE layer in every n-th block, dense SwiGLU in the others
    )


def _inner() -> dict:
    """`inner`: each island's AdamW, warm-up then cosine decay over its inner steps of the whole run."""
    return dict(
        learning_rate=3e-3,  # peak AdamW learning rate
        warmup_steps=50,  # of each island's inner steps, counted over all rounds
        min_learning_rate_ratio=0.1,  # cosine decays to peak * ratio
        b1=0.9,  # AdamW first-moment decay
        b2=0.95,  # AdamW second-moment decay
        eps=1e-8,  # AdamW denominator epsilon
        weight_decay=0.1,  # decoupled weight decay, on matrices only (rank >= 2)
        grad_clip_norm=1.0,  # clip gradients to this global L2 norm
    )


def _outer() -> dict:
    """`outer`: the DiLoCo outer loop, round planning, quorum and Streaming DiLoCo."""
    return dict(
        enabled=True,  # False: one island trains alone with no outer loop (the data-parallel baseline)
        rounds=20,  # outer steps (rounds) of the run
        learning_rate=0.7,  # outer SGD learning rate (DiLoCo default)
        momentum=0.9,  # outer SGD momentum (DiLoCo default)
        nesterov=True,  # Nesterov momentum for the outer SGD
        momentum_warmup_rounds=0,  # the momentum ramps linearly from 0 over this many rounds (Pier; 0: none)
        # how the merge weighs the round's contributions: "tokens" (each island's share of the round's tokens,
        # Decoupled DiLoCo) or "uniform" (1/K for each of the K contributors, DiLoCo's plain average)
        weighting="tokens",
        sync="steps",  # steps: each island's inner_steps; auto: scaled by devices x catalog peak; time: round_seconds
        reference_island="",  # with sync=auto, the island whose inner_steps is kept ("" = the first)
        auto_from="catalog",  # with sync=auto: "catalog" peaks, or "measured" step times of round 0
        round_seconds=10.0,  # with sync=time: wall-clock seconds of training per round
        min_islands=0,  # quorum: merge once this many islands contributed and grace_seconds passed (0 = all)
        grace_seconds=60.0,  # seconds a reached quorum waits for the remaining islands
        # seconds a round that cannot close (its quorum not reached) waits for missing islands after its first
        # contribution, for a dead island to be restarted and rejoin; then the coordinator fails, naming them
        rejoin_timeout_seconds=600.0,
        # Streaming DiLoCo (arXiv 2501.18512): fragments synced on a staggered schedule, overlapped with compute.
        fragments=1,  # F groups of whole leaves, each synced once per round at its own offset (1: plain DiLoCo)
        # tau: inner steps an island keeps training before applying a fragment's update (0: wait for it);
        # "auto": from the measured exchange and step times, so the exchange hides behind compute.
        overlap_steps=ml_collections.FieldReference(0, field_type=object),
        mix_alpha=0.5,  # with tau >= 1: local <- alpha x local + (1 - alpha) x global for the updated fragment
    )


def _codec() -> dict:
    """`codec`: how pseudo-gradients and updates are encoded for the wire."""
    return dict(
        kind="int8",  # int8 | int4 (blockwise absmax) | bf16 | none (float32) | topk (SparseLoCo)
        block_size=256,  # elements per float32 scale of int8 / int4
        error_feedback=False,  # islands add what the codec lost last round before encoding (always on for topk)
        error_feedback_decay=1.0,  # beta: islands add beta x what was lost (SparseLoCo, arXiv 2508.15706: 0.95)
        # the codec of the update the coordinator sends back: any kind; "" = codec.kind. Whatever it loses stays in
        # the coordinator's master - view drift and is sent in a later round.
        update_kind="",
        topk_group=4096,  # topk: elements per group, each with one float32 scale
        topk_k=64,  # topk: values kept per group (those of largest magnitude)
    )


def _data() -> dict:
    """`data`: the text corpus, split by file into held-out and per-island training bytes."""
    return dict(
        files="",  # glob of text files; "" = the running interpreter's stdlib *.py
        # a prepared dataset's folder (experiments/prepare_data.py, docs/data.md): its token records are the
        # training data instead of data.files' bytes, its eval split the held-out set; "" = bytes
        prepared="",
        eval_fraction=0.02,  # share of files held out for evaluation, in (0, 1)
    )


def _eval() -> dict:
    """`eval`: held-out loss of the global parameters."""
    return dict(
        every_rounds=5,  # evaluate after every this many rounds (and after the last)
        # the held-out set: this many windows of the held-out files (all of them if fewer), drawn by eval.seed alone
        # (data.eval_windows), so that every config scoring the same corpus and seq_len scores the same windows
        num_windows=2048,
        seed=0,  # draws the held-out set; not the run's seed, so that runs of every seed score one set
        batch_size=32,  # windows per evaluation batch (the last one padded); a multiple of every island's num_devices
    )


def _comm() -> dict:
    """`comm`: the exchange between islands and the coordinator, and the emulated WAN link."""
    return dict(
        chunk_bytes=MIB,  # largest chunk of a streamed payload, bytes (gRPC's default message limit is 4 MiB)
        join_timeout_seconds=300.0,  # how long an island waits for the coordinator to answer its join
        round_timeout_seconds=3600.0,  # how long an island waits for a round's update, seconds
        # how long an island that lost the coordinator keeps reconnecting (capped exponential backoff), seconds
        reconnect_seconds=300.0,
        # the longest pause between two reconnect attempts, seconds: they come 0.5, 1, 2, 4, ... s apart up to it
        reconnect_backoff_cap_seconds=RECONNECT_BACKOFF_CAP_SECONDS,
        # seconds between the keepalive pings of an island's idle gRPC channels, which the coordinator's server
        # admits (down to half that); they keep an idle connection open through NATs and notice a dead peer.
        # gRPC pings an idle connection at most once a second, so a value below 1 acts as 1
        keepalive_seconds=KEEPALIVE_SECONDS,
        connections=16,  # parallel gRPC channels per island; one TCP connection carries about window / RTT
        pipeline=True,  # merge, step and send the update back chunk by chunk while contributions arrive
        tls=dict(  # TLS on the exchange port (docs/security.md); paths of PEM files, never their contents
            cert_file="",  # the coordinator's certificate chain ("" with key_file "": no TLS)
            key_file="",  # the coordinator's private key
            ca_file="",  # the CA islands verify the coordinator with (and, with client certificates, the reverse)
            client_cert_file="",  # an island's certificate, for mutual TLS ("": none)
            client_key_file="",  # an island's private key, for mutual TLS
            server_name="",  # the name islands check the coordinator's certificate for ("": the host dialled)
            require_client_cert=False,  # the coordinator accepts only islands with a certificate of ca_file (mTLS)
        ),
        auth=dict(  # per-island bearer tokens (docs/security.md); only where to read them, never a token
            token_file="",  # an island's token, read from this file
            token_env="",  # or from this environment variable
            tokens_file="",  # the coordinator's table of island names and token hashes ("": no tokens)
        ),
        link=dict(  # the emulated WAN path between each island and the coordinator (island_jax/comm/link.py)
            bandwidth_gbps=0.0,  # emulated WAN rate of each island's link, Gbit/s each way (0: not emulated)
            latency_ms=0.0,  # one-way latency, ms (RTT = 2x)
            window_bytes=0,  # bytes in flight per connection (a TCP window; 0: unlimited)
        ),
    )


def _checkpoint() -> dict:
    """`checkpoint`: orbax checkpoints of every role, in its folder of the workdir."""
    return dict(
        every_rounds=10,  # save after every this many rounds (and after the last)
        # coordinator-only interval (0: every_rounds); a coordinator restart redoes at most this + 2 rounds
        coordinator_every_rounds=0,
        # newest checkpoints kept per role; islands keep more when a coordinator restart may need an older one
        max_to_keep=2,
    )


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(
    config: ml_collections.ConfigDict, num_available_devices: int | None = None, island: str | None = None
) -> None:
    """Checks a run's config before anything compiles.

    Args:
      config: the run's config (see `default_config` and `island` for the schema).
      num_available_devices: devices this process can use; when given, the
        islands' total `num_devices` (or, with `island`, that island's) must
        not exceed it.
      island: the island this process runs, when it runs only one; it must be
        a key of `config.islands`.

    Raises:
      ConfigError: naming the first invalid field and what to do about it.
    """
    _require(len(config.islands) > 0, "islands is empty; add at least one island with island_jax.config.island(...)")
    _check_model(config.model)
    _check_moe(config.moe, config.model)
    _check_codec(config.codec)
    _check_outer(config.outer, config.islands)
    _check_comm(config.comm)
    _check_checkpoint(config.checkpoint)
    _check_eval(config.eval)
    _check_data(config)
    for key in ("initialization_timeout_seconds", "heartbeat_timeout_seconds", "shutdown_timeout_seconds"):
        _require(config.distributed[key] >= 1, f"distributed.{key} is {config.distributed[key]}; use at least 1 s")
    if "metrics" in config:  # a config saved before the section existed has none
        _check_metrics(config.metrics)
    for name, isl in config.islands.items():
        _check_island(config, name, isl)
    _check_devices(config, num_available_devices, island)


def _check_model(m: ml_collections.ConfigDict) -> None:
    for name in ("vocab_size", "seq_len", "num_layers", "d_model", "num_heads"):
        _require(m[name] > 0, f"model.{name} is {m[name]}; it must be a positive integer")
    _require(
        m.d_model % m.num_heads == 0,
        f"model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}; pick num_heads dividing d_model",
    )
    for name in ("param_dtype", "compute_dtype"):
        _require(m[name] in DTYPES, f"model.{name} is {m[name]!r}; choose one of {DTYPES}")
    _require(m.mlp_hidden_dim > 0, f"model.mlp_hidden_dim is {m.mlp_hidden_dim}; it must be positive")
    _require(m.remat in REMAT, f"model.remat is {m.remat!r}; choose one of {REMAT}")
    _require(m.positions in POSITIONS, f"model.positions is {m.positions!r}; choose one of {POSITIONS}")
    if m.positions == "rope":
        _require(m.rope_theta > 1, f"model.rope_theta is {m.rope_theta}; use a base above 1 (10000 is usual)")
        _require(
            (m.d_model // m.num_heads) % 2 == 0,
            f"model.positions is rope but the heads' width d_model / num_heads = {m.d_model // m.num_heads} is odd; "
            "rotary positions rotate pairs of dimensions: pick num_heads so that the width is even",
        )


def _check_moe(moe: ml_collections.ConfigDict, m: ml_collections.ConfigDict) -> None:
    _require(moe.num_experts > 0, f"moe.num_experts is {moe.num_experts}; it must be positive")
    _require(
        1 <= moe.num_experts_per_token <= moe.num_experts,
        f"moe.num_experts_per_token (top-k) is {moe.num_experts_per_token} but moe.num_experts is "
        f"{moe.num_experts}; top-k must lie in 1..num_experts",
    )
    _require(moe.expert_hidden_dim > 0, f"moe.expert_hidden_dim is {moe.expert_hidden_dim}; it must be positive")
    _require(moe.dispatch in DISPATCH, f"moe.dispatch is {moe.dispatch!r}; choose one of {DISPATCH}")
    _require(0.0 <= moe.jitter_noise < 1.0, f"moe.jitter_noise is {moe.jitter_noise}; use 0 (off) or a value in (0, 1)")
    _require(moe.num_shared_experts >= 0, f"moe.num_shared_experts is {moe.num_shared_experts}; use 0 or more")
    _require(
        moe.routing_bias_update_rate >= 0,
        f"moe.routing_bias_update_rate is {moe.routing_bias_update_rate}; use 0 (off) or a positive rate such as 0.001",
    )
    _require(
        1 <= moe.every_n_layers <= m.num_layers,
        f"moe.every_n_layers is {moe.every_n_layers} but model.num_layers is {m.num_layers}; use 1..num_layers "
        "so that at least one block has an MoE layer",
    )


def _check_codec(codec: ml_collections.ConfigDict) -> None:
    _require(codec.kind in CODEC_KINDS, f"codec.kind is {codec.kind!r}, an unknown codec; choose one of {CODEC_KINDS}")
    _require(
        codec.update_kind in ("", *CODEC_KINDS),
        f"codec.update_kind is {codec.update_kind!r}, an unknown codec; choose one of {CODEC_KINDS} "
        "(or \"\" for codec.kind's)",
    )
    _require(
        codec.block_size > 0,
        f"codec.block_size is {codec.block_size}; it must be a positive number of elements (e.g. 256)",
    )
    units = sorted(codec.topk_group if kind == "topk" else codec.block_size for kind in (codec.kind, update_kind(codec)))
    _require(
        units[1] % units[0] == 0,
        f"codec.topk_group is {codec.topk_group} and codec.block_size {codec.block_size}: with codec.kind "
        f"{codec.kind!r} and codec.update_kind {update_kind(codec)!r}, one must be a multiple of the other (the "
        "coordinator holds both codecs' whole groups and blocks in rows of their least common multiple)",
    )
    _require(
        0.0 < codec.error_feedback_decay <= 1.0,
        f"codec.error_feedback_decay is {codec.error_feedback_decay}; give beta in (0, 1] (1: carry all that was lost)",
    )
    _require(
        1 <= codec.topk_k <= codec.topk_group,
        f"codec.topk_group is {codec.topk_group} and codec.topk_k {codec.topk_k}; keep 1 <= topk_k <= topk_group "
        "(SparseLoCo keeps 64 of every 4096)",
    )


def update_kind(codec: ml_collections.ConfigDict) -> str:
    """The update's codec kind of a config's `codec` section: `codec.update_kind`, or `codec.kind` when it is ""."""
    return codec.get("update_kind", "") or codec.kind


def error_feedback(codec: ml_collections.ConfigDict) -> bool:
    """Whether islands carry what the codec lost into the next round: `codec.error_feedback`, always for topk
    (SparseLoCo, arXiv 2508.15706, sends a top-k of the accumulated error, never of the pseudo-gradient alone)."""
    return bool(codec.error_feedback) or codec.kind == "topk"


def _check_outer(outer: ml_collections.ConfigDict, islands: ml_collections.ConfigDict) -> None:
    _require(outer.rounds > 0, f"outer.rounds is {outer.rounds}; it must be at least 1")
    _require(
        0 <= outer.min_islands <= len(islands),
        f"outer.min_islands is {outer.min_islands} but there are {len(islands)} islands; use 0 (all) "
        f"or 1..{len(islands)}",
    )
    _require(outer.round_seconds > 0, f"outer.round_seconds is {outer.round_seconds}; it must be positive")
    _require(outer.grace_seconds >= 0, f"outer.grace_seconds is {outer.grace_seconds}; use 0 or more")
    _require(
        outer.momentum_warmup_rounds >= 0,
        f"outer.momentum_warmup_rounds is {outer.momentum_warmup_rounds}; use 0 (no warm-up) or a number of rounds",
    )
    _require(
        outer.rejoin_timeout_seconds > 0,
        f"outer.rejoin_timeout_seconds is {outer.rejoin_timeout_seconds}; it must be a positive number of seconds",
    )
    _require(
        outer.weighting in WEIGHTINGS,
        f"outer.weighting is {outer.weighting!r}; choose 'tokens' (by each island's tokens) or 'uniform' (1/K each)",
    )
    _require(
        outer.auto_from in AUTO_FROM,
        f"outer.auto_from is {outer.auto_from!r}; choose 'catalog' or 'measured' (with outer.sync='auto')",
    )
    _require(
        outer.fragments >= 1,
        f"outer.fragments is {outer.fragments}; use 1 (plain DiLoCo) or more fragments (Streaming DiLoCo)",
    )
    tau = outer.overlap_steps
    _require(
        tau == "auto" or (isinstance(tau, int) and not isinstance(tau, bool) and tau >= 0),
        f"outer.overlap_steps is {tau!r}; use an integer >= 0 (inner steps; 0 applies each update at once) or 'auto'",
    )
    _require(
        0.0 <= outer.mix_alpha <= 1.0,
        f"outer.mix_alpha is {outer.mix_alpha}; use a weight in [0, 1] (the local side of the mix)",
    )
    _require(outer.sync in SYNC, f"outer.sync is {outer.sync!r}; choose one of {SYNC}")
    ref = outer.reference_island
    _require(
        ref == "" or ref in islands,
        f"outer.reference_island is {ref!r}, not an island of this config; choose one of "
        f"{list(islands.keys())} or leave it empty for the first",
    )
    _require(
        outer.enabled or len(islands) == 1,
        f"outer.enabled is False but there are {len(islands)} islands; "
        "without the outer loop only one island can train",
    )


def _check_comm(comm: ml_collections.ConfigDict) -> None:
    _require(
        1024 <= comm.chunk_bytes <= MAX_CHUNK_BYTES,
        f"comm.chunk_bytes is {comm.chunk_bytes}; use 1024..{MAX_CHUNK_BYTES} bytes (64 MiB), far below "
        "protobuf's 2 GiB message ceiling (default 1 MiB)",
    )
    for name in ("join_timeout_seconds", "round_timeout_seconds", "reconnect_seconds", "reconnect_backoff_cap_seconds",
                 "keepalive_seconds"):
        _require(comm[name] > 0, f"comm.{name} is {comm[name]}; it must be a positive number of seconds")
    _require(
        1 <= comm.connections <= MAX_CONNECTIONS,
        f"comm.connections is {comm.connections}; use 1..{MAX_CONNECTIONS} gRPC channels per island",
    )
    tls = comm.tls
    _require(
        bool(tls.cert_file) == bool(tls.key_file),
        "comm.tls.cert_file and comm.tls.key_file go together: give both (TLS) or neither",
    )
    _require(
        bool(tls.client_cert_file) == bool(tls.client_key_file),
        "comm.tls.client_cert_file and comm.tls.client_key_file go together: give both (mutual TLS) or neither",
    )
    _require(
        not tls.client_cert_file or tls.ca_file,
        "comm.tls.client_cert_file needs comm.tls.ca_file: the CA that signed the coordinator's certificate",
    )
    _require(
        not tls.require_client_cert or tls.ca_file,
        "comm.tls.require_client_cert needs comm.tls.ca_file: the CA the islands' certificates must come from",
    )
    link = comm.link
    _require(
        link.bandwidth_gbps >= 0,
        f"comm.link.bandwidth_gbps is {link.bandwidth_gbps}; use a rate in Gbit/s, or 0 for no emulated link",
    )
    _require(link.latency_ms >= 0, f"comm.link.latency_ms is {link.latency_ms}; use a one-way latency >= 0 ms")
    _require(
        link.window_bytes == 0 or link.window_bytes >= comm.chunk_bytes,
        f"comm.link.window_bytes is {link.window_bytes}; use 0 (unlimited) or at least comm.chunk_bytes "
        f"({comm.chunk_bytes})",
    )
    _require(
        link.bandwidth_gbps > 0 or (link.latency_ms == 0 and link.window_bytes == 0),
        "comm.link.latency_ms and window_bytes only apply to an emulated link; set comm.link.bandwidth_gbps too",
    )


def _check_checkpoint(ckpt: ml_collections.ConfigDict) -> None:
    _require(
        ckpt.every_rounds > 0,
        f"checkpoint.every_rounds is {ckpt.every_rounds}; it must be at least 1 (checkpoints are also "
        "written after the last round)",
    )
    _require(ckpt.max_to_keep > 0, f"checkpoint.max_to_keep is {ckpt.max_to_keep}; keep at least 1")
    _require(
        ckpt.coordinator_every_rounds >= 0,
        f"checkpoint.coordinator_every_rounds is {ckpt.coordinator_every_rounds}; use 0 (every_rounds) or a "
        "number of rounds",
    )


def _check_eval(evaluation: ml_collections.ConfigDict) -> None:
    _require(evaluation.every_rounds > 0, f"eval.every_rounds is {evaluation.every_rounds}; it must be at least 1")
    _require(evaluation.num_windows >= 2,
             f"eval.num_windows is {evaluation.num_windows}; use at least 2 (its standard error needs two windows)")
    _require(evaluation.batch_size > 0, f"eval.batch_size is {evaluation.batch_size}; it must be positive")


WANDB_MODES = ("", "online", "offline", "disabled")  # values of metrics.wandb.mode


def _check_metrics(metrics: ml_collections.ConfigDict) -> None:
    from island_jax.metrics import WRITERS, writer_names  # imports no JAX

    names = writer_names(metrics.writers)
    _require("jsonl" in names, f"metrics.writers is {metrics.writers!r}; it must include jsonl, the run's own "
             "record (its summaries and progress are read from it), e.g. 'jsonl,tensorboard'")
    for name in names:
        _require(name == "jsonl" or name in WRITERS or (":" in name and all(name.partition(":")[::2])),
                 f"metrics.writers names {name!r}; use {', '.join(['jsonl', *WRITERS])} or MODULE:CLASS of a writer "
                 "(island_jax/metrics.py)")
    _require(metrics.get("progress_seconds", 0.0) >= 0,
             f"metrics.progress_seconds is {metrics.get('progress_seconds')}; give the seconds between progress lines "
             "within a round (0: none)")
    _require(metrics.wandb.mode in WANDB_MODES,
             f"metrics.wandb.mode is {metrics.wandb.mode!r}; choose one of {WANDB_MODES[1:]} or '' (WANDB_MODE)")


def _check_data(config: ml_collections.ConfigDict) -> None:
    """The data section and `islands.*.data`; a prepared dataset's tokenizer and records are checked against the
    model when an island opens them (`data.load`), on the host that holds them."""
    data, m = config.data, config.model
    _require(0.0 < data.eval_fraction < 1.0, f"data.eval_fraction is {data.eval_fraction}; use a value in (0, 1)")
    shared = data.get("prepared", "")
    if not shared:
        _require(
            m.vocab_size >= BYTE_SYMBOLS,
            f"model.vocab_size is {m.vocab_size} but the byte-level data has {BYTE_SYMBOLS} symbols; use a vocab_size "
            f"of at least {BYTE_SYMBOLS} (rows beyond it are padding)",
        )
    for name, isl in config.islands.items():
        own = isl.get("data", "")
        if not own:
            continue
        _require(bool(shared), f"islands.{name}.data is {own!r} but data.prepared is empty; set data.prepared to the "
                 "prepared dataset whose eval split all islands score and whose tokenizer they share")
        from island_jax.data import DataError, parse_mixture

        try:
            parse_mixture(own)
        except DataError as e:
            raise ConfigError(str(e).replace("islands.*.data", f"islands.{name}.data")) from None


def _check_island(config: ml_collections.ConfigDict, name: str, isl: ml_collections.ConfigDict) -> None:
    """One island's entry, against the model, the round plan and the evaluation batch."""
    p = f"islands.{name}"
    _check_island_mesh(p, isl, config.moe)
    _check_island_rounds(p, isl, config)
    _require(
        0 < isl.simulated_speed <= 1,
        f"{p}.simulated_speed is {isl.simulated_speed}; use a value in (0, 1] (0.5: half as fast)",
    )
    _require(
        isl.num_processes == 1 or config.outer.sync != "time",
        f"{p}.num_processes is {isl.num_processes} with outer.sync='time': the processes of one island would each "
        "count their own steps by the clock; use outer.sync='steps' or 'auto' for an island of several processes",
    )
    _require(isl.crash_at_round >= 0, f"{p}.crash_at_round is {isl.crash_at_round}; use 0 (never) or a round")
    # fsdp splits each parameter with a d_model dimension on its leading dimension that is not the experts'
    # (`mesh.fsdp_leading`): the embedding's vocabulary, the positions, d_model or a feed-forward width.
    for key in ("model.vocab_size", "model.seq_len", "model.d_model", "model.mlp_hidden_dim", "moe.expert_hidden_dim"):
        section, field = key.split(".")
        size = config[section][field]
        _require(
            size % isl.mesh.fsdp == 0,
            f"{key}={size} is not divisible by {p}.mesh.fsdp={isl.mesh.fsdp}: fsdp splits every parameter on its "
            "leading dimension that is not the experts' (vocabulary, positions, d_model and the feed-forward widths); "
            f"choose fsdp as a divisor of {field}",
        )
    _require(isl.memory_gb >= 0, f"{p}.memory_gb is {isl.memory_gb}; use 0 (the hardware catalog's) or the GB "
                                 "per device")
    _require(
        config.eval.batch_size % isl.num_devices == 0,
        f"eval.batch_size={config.eval.batch_size} is not divisible by {p}'s {isl.num_devices} devices; "
        "use a multiple of every island's device count",
    )


def _check_island_mesh(p: str, isl: ml_collections.ConfigDict, moe: ml_collections.ConfigDict) -> None:
    """The mesh against the device count and the processes, the experts and the batch."""
    mesh_devices = isl.mesh.data * isl.mesh.fsdp * isl.mesh.expert
    shape = f"data={isl.mesh.data}, fsdp={isl.mesh.fsdp}, expert={isl.mesh.expert}"
    _require(
        isl.num_processes >= 1 and isl.devices_per_process >= 0,
        f"{p} has num_processes={isl.num_processes}, devices_per_process={isl.devices_per_process}; use at least "
        "1 process, and 0 (num_devices / num_processes) or more devices per process",
    )
    _require(
        isl.num_devices % isl.num_processes == 0
        and isl.num_processes * devices_per_process(isl) == isl.num_devices,
        f"{p}.num_devices is {isl.num_devices} but num_processes x devices_per_process is {isl.num_processes} x "
        f"{devices_per_process(isl)}; make num_devices their product (or leave devices_per_process 0)",
    )
    _require(
        isl.mesh.data > 0 and isl.mesh.fsdp > 0 and isl.mesh.expert > 0,
        f"{p}.mesh has {shape}; every axis must be at least 1",
    )
    _require(
        mesh_devices == isl.num_devices,
        f"{p}.mesh has {shape} ({mesh_devices} devices) but "
        f"{p}.num_devices is {isl.num_devices}; make data x fsdp x expert equal num_devices",
    )
    _require(
        moe.num_experts % isl.mesh.expert == 0,
        f"moe.num_experts={moe.num_experts} is not divisible by {p}.mesh.expert={isl.mesh.expert}; "
        "choose num_experts as a multiple of every island's expert axis",
    )
    _require(
        isl.batch_size > 0 and isl.batch_size % mesh_devices == 0,
        f"{p}.batch_size={isl.batch_size} is not divisible by data x fsdp x expert = {mesh_devices}; "
        "use a positive multiple of the island's device count",
    )


def _check_island_rounds(p: str, isl: ml_collections.ConfigDict, config: ml_collections.ConfigDict) -> None:
    """Inner steps against fragments and overlap, and the hardware the round plan reads."""
    outer, tau = config.outer, config.outer.overlap_steps
    _require(isl.inner_steps > 0, f"{p}.inner_steps is {isl.inner_steps}; it must be at least 1")
    if outer.sync == "steps":
        _require(
            isl.inner_steps >= outer.fragments,
            f"{p}.inner_steps is {isl.inner_steps} but outer.fragments is {outer.fragments}; every fragment "
            "needs its own inner step of the round: raise inner_steps or lower outer.fragments",
        )
        _require(
            tau == "auto" or tau < isl.inner_steps,
            f"outer.overlap_steps is {tau} but {p}.inner_steps is {isl.inner_steps}; a fragment's update must land "
            "before its next contribution: use fewer than inner_steps overlap steps, or 'auto'",
        )
    _require(
        isl.hardware in CATALOG,
        f"{p}.hardware is {isl.hardware!r}, not in the hardware catalog; choose one of {sorted(CATALOG)}",
    )
    if outer.sync == "auto" and outer.auto_from == "catalog":
        ref = config.islands[outer.reference_island or next(iter(config.islands.keys()))]
        _require(
            isl.batch_size * ref.num_devices == ref.batch_size * isl.num_devices,
            f"outer.sync='auto' plans inner steps for equal per-device batch, but {p} has "
            f"{isl.batch_size}/{isl.num_devices} sequences per device and the reference island "
            f"{ref.batch_size}/{ref.num_devices}; make them equal or use outer.sync='steps'",
        )


def _check_devices(config: ml_collections.ConfigDict, num_available_devices: int | None, island: str | None) -> None:
    """The devices this process needs (all islands', or `island`'s) against those it has."""
    total = total_devices(config)
    if island is not None:
        _require(
            island in config.islands,
            f"--island={island} is not an island of this config; choose one of {list(config.islands.keys())}",
        )
        total = config.islands[island].num_devices
    if num_available_devices is not None:
        _require(
            total <= num_available_devices,
            f"the islands need {total} devices in all (sum of islands.*.num_devices) but this machine has "
            f"{num_available_devices}; shrink the islands or run on more devices",
        )


def evaluating_island(config: ml_collections.ConfigDict) -> str:
    """The island that evaluates the global parameters and whose checkpoints hold them: the first of
    `config.islands`."""
    return next(iter(config.islands.keys()))


def devices_per_process(isl: ml_collections.ConfigDict) -> int:
    """The devices each process of island `isl` (an entry of `config.islands`) has."""
    return isl.devices_per_process or isl.num_devices // max(isl.num_processes, 1)


def total_devices(config: ml_collections.ConfigDict) -> int:
    """Sum of `islands.*.num_devices`: the devices one process needs for all islands."""
    return sum(isl.num_devices for isl in config.islands.values())


def fingerprint_fields(config: ml_collections.ConfigDict) -> dict:
    """What islands and coordinator must share, as {dotted field name: value}.

    Covers the model and MoE shapes, the codecs both ways and their sizes, the held-out
    share of the corpus and the seed; not island sizes, batch sizes or learning
    rates or `model.remat`, which may differ per island, nor `data.files`, whose path may differ
    per host (an island's join carries its corpus's fingerprint, checked
    against the first island's: `coordinator.handshake.check_corpus`).
    """
    # model.remat changes what is recomputed, not the model: an island in a process of its own may differ
    fields = {f"model.{k}": v for k, v in config.model.items() if k != "remat"}
    shapes = ("num_experts", "num_experts_per_token", "expert_hidden_dim", "num_shared_experts", "every_n_layers")
    fields.update({f"moe.{k}": config.moe[k] for k in shapes})
    fields["moe.routing_bias"] = config.moe.routing_bias_update_rate > 0
    fields.update({f"codec.{k}": v for k, v in config.codec.items()})
    fields["codec.update_kind"] = update_kind(config.codec)  # "" and codec.kind's name are the same codec
    fields["comm.chunk_bytes"] = config.comm.chunk_bytes  # the payload's piece layout depends on it
    fields["outer.fragments"] = config.outer.fragments  # the payloads are per fragment
    fields["data.eval_fraction"] = config.data.eval_fraction  # the split of the corpus (an island sends its corpus)
    if config.data.get("prepared", ""):  # who reads which prepared records: islands that spread them otherwise
        from island_jax.data import sharing  # would train on overlapping records

        fields["data.sharing"] = sharing(config, list(config.islands.keys()))
    fields["seed"] = config.seed
    return fields


def fingerprint_differences(mine: dict, theirs: dict) -> list[str]:
    """Fields in which two `fingerprint_fields` differ, as "field (theirs X, here Y)"."""
    keys = sorted(set(mine) | set(theirs))
    return [f"{k} (theirs {theirs.get(k)!r}, here {mine.get(k)!r})" for k in keys if mine.get(k) != theirs.get(k)]


def field_paths(config: ml_collections.ConfigDict) -> list[str]:
    """Every leaf field of `config` as a dotted path (e.g. "outer.rounds", "islands.a.mesh.data"), in key order."""
    import json

    return list(_flat(json.loads(config.to_json_best_effort())))


def unknown_field(config: ml_collections.ConfigDict, path: str) -> ConfigError:
    """The error for a dotted `path` that names no field of `config`, suggesting the nearest field's path
    (difflib's closest match of `field_paths`), e.g. "outer.roundz is not a field of the config; did you mean
    outer.rounds? (the fields are listed in island_jax/config.py)"."""
    import difflib

    near = difflib.get_close_matches(path, field_paths(config), n=1, cutoff=0.6)
    hint = f"did you mean {near[0]}?" if near else "no field is close to it"
    return ConfigError(f"{path} is not a field of the config; {hint} (the fields are listed in island_jax/config.py)")


# Fields a resumed role may find changed in its config without `--allow_config_change` (`config_changes`):
# fault injection, the run extended by more rounds (never fewer), and where credentials are read from.
RESUME_MAY_CHANGE = ("islands.*.crash_at_round", "outer.rounds", "comm.tls.*", "comm.auth.*", "metrics.*")


class ConfigChangeError(ConfigError):
    """A role would resume under another config than the one its folder was started with.

    Attributes:
      changes: `config_changes`'s list.
    """

    def __init__(self, message: str, changes: list[tuple[str, object, object]]):
        super().__init__(message)
        self.changes = changes


_MISSING = object()  # not a field of the defaults


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _may_change(path: str, started, now) -> bool:
    import fnmatch

    if path == "outer.rounds":
        return isinstance(started, int) and isinstance(now, int) and now >= started
    return any(fnmatch.fnmatchcase(path, pattern) for pattern in RESUME_MAY_CHANGE if pattern != "outer.rounds")


def config_changes(
    started: dict, config: ml_collections.ConfigDict, allowed: bool = False
) -> list[tuple[str, object, object]]:
    """The fields in which `config` differs from the config a role started with, leaving out `RESUME_MAY_CHANGE`
    (unless `allowed`: then every field that differs).

    Args:
      started: the role's `config.json`, as parsed JSON.
      config: the config it would resume under.
      allowed: also list the fields of `RESUME_MAY_CHANGE` that differ.

    Returns:
      [(dotted field, the value it started with, the value now)], sorted by field; a field only one side has
      shows None on the other.
    """
    import json

    old, new = _flat(started), _flat(json.loads(config.to_json_best_effort()))
    # A field the role's config.json lacks (it was written before the field existed) is unchanged while the
    # config holds its default: runs started by an earlier version resume.
    defaults = _flat(json.loads(default_config().to_json_best_effort()))
    island_defaults = _flat(json.loads(ml_collections.ConfigDict(island(1, 1, 1, 1, 1)).to_json_best_effort()))
    for k in set(new) - set(old):
        parts = k.split(".")
        default = island_defaults.get(".".join(parts[2:]), _MISSING) if parts[0] == "islands" else defaults.get(
            k, _MISSING)
        if default == new[k]:
            old[k] = default
    return [
        (k, old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k) and (allowed or not _may_change(k, old.get(k), new.get(k)))
    ]


def refuse_config_changes(folder: str, started: dict, config: ml_collections.ConfigDict) -> None:
    """Refuses to resume the role in `folder` under a config other than the one it `started` with.

    Raises:
      ConfigChangeError: `config_changes` is not empty; the message lists every field with both values and
        says what to do.
    """
    changes = config_changes(started, config)
    if changes:
        listed = ", ".join(f"{k} (started with {a!r}, now {b!r})" for k, a, b in changes)
        raise ConfigChangeError(
            f"{folder} was started with another config: {listed}. Resume with the config it started with (its "
            "config.json), pass a new --workdir, or pass --allow_config_change to go on under this one and record "
            "the change",
            changes,
        )


def _typed_from_json(value, template):
    """`value` (parsed JSON) as the ConfigDict field it was written from, with `template`'s types where JSON
    loses them: a tuple (JSON writes a list) and a `FieldReference` of a declared type (`outer.overlap_steps`,
    of `object`); nested dicts become ConfigDicts. A field the template lacks keeps its JSON type."""
    if isinstance(template, ml_collections.FieldReference):
        return ml_collections.FieldReference(value, field_type=template.get_type())
    if isinstance(value, dict):
        fields = template._fields if isinstance(template, ml_collections.ConfigDict) else {}
        return ml_collections.ConfigDict({k: _typed_from_json(v, fields.get(k)) for k, v in value.items()})
    if isinstance(template, tuple) and isinstance(value, list):
        return tuple(value)
    return value


def read_json(path: str) -> ml_collections.ConfigDict:
    """The `ml_collections.ConfigDict` a role's `config.json` at `path` was written from
    (`ConfigDict.to_json_best_effort`), rebuilt field by field with the types of `config.default_config()`
    (and of `config.island` under `islands`), so that it equals the config the run started with and its
    overrides parse as that config's would.

    Raises:
      FileNotFoundError: no file at `path`.
      ValueError: the file is not a JSON object (`json.JSONDecodeError` for text that is not JSON).
    """
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    if not isinstance(raw, dict):
        raise ValueError(f"{path} holds no recorded config (a JSON object): it holds a {type(raw).__name__}")
    template = default_config()
    islands = raw.get("islands")
    if isinstance(islands, dict):  # every island from the one template
        one = island(1, 1, 1, 1, 1)
        template.islands = ml_collections.ConfigDict({name: one for name in islands})
    return _typed_from_json(raw, template)
