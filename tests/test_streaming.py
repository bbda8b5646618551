"""Streaming DiLoCo: fragments, the staggered schedule, overlap with mixing, tau = auto, events and the timeline."""

import json
import threading
import time

import jax
import numpy as np
import pytest
from tiny_config import get_config

from island_jax.comm.inprocess import InProcessExchange, InProcessTransport
from island_jax.comm.link import LinkEmulator
from island_jax.config import default_config, fingerprint_fields, island
from island_jax.coordinator import Coordinator
from island_jax.island import EventLog, Island, OuterLoopIsland, StreamingSync
from island_jax.model.init import checksum, init_params
from island_jax.outer import codec
from island_jax.outer import fragments as fragments_lib
from island_jax.plots import plot_timeline


class VectorIsland:
    """A test island whose inner step is plain SGD with a constant gradient: every parameter drops by `lr`.

    It implements `OuterLoopIsland`, with the real codec behind its fragment
    methods; `step_seconds` of sleep stands for each step's compute.
    """

    def __init__(self, config, params: dict, lr: float = 0.1, step_seconds: float = 0.0, total_steps: int = 10**9,
                 name: str = "solo"):
        self.name, self.config = name, config
        self.inner_steps = config.islands[name].inner_steps
        self.tokens_per_step = 1
        self.lr, self.step_seconds, self.total_steps = np.float32(lr), step_seconds, total_steps
        self.step = 0
        self.last_step_compiled = False
        self.multi_process = False
        self.keys = sorted(params)
        self.params = [np.array(params[k], np.float32) for k in self.keys]
        self.anchor = [p.copy() for p in self.params]
        self.global_leaves = [p.copy() for p in self.params]
        sizes = fragments_lib.leaf_bytes(self.params)
        self.partition = fragments_lib.partition(sizes, config.outer.fragments)
        c = config.codec
        self.fragment_plans = [
            codec.chunk_plan([self.params[i] for i in idx], c.kind, c.block_size, config.comm.chunk_bytes)
            for idx in self.partition
        ]
        self.update_plans = self.fragment_plans  # one codec both ways

    def train_round(self, num_steps=None, after_step=None, seconds=None):
        n = min(self.inner_steps if num_steps is None else num_steps, self.total_steps - self.step)
        start, times = time.perf_counter(), []
        for k in range(n):
            t = time.perf_counter()
            self.params = [np.asarray(p - self.lr, np.float32) for p in self.params]  # SGD, gradient 1
            if self.step_seconds:
                time.sleep(self.step_seconds)
            times.append(time.perf_counter() - t)
            self.step += 1
            if after_step is not None:
                after_step(k + 1, time.perf_counter() - start, times[-1])
        return dict(steps=n, step_times=times)

    def fragment_pseudo_gradient(self, p):
        return [self.anchor[i] - self.params[i] for i in self.partition[p]]

    def encode_fragment(self, p, pseudo_gradient):
        c = self.config.codec
        return codec.ChunkEncoder(pseudo_gradient, c.kind, c.block_size, self.fragment_plans[p], measure=True)

    def fragment_checksum(self, p):
        return checksum([self.global_leaves[i] for i in self.partition[p]])

    def agree(self, value):
        return [value]

    def gather_update(self, p, payload):
        return payload

    def decode_fragment(self, p, payload):
        c = self.config.codec
        return codec.decode_and_apply([self.global_leaves[i] for i in self.partition[p]], payload, c.kind, c.block_size)

    def set_inner_steps(self, inner_steps, rounds_left):
        self.inner_steps = inner_steps

    def warm_up(self):
        pass

    def place_fragment(self, p, leaves, copies):
        return [[np.array(g, np.float32) for g in leaves] for _ in range(copies)]

    def apply_fragment(self, p, leaves, mix_alpha=None, placed=None):
        for i, g in zip(self.partition[p], leaves):
            g = np.asarray(g, np.float32)
            self.global_leaves[i] = g.copy()
            self.anchor[i] = g.copy()
            local = self.params[i]
            self.params[i] = g.copy() if mix_alpha is None else np.float32(mix_alpha) * local + np.float32(1 - mix_alpha) * g

    def view_chunks(self, plan):
        return list(plan)  # one process holds every leaf

    def load_view(self, payload):
        self.global_leaves = [np.asarray(g, np.float32) for g in codec.decode_view(payload, self.global_leaves)]
        self.anchor = [g.copy() for g in self.global_leaves]
        self.params = [g.copy() for g in self.global_leaves]


