"""The configuration schema of a run: every field with its meaning, units and default.

`default_config()` builds a run's `ml_collections.ConfigDict`, one helper per section, and `island(...)` one
entry of `islands`; the comment beside each default documents its field. Sections, nested by concern: `seed`,
`model` (the decoder-only transformer), `moe` (Switch Transformer, arXiv 2101.03961; ST-MoE router z-loss,
arXiv 2202.08906), `islands` (keyed by island name, so `--config.islands.b.batch_size=8` works; empty by
default), `inner` (AdamW, warm-up + cosine), `outer` (DiLoCo, arXiv 2311.08105: round planning, quorum,
Streaming DiLoCo fragments, arXiv 2501.18512), `codec` (the pseudo-gradient wire format), `data`, `eval`,
`comm` (the gRPC exchange and the emulated WAN link), `checkpoint`, `distributed` (`jax.distributed`
timeouts) and `metrics` (trackers). docs/configs.md maps each section to the code that reads it.

Also here: the values some fields may take, `ConfigError`, and small readers of derived fields
(`update_kind`, `error_feedback`, the devices of an island). Imports no JAX.
"""

from __future__ import annotations

import ml_collections

# The values two fields may take. They live here, not beside the code that implements them (island_jax/model/moe.py
# and island_jax/outer/codec/kinds.py import them from here), so that reading and checking a config imports no JAX
# (the launcher does only that).
DISPATCH = ("capacity", "dropless")  # `moe.dispatch` (island_jax/model/moe.py)
CODEC_KINDS = ("none", "bf16", "int8", "int4", "topk")  # `codec.kind`, every codec (island_jax/outer/codec/)

SYNC = ("steps", "auto", "time")  # values of outer.sync (island_jax/outer/inner_steps.py)
AUTO_FROM = ("catalog", "measured")  # values of outer.auto_from
WEIGHTINGS = ("tokens", "uniform")  # values of outer.weighting
EXPERT_WEIGHTINGS = ("same", "tokens_routed")  # values of outer.expert_weighting
MIB = 1 << 20
MAX_CHUNK_BYTES = 64 * MIB  # far below protobuf's 2 GiB message ceiling
MAX_CONNECTIONS = 256
KEEPALIVE_SECONDS = 10.0  # default of comm.keepalive_seconds (island_jax/comm/options.py), seconds
RECONNECT_BACKOFF_CAP_SECONDS = 8.0  # default of comm.reconnect_backoff_cap_seconds (island_jax/comm/reconnect.py)
DTYPES = ("float32", "bfloat16")  # values of model.param_dtype and model.compute_dtype
# Values of model.remat: "none" keeps every activation, "full" recomputes each block's from its input, and the
# others are `jax.checkpoint_policies` of those names (what a block keeps; the rest is recomputed)
POSITIONS = ("learned", "rope")  # values of model.positions
REMAT = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable", "everything_saveable",
         "nothing_saveable")
WANDB_MODES = ("", "online", "offline", "disabled")  # values of metrics.wandb.mode
BYTE_SYMBOLS = 256  # symbols of the byte-level data (island_jax/data/corpus.py): model.vocab_size must hold them all


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
        (`config.parse_mixture`); needs `data.prepared`, whose tokenizer it must share.
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
    c.coordinator = _coordinator()
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
        # tokens of the fixed routing probe (the first windows of the shared held-out set) whose top-k experts every
        # island sends with its round's last contribution, for the round record's top-k overlap (docs/moe.md); 0: none
        routing_probe_tokens=128,
        # comma-separated: the figures the launcher writes into the workdir when the run ends: timeline (timeline.png,
        # each island's rounds over time) and routing (routing.png, expert load and divergence; a run with MoE
        # layers); "": none (island_jax/plots.py draws them from the records at any time)
        plots="timeline,routing",
        wandb=dict(  # with "wandb" in writers (pip install island_jax[wandb])
            project="island_jax",  # the W&B project of the run's runs (one per role, grouped by the workdir's name)
            entity="",  # the W&B entity (team or user); "": the account's default
            mode="",  # online | offline | disabled; "": WANDB_MODE, else online
        ),
    )


