"""The launcher's progress line: one per round, once every island has logged it or gone past it."""

import json

from island_jax.progress import Progress


def _log(workdir, name, rounds):
    folder = workdir / "islands" / name
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "metrics.jsonl", "a") as f:
        for r in rounds:
            sent, received = {"a": (1e5, 2e5), "b": (3e5, 4e5)}[name]
            rec = dict(kind="round", round=r, train_loss=1.0 / r, bytes_sent=sent, bytes_received=received,
                       seconds_blocked=0.5, achieved_gbps=1.0, compute_utilization=0.9)
            f.write(json.dumps(rec) + "\n")


def test_a_round_an_island_missed_is_shown_once_it_went_past_it(tmp_path):
    progress = Progress(str(tmp_path), ["a", "b"], 4)
    _log(tmp_path, "a", [1, 2, 3])
    _log(tmp_path, "b", [1])  # b died after round 1
    lines = progress.poll()
    assert [line.split(" | ")[:2] for line in lines] == [["round 1/4", "loss a=1.0000 b=1.0000"]]
    assert progress.poll() == []  # round 2 waits for b
    _log(tmp_path, "b", [3])  # b rejoined at round 3: it missed round 2
    lines = progress.poll()
    assert [line.split(" | ")[:2] for line in lines] == [["round 2/4", "loss a=0.5000 b=-"],
                                                          ["round 3/4", "loss a=0.3333 b=0.3333"]]
    assert "blocked a=0.50s b=-" in lines[0] and "utilization a=0.90 b=-" in lines[0]
    # every island's bytes, not the first one's for all
    assert "sent/received a=0.10/0.20 b=- MB" in lines[0] and "sent/received a=0.10/0.20 b=0.30/0.40 MB" in lines[1]