def test_the_real_island_and_the_stand_in_have_what_the_outer_loop_needs():
    config = get_config()
    config.outer.fragments = 2
    graphdef, params, specs = init_params(config)
    shard = (np.arange(4096) % 251).astype(np.uint8)
    real = Island("a", config, jax.devices()[:4], graphdef, params, specs, shard, config.outer.rounds)
    stand_in = VectorIsland(vector_config(4, 2, 1), {"a": np.float32(1.0), "b": np.float32(1.0)})
    assert isinstance(real, OuterLoopIsland) and isinstance(stand_in, OuterLoopIsland)
    assert len(real.partition) == len(real.fragment_plans) == 2 and real.last_step_compiled is False


def vector_config(inner_steps, fragments, tau, alpha=0.5, kind="none"):
    c = default_config()
    c.islands.solo = island(1, 1, 1, 1, inner_steps)
    c.outer.update(learning_rate=1.0, momentum=0.0, nesterov=False, fragments=fragments, mix_alpha=alpha)
    c.outer.overlap_steps = tau
    c.codec.kind = kind
    return c


def run_vector(config, params, rounds, link=None, **island_kwargs):
    isl = VectorIsland(config, params, **island_kwargs)
    coordinator = Coordinator(config, params, ["solo"])
    transport = InProcessTransport(InProcessExchange().serve(coordinator), link, config.comm.connections)
    transport.join("solo", fingerprint_fields(config), checksum(params))
    sync = StreamingSync(isl, transport, config, link=link)
    records = [sync.run_round(r) for r in range(rounds)]
    sync.close()
    return isl, sync, coordinator, records


@pytest.mark.parametrize(
    "tau, local, anchors",
    [(1, (0.20, 0.20), (0.45, 0.25)), (0, (0.10, 0.10), (0.40, 0.20))],
)
def test_schedule_and_mixing_by_hand(tau, local, anchors):
    # a and b, one per fragment, start at 1.0; every inner step subtracts 0.1; H = 4, F = 2, alpha = 0.5.
    config = vector_config(inner_steps=4, fragments=2, tau=tau)
    params = {"a": np.float32(1.0), "b": np.float32(1.0)}
    isl, _, coordinator, _ = run_vector(config, params, rounds=3, total_steps=9)
    assert isl.step == 9
    assert isl.partition == [[0], [1]]
    # a went out after steps 2 and 6, b after 4 and 8: two merged rounds each.
    assert [f.round for f in coordinator.fragments] == [2, 2]
    np.testing.assert_allclose([float(p) for p in isl.params], local, rtol=0, atol=1e-6)
    np.testing.assert_allclose([float(p) for p in isl.anchor], anchors, rtol=0, atol=1e-6)
    assert [float(x) for x in coordinator.view.values()] == [float(x) for x in isl.anchor]


def test_contribution_steps():
    assert fragments_lib.due_fragments(2, 4, 2) == [0] and fragments_lib.due_fragments(4, 4, 2) == [1]
    assert [fragments_lib.due_fragments(t, 4, 2) for t in (1, 3, 5, 6, 8)] == [[], [], [], [0], [1]]
    assert [fragments_lib.contribution_step(p, 32, 4) for p in range(4)] == [8, 16, 24, 32]
    assert [fragments_lib.due_fragments(t, 25, 1) for t in (24, 25, 50)] == [[], [0], [0]]
    with pytest.raises(ValueError, match="lower outer.fragments or raise the island's inner_steps"):
        fragments_lib.contribution_step(0, 3, 4)