def _coordinator() -> dict:
    """`coordinator`: the coordinator's processes (docs/cluster.md, "A coordinator of several hosts")."""
    return dict(
        # K: processes the coordinator is cut into by chunk range; shard k holds the master, outer optimizer state
        # and island view of range k of every fragment's chunk plan. 1: one process. Their addresses are the
        # --coordinator flag's list (HOST:PORT,..., shard 0 first; a cluster file's coordinator.addresses)
        shards=1,
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
        remat="none",  # rematerialization per block, or per scanned unit (jax.checkpoint policy): none | full | ...
        scan_layers=False,  # blocks as a scanned unit with stacked parameters (jax.lax.scan; MaxText's scan_layers)
        positions="learned",  # learned: a position embedding of seq_len rows; rope: rotary (RoFORMER) in attention
        rope_theta=10_000.0,  # with positions=rope: the base of the rotary frequencies
        num_kv_heads=0,  # key/value heads K of grouped-query attention, dividing num_heads; 0: num_heads (MHA)
        qk_norm=False,  # RMSNorm each query and key head over its width before the rotary positions (Qwen3)
        norm_eps=1e-6,  # epsilon of every RMSNorm, inside the square root
        # a transformers checkpoint's folder (Mixtral, Qwen2-MoE, Qwen3-MoE; docs/interop.md) the run starts from:
        # its weights are the initial parameters of the coordinator and every island, its architecture sets
        # model.* and moe.* (`model.load.from_hf`); "" = drawn from the seed
        init_from="",
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
        shared_expert_gate=False,  # scale the shared experts' output by sigmoid(x w) per token (Qwen2-MoE)
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
        # how the routed experts' rows (w_gate, w_up, w_down of each MoE layer) are weighed: "same" (as every
        # other parameter, by `weighting`) or "tokens_routed" (expert e of layer l by the assignments each island
        # routed to it over the round, c_k[l, e] / sum_j c_j[l, e]: coordinator/expert_merge.py, docs/moe.md)
        expert_weighting="same",
        sync="steps",  # steps: each island's inner_steps; auto: scaled by devices x catalog peak; time: round_seconds
        reference_island="",  # with sync=auto, the island whose inner_steps is kept ("" = the first)
        auto_from="catalog",  # with sync=auto: "catalog" peaks, or "measured" step times of round 0
        round_seconds=10.0,  # with sync=time: wall-clock seconds of training per round
        min_islands=0,  # quorum: merge once this many islands contributed and grace_seconds passed (0 = all)
        grace_seconds=60.0,  # seconds a reached quorum waits for the remaining islands
        # seconds a round that cannot close (its quorum not reached) waits for missing islands after its first
        # contribution, for a dead island to be restarted and rejoin; then the coordinator fails, naming them
        rejoin_timeout_seconds=600.0,
        # how a restarted island catches up with the run: "replay" recomputes the rounds it missed from its own
        # checkpoint with the coordinator's kept updates, checked by digest (the uninterrupted run's bits), and
        # takes the view where it cannot; "view" takes the coordinator's view at once (docs/faults.md)
        rejoin="replay",
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


def update_kind(codec: ml_collections.ConfigDict) -> str:
    """The update's codec kind of a config's `codec` section: `codec.update_kind`, or `codec.kind` when it is ""."""
    return codec.get("update_kind", "") or codec.kind


def error_feedback(codec: ml_collections.ConfigDict) -> bool:
    """Whether islands carry what the codec lost into the next round: `codec.error_feedback`, always for topk
    (SparseLoCo, arXiv 2508.15706, sends a top-k of the accumulated error, never of the pseudo-gradient alone)."""
    return bool(codec.error_feedback) or codec.kind == "topk"


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


def flat_fields(tree: dict, prefix: str = "") -> dict:
    """{dotted path: value} of every leaf of a nested dict (a config's JSON); an empty dict is a leaf."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flat_fields(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
