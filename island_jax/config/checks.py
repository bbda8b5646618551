"""The checks of a run's config: `validate(config)` refuses, before JAX compiles anything, a config that
cannot run, with a `ConfigError` naming the first invalid field and the fix.

One check per section (`_check_model`, `_check_moe`, ...) and per island (its mesh against its devices,
processes, experts and batch; its inner steps against fragments and overlap; its hardware), then the devices
this process has. A prepared dataset's tokenizer and records are checked when an island opens them
(`data.load`), on the host that holds them. Imports no JAX.
"""

from __future__ import annotations

import logging

import ml_collections

from island_jax.config.hf import check_init_from
from island_jax.config.mixture import parse_mixture
from island_jax.config.schema import (
    AUTO_FROM,
    BYTE_SYMBOLS,
    CODEC_KINDS,
    DISPATCH,
    DTYPES,
    EXPERT_WEIGHTINGS,
    MAX_CHUNK_BYTES,
    MAX_CONNECTIONS,
    POSITIONS,
    REMAT,
    SYNC,
    WANDB_MODES,
    WEIGHTINGS,
    ConfigError,
    devices_per_process,
    total_devices,
    update_kind,
)
from island_jax.hardware import CATALOG


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
    check_init_from(config)
    _check_moe(config.moe, config.model)
    _check_codec(config.codec)
    _check_outer(config.outer, config.islands)
    _check_comm(config.comm)
    _check_checkpoint(config.checkpoint)
    _check_eval(config.eval)
    _check_data(config)
    if "coordinator" in config:  # a config saved before the section existed has none
        _check_coordinator(config.coordinator)
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
    _require(isinstance(m.get("scan_layers", False), bool),
             f"model.scan_layers is {m.get('scan_layers')!r}; use True (scanned blocks, stacked parameters) or False")
    _require(m.positions in POSITIONS, f"model.positions is {m.positions!r}; choose one of {POSITIONS}")
    kv = m.get("num_kv_heads", 0)
    _require(kv >= 0 and (kv == 0 or m.num_heads % kv == 0),
             f"model.num_kv_heads is {kv}; use a divisor of model.num_heads={m.num_heads} (0: as many as num_heads)")
    _require(m.get("norm_eps", 1e-6) > 0, f"model.norm_eps is {m.get('norm_eps')}; use a small positive epsilon")
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
    _require(not moe.get("shared_expert_gate", False) or moe.num_shared_experts > 0,
             "moe.shared_expert_gate is True but moe.num_shared_experts is 0: there is no shared expert to gate")
    _require(
        moe.routing_bias_update_rate >= 0,
        f"moe.routing_bias_update_rate is {moe.routing_bias_update_rate}; use 0 (off) or a positive rate such as 0.001",
    )
    _require(
        1 <= moe.every_n_layers <= m.num_layers,
        f"moe.every_n_layers is {moe.every_n_layers} but model.num_layers is {m.num_layers}; use 1..num_layers "
        "so that at least one block has an MoE layer",
    )
    tail = m.num_layers % moe.every_n_layers
    if m.get("scan_layers", False) and tail:
        # the MoE blocks sit at n-1, 2n-1, ...: the last L mod n blocks do not repeat the unit
        logging.getLogger(__name__).warning(
            "model.scan_layers: blocks 0..%d are scanned as %d units of moe.every_n_layers=%d; the last %d "
            "(%d..%d, dense) stay unrolled because model.num_layers=%d is not a multiple of %d",
            m.num_layers - tail - 1, m.num_layers // moe.every_n_layers, moe.every_n_layers, tail,
            m.num_layers - tail, m.num_layers - 1, m.num_layers, moe.every_n_layers)


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
        outer.get("rejoin", "replay") in ("replay", "view"),
        f"outer.rejoin is {outer.get('rejoin')!r}; use \"replay\" (recompute the rounds missed, bit for bit) or "
        "\"view\" (take the coordinator's view)",
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
        outer.get("expert_weighting", "same") in EXPERT_WEIGHTINGS,
        f"outer.expert_weighting is {outer.get('expert_weighting')!r}; choose 'same' (experts weighed as every other "
        "parameter, by outer.weighting) or 'tokens_routed' (each expert by the tokens each island routed to it)",
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


def _check_coordinator(c: ml_collections.ConfigDict) -> None:
    _require(c.shards >= 1, f"coordinator.shards is {c.shards}; use 1 (one process) or more")


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




def _check_metrics(metrics: ml_collections.ConfigDict) -> None:
    from island_jax.metrics import WRITERS, comma_names  # imports no JAX
    from island_jax.plots import PLOTS  # imports NumPy only (matplotlib where it draws)

    names = comma_names(metrics.writers)
    _require("jsonl" in names, f"metrics.writers is {metrics.writers!r}; it must include jsonl, the run's own "
             "record (its summaries and progress are read from it), e.g. 'jsonl,tensorboard'")
    for name in names:
        _require(name == "jsonl" or name in WRITERS or (":" in name and all(name.partition(":")[::2])),
                 f"metrics.writers names {name!r}; use {', '.join(['jsonl', *WRITERS])} or MODULE:CLASS of a writer "
                 "(island_jax/metrics.py)")
    plots = comma_names(metrics.get("plots", ""))
    _require(set(plots) <= set(PLOTS),
             f"metrics.plots is {metrics.get('plots')!r}; name figures among {', '.join(PLOTS)}, comma-separated "
             "('' for none)")
    probe = metrics.get("routing_probe_tokens", 0)
    _require(isinstance(probe, int) and probe >= 0,
             f"metrics.routing_probe_tokens is {probe!r}; use a whole number of tokens (0: no routing probe)")
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
        try:
            parse_mixture(own)
        except ConfigError as e:
            raise ConfigError(e.args[0].replace("islands.*.data", f"islands.{name}.data")) from None


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