def test_model_leaves_split_into_four_fragments_near_a_quarter_of_the_bytes():
    config = get_config()
    config.model.num_layers = 2
    _, params, _ = init_params(config)
    sizes = fragments_lib.leaf_bytes(params)
    groups = fragments_lib.partition(sizes, 4)
    assert len(groups) == 4 and [i for g in groups for i in g] == list(range(len(sizes)))
    total = sum(sizes)
    for g in groups:
        assert abs(sum(sizes[i] for i in g) - total / 4) <= max(sizes)
    # a leaf larger than 1/F of the model stays whole
    assert fragments_lib.partition([10, 100, 10, 10], 2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="outer.fragments is 5 but the model has 4 parameter leaves"):
        fragments_lib.partition([1, 1, 1, 1], 5)


def test_auto_overlap_hides_a_three_step_exchange():
    # Steps of 20 ms; two fragments of 64 KiB over a 0.02 Gbit/s link with 5 ms one way:
    # each exchange (up and down) takes about 2 x (5 + 26) ms, more than 3 steps.
    step = 0.02
    config = vector_config(inner_steps=16, fragments=2, tau="auto")
    config.comm.connections = 1
    params = {"a": np.ones(16384, np.float32), "b": np.ones(16384, np.float32)}
    link = LinkEmulator(0.02, 5.0, 0)
    isl, sync, coordinator, records = run_vector(config, params, rounds=3, link=link, step_seconds=step)
    assert [f.round for f in coordinator.fragments] == [3, 2] or [f.round for f in coordinator.fragments] == [3, 3]
    exchanges = [r["exchange_seconds"] for r in records if r["exchanges"]]
    assert min(exchanges) > 3 * step
    assert all(r["overlap_steps"] >= 3 for r in records)
    assert sum(r["waits"] for r in records) == 0 and sum(r["seconds_blocked"] for r in records) == 0.0


def test_events_and_timeline(tmp_path):
    config = vector_config(inner_steps=4, fragments=2, tau=1)
    params = {"a": np.float32(1.0), "b": np.float32(1.0)}
    path = tmp_path / "events_solo.jsonl"
    isl = VectorIsland(config, params, step_seconds=0.005)
    coordinator = Coordinator(config, params, ["solo"])
    transport = InProcessTransport(InProcessExchange().serve(coordinator))
    transport.join("solo", fingerprint_fields(config), checksum(params))
    events = EventLog(str(path), "solo")
    sync = StreamingSync(isl, transport, config, events=events)
    sync.run_round(0)
    end_of_first = sync.clock.last_end
    # Evaluation and a save between the rounds: their own seconds, outside the next round's wall seconds.
    with sync.between_rounds("eval"):
        time.sleep(0.05)
    with sync.between_rounds("checkpoint"):
        time.sleep(0.02)
    second = sync.run_round(1)
    assert second["eval_seconds"] >= 0.05 and second["checkpoint_seconds"] >= 0.02
    assert second["wall_seconds"] + second["eval_seconds"] + second["checkpoint_seconds"] == pytest.approx(
        sync.clock.last_end - end_of_first, rel=0, abs=1e-9
    )
    assert second["wall_seconds"] == pytest.approx(
        second["compute_seconds"] + second["seconds_blocked"] + second["idle_seconds"], rel=0, abs=1e-9
    )
    with pytest.raises(ValueError, match="between_rounds kind 'logging' is unknown; use one of"):
        with sync.between_rounds("logging"):
            pass
    sync.drain()
    sync.close()
    events.close()
    rows = [json.loads(line) for line in open(path)]
    kinds = [r["kind"] for r in rows]
    assert kinds.count("send") == 4 and kinds.count("receive") == 4
    assert [(r["kind"], r["round"]) for r in rows if r["kind"] in ("eval", "checkpoint")] == [("eval", 1), ("checkpoint", 1)]
    sends = sorted((r["round"], r["fragment"]) for r in rows if r["kind"] == "send")
    assert sends == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(r["end"] >= r["start"] for r in rows)
    png = plot_timeline([str(path)], str(tmp_path / "timeline.png"))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_two_islands_stream_two_fragments_in_one_process(tmp_path):
    from tiny_config import write_corpus

    from island_jax.metrics import read_jsonl
    from island_jax.run import run_in_process

    config = get_config()
    config.data.files = write_corpus(tmp_path / "corpus")
    config.outer.fragments = 2
    config.outer.overlap_steps = 1
    config.metrics.plots = "timeline"
    workdir = tmp_path / "run"
    summary = run_in_process(config, str(workdir))
    last = {}
    for name in ("a", "b"):
        folder = workdir / "islands" / name
        rounds = [r for r in read_jsonl(folder / "metrics.jsonl") if r["kind"] == "round"]
        assert [r["overlap_steps"] for r in rounds] == [1, 1, 1] and summary["islands"][name]["inner_steps"] == 6
        last[name] = rounds[-1]["checksum"]
        events = read_jsonl(folder / "events.jsonl")
        sends = sorted((e["round"], e["fragment"]) for e in events if e["kind"] == "send")
        assert sends == [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
    # after the last round no update is in flight: both islands hold the same global parameters
    assert last["a"] == last["b"]
    assert (workdir / "timeline.png").exists()
    assert not (workdir / "routing.png").exists()  # metrics.plots names the timeline alone
    assert summary["eval_loss_final"] < summary["eval_loss_initial"]


def test_an_island_rejoins_while_the_fragments_are_at_different_rounds():
    """F = 2, every island needed (min_islands = 0): c dies after its fragment 0 of round 0, so fragment 0
    merges round 0 and fragment 1 waits for c. Restarted from its start, c is admitted at round 0 with the
    view of fragments at rounds [1, 0]: it skips fragment 0 that round, contributes fragment 1, and the run
    goes on with every island holding the coordinator's view."""
    config = vector_config(inner_steps=4, fragments=2, tau=0)
    del config.islands["solo"]
    for name in "abc":
        config.islands[name] = island(1, 1, 1, 1, 4)
    params = {"a": np.float32(1.0), "b": np.float32(1.0)}
    coordinator = Coordinator(config, params, list("abc"))
    exchange = InProcessExchange().serve(coordinator)
    fields = fingerprint_fields(config)

    def sync_of(isl, rounds=None):
        transport = InProcessTransport(exchange, timeout=60)
        reply = transport.join(isl.name, fields, checksum(params))
        return StreamingSync(isl, transport, config, reply["round"], fragment_rounds=rounds), transport, reply

    islands = {n: VectorIsland(config, params, name=n) for n in "ab"}
    syncs = {n: sync_of(islands[n])[0] for n in "ab"}
    dying = sync_of(VectorIsland(config, params, name="c", total_steps=3))[0]  # fragment 1 is due after step 4
    threads = [threading.Thread(target=lambda n=n: [syncs[n].run_round(r) for r in range(2)]) for n in "ab"]
    threads.append(threading.Thread(target=dying.run_round, args=(0,)))
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while [f.round for f in coordinator.fragments] != [1, 0] or len(coordinator.fragments[1].pending) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    restarted = VectorIsland(config, params, name="c")
    transport = InProcessTransport(exchange, timeout=60)
    assert transport.join("c", fields, checksum(params), 0) == dict(round=0, checksum=coordinator.checksum, rejoin=True)
    rounds, view = transport.fetch_view("c", min_round=0)
    assert rounds == [1, 0]
    restarted.load_view(view)
    sync = StreamingSync(restarted, transport, config, 0, fragment_rounds=rounds)
    for r in range(2):
        sync.run_round(r)
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive()
    assert [f.round for f in coordinator.fragments] == [2, 2]
    f0, f1 = (f.history for f in coordinator.fragments)
    assert [h.contributors for h in f0] == [["a", "b", "c"], ["a", "b", "c"]]  # c's from before it died, then its own
    assert [h.contributors for h in f1] == [["a", "b", "c"], ["a", "b", "c"]]
    view = [float(x) for x in coordinator.view.values()]
    for isl in (*islands.values(), restarted):
        assert [float(x) for x in isl.global_leaves] == view
