"""BucketDDP(elastic=True) and BucketFabricDDP(elastic=True) under torchrun: the training
loaders' data resumed exactly (``elastic_lightning.py``: a Trainer fit of 24 steps, 8 an
epoch, on 2 workers; each run against the same fit uninterrupted, bit for bit).

- A sampler of the user's (a ``DistributedSampler`` subclass; a ``WeightedRandomSampler``
  drawing from the global generator), plain and stateful loaders, rank 1 SIGKILLed
  mid-epoch: bit-equal.
- A random augmentation drawn in the dataset's ``__getitem__`` (a plain DataLoader and a
  StatefulDataLoader, in the main process; and the Fabric loop), rank 1 SIGKILLed
  mid-epoch: bit-equal (under the Trainer the generators go back before the resumed
  epoch's first fetch).
- Loaders with worker processes, mid-epoch and from an epoch's end (persistent workers
  too): bit-equal.
- A resume from an epoch's end, with Lightning's sampler, a weighted one and two training
  loaders: bit-equal, on Lightning 2.4 and 2.5 too (CI's compat run).
- Two training loaders, one started over within the epoch, rank 1 SIGKILLed mid-epoch
  (plain and stateful loaders, an augmentation, worker processes; and in Lightning's
  ``min_size`` and ``max_size`` modes): bit-equal; with a
  sampler of the user's among them, the fit warns that their positions are not kept.
- The Fabric loop's loader through ``fabric.setup_dataloaders`` (Fabric's sampler, and the
  loop's ``ElasticSampler``), and the loop's sampler in a StatefulDataLoader in the state,
  rank 1 SIGKILLed mid-epoch: bit-equal.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_runs import done_twice, same_weights
from elastic_trainer_runs import run_and_compare

pytestmark = pytest.mark.jobs  # torchrun jobs, killed and restarted

pytest.importorskip("lightning")


@pytest.mark.timeout(600)  # a hang guard: five torchrun jobs of Lightning
def test_an_augmentation_drawn_by_the_loader_resumes_bit_equal(tmp_path: Path, shm: Path) -> None:
    """Noise drawn from the global generators in ``__getitem__``, rank 1 SIGKILLed once 11
    steps are done (mid-epoch): the resumed epoch fetches its first batch from the
    snapshot's generators, as the uninterrupted fit did, and the weights are bit-equal."""
    _killed_mid_epoch_is_bit_equal(tmp_path, shm, "augment", {"ELASTIC_AUGMENT": "1"}, fabric=True)


@pytest.mark.timeout(900)  # a hang guard: nine torchrun jobs of Lightning
def test_a_sampler_of_the_users_resumes_bit_equal(tmp_path: Path, shm: Path) -> None:
    """A ``DistributedSampler`` subclass (``use_distributed_sampler=False``) and a
    ``WeightedRandomSampler`` drawing from the global generator (in Lightning's wrapper),
    under a plain and a stateful loader, rank 1 SIGKILLed mid-epoch: the resumed epoch
    draws the same order and skips what was used, and the weights are bit-equal; with the
    loader made again every epoch, the next epoch starts whole."""
    for kind in ("subclass", "weighted"):
        _killed_mid_epoch_is_bit_equal(tmp_path, shm, kind, {"ELASTIC_SAMPLER": kind})
    reload = {"ELASTIC_SAMPLER": "subclass", "ELASTIC_RELOAD": "1"}
    _killed_mid_epoch_is_bit_equal(tmp_path, shm, "reload", reload)


@pytest.mark.timeout(900)  # a hang guard: eight torchrun jobs of Lightning
def test_loaders_with_worker_processes_resume_bit_equal(tmp_path: Path, shm: Path) -> None:
    """Loaders with 2 worker processes, which ask their sampler for the first batches'
    indices as their iterator is made (before Lightning sets the epoch): Lightning's own
    sampler (the Trainer, a stateful loader, the Fabric loop) and a ``WeightedRandomSampler``
    in Lightning's wrapper (replayed), rank 1 SIGKILLed once 11 steps are done: bit-equal."""
    workers = {"ELASTIC_WORKERS": "2"}
    _killed_mid_epoch_is_bit_equal(tmp_path, shm, "lightnings", workers, fabric=True)
    weighted = {**workers, "ELASTIC_SAMPLER": "weighted"}
    _killed_mid_epoch_is_bit_equal(tmp_path, shm, "weighted", weighted)


@pytest.mark.timeout(600)  # a hang guard: six torchrun jobs of Lightning
def test_a_loader_with_worker_processes_resumes_from_an_epochs_end_bit_equal(
    tmp_path: Path, shm: Path
) -> None:
    """Rank 1 SIGKILLed in the first step of an epoch (after step 16), which starts whole
    from the snapshot of the last one's end, in a Trainer fit whose loader has 2 workers:
    with a ``WeightedRandomSampler`` (the resumed fit's first iterator, made before
    Lightning sets the epoch, draws the epoch's order), and with persistent workers
    (the fit that went on drew no new seed for that epoch), with Lightning's sampler and
    the weighted one: bit-equal to the same fit uninterrupted."""
    workers = {"ELASTIC_WORKERS": "2"}
    persistent = {**workers, "ELASTIC_PERSISTENT": "1"}
    families = {
        "weighted": {**workers, "ELASTIC_SAMPLER": "weighted"},
        "persistent": persistent,
        "persistent_weighted": {**persistent, "ELASTIC_SAMPLER": "weighted"},
    }
    _killed_at_an_epochs_end_is_bit_equal(tmp_path, shm, families)


@pytest.mark.compat("elastic")  # CI runs it with Lightning 2.4 and 2.5 too (compat --pinned)
@pytest.mark.timeout(600)  # a hang guard: four torchrun jobs of Lightning
def test_a_resume_from_an_epochs_end_is_bit_equal(tmp_path: Path, shm: Path) -> None:
    """Rank 1 SIGKILLed in the first step of an epoch (after step 16), with Lightning's
    sampler and with a ``WeightedRandomSampler`` (replayed); and with two training loaders
    (after step 11, the longer one's last, the shorter one 3 batches into its second pass),
    noise drawn as rows are read: bit-equal to the same fit uninterrupted, on every
    Lightning in the window. Before 2.5, Lightning finishes the snapshot's epoch again with
    an iterator made for it, whose seed must not count and which must yield nothing (with
    two loaders, the one that restarts draws a seed too); from 2.5 on, the next epoch runs
    on that iterator."""
    families = {"lightnings": {}, "weighted": {"ELASTIC_SAMPLER": "weighted"}}
    _killed_at_an_epochs_end_is_bit_equal(tmp_path, shm, families)
    loaders = {"loaders": {"ELASTIC_LOADERS": "2", "ELASTIC_AUGMENT": "1"}}
    _killed_at_an_epochs_end_is_bit_equal(tmp_path, shm, loaders, kill="11")


def _killed_at_an_epochs_end_is_bit_equal(
    tmp_path: Path, shm: Path, families: dict[str, dict[str, str]], kill: str = "16"
) -> None:
    """Under each family's env, the Trainer fit with rank 1 SIGKILLed after step ``kill``
    (an epoch's last): bit-equal to the fit uninterrupted, with at most one step done
    twice."""
    for family, env in families.items():
        runs = {f"{family}/straight": ("trainer", "-1"), f"{family}/killed": ("trainer", kill)}
        run_and_compare(tmp_path, shm, runs, env=env)
        out = tmp_path / family
        assert "attempt 1" in (out / "killed" / "steps.rank1").read_text(), family
        for rank in (0, 1):
            assert len(done_twice(out / "killed", rank)) <= 1, (family, rank)
        assert same_weights(out / "killed" / "final.pt", out / "straight" / "final.pt"), family


@pytest.mark.compat("elastic")  # CI runs it with Lightning 2.4 and 2.5 too (compat --pinned)
@pytest.mark.timeout(900)  # a hang guard: six torchrun jobs of Lightning
def test_two_training_loaders_resume_bit_equal(tmp_path: Path, shm: Path) -> None:
    """Two training loaders in Lightning's ``max_size_cycle``: ``a`` (8 batches a pass)
    starts over within the epoch of 11 batches that ``b`` makes. Rank 1 SIGKILLed after
    step 5 (``a``'s pass resumed, then a whole one) and after step 9 (``a`` one batch into
    its second pass), with noise drawn as rows are read, under a plain loader and, at 9, a
    stateful one; and at 9 with 2 worker processes per loader: each loader resumes where it
    stood, the generators go back once both iterators are made, and the weights are
    bit-equal to the fit uninterrupted. Nothing is warned."""
    runs = {
        "loaders/straight": ("trainer", "-1"),
        "loaders/early": ("trainer", "5"),
        "loaders/trainer": ("trainer", "9"),
        "loaders/stateful": ("stateful", "9"),
    }
    env = {"ELASTIC_LOADERS": "2", "ELASTIC_AUGMENT": "1"}  # noise drawn as rows are read
    outputs = run_and_compare(tmp_path, shm, runs, env=env)
    workers = {"workers/straight": ("trainer", "-1"), "workers/trainer": ("trainer", "9")}
    env = {"ELASTIC_LOADERS": "2", "ELASTIC_WORKERS": "2"}
    outputs |= run_and_compare(tmp_path, shm, workers, env=env)
    for name in ("loaders/early", "loaders/trainer", "loaders/stateful", "workers/trainer"):
        out = tmp_path / name
        assert "attempt 1" in (out / "steps.rank1").read_text(), f"{name} did not restart"
        for rank in (0, 1):
            assert len(done_twice(out, rank)) <= 1, (name, rank)
        reference = out.parent / "straight" / "final.pt"
        assert same_weights(out / "final.pt", reference), name
    for name, output in outputs.items():
        assert "training loaders" not in output, name


@pytest.mark.timeout(600)  # a hang guard: four torchrun jobs of Lightning
def test_two_loaders_in_the_other_modes_resume_bit_equal(tmp_path: Path, shm: Path) -> None:
    """The same two loaders combined in ``min_size`` (epochs of 8 batches, ``b`` stopped
    after 8 of its 11) and ``max_size`` (``a`` runs out after 8 of the epoch's 11 and gives
    nothing more), noise drawn as rows are read, rank 1 SIGKILLed after step 5 and step 9:
    bit-equal to the fit uninterrupted, nothing warned."""
    for mode, kill in (("min_size", "5"), ("max_size", "9")):
        runs = {f"{mode}/straight": ("trainer", "-1"), f"{mode}/killed": ("trainer", kill)}
        env = {"ELASTIC_LOADERS": "2", "ELASTIC_LOADERS_MODE": mode, "ELASTIC_AUGMENT": "1"}
        outputs = run_and_compare(tmp_path, shm, runs, env=env)
        out = tmp_path / mode / "killed"
        assert "attempt 1" in (out / "steps.rank1").read_text(), f"{mode} did not restart"
        for rank in (0, 1):
            assert len(done_twice(out, rank)) <= 1, (mode, rank)
        assert same_weights(out / "final.pt", out.parent / "straight" / "final.pt"), mode
        for name, output in outputs.items():
            assert "training loaders" not in output, name


@pytest.mark.timeout(300)  # a hang guard: one torchrun job of Lightning
def test_two_loaders_one_with_a_sampler_of_its_own_are_warned_about(
    tmp_path: Path, shm: Path
) -> None:
    # A sampler of the user's among several loaders is not followed: the fit says so.
    env = {"ELASTIC_LOADERS": "2", "ELASTIC_SAMPLER": "weighted"}
    outputs = run_and_compare(tmp_path, shm, {"own/straight": ("trainer", "-1")}, env=env)
    output = outputs["own/straight"]
    assert output.count("resumes an epoch where it stopped for several training loaders") == 1
    assert "this fit has 2 loaders, and not each one has the sampler" in output


@pytest.mark.timeout(600)  # a hang guard: four torchrun jobs of Fabric
def test_a_loader_set_up_by_fabric_resumes_bit_equal(tmp_path: Path, shm: Path) -> None:
    """The Fabric loop's loader through ``fabric.setup_dataloaders``, whose sampler's epoch
    Fabric sets to its count of iterations (0 again after a restart), with Fabric's sampler
    and with the loop's ``ElasticSampler``; and that sampler in a StatefulDataLoader in the
    loop's state (whose own fast-forward is left out): rank 1 SIGKILLed once 11 steps are
    done, the resumed epoch goes on in its own order, and the weights are bit-equal."""
    for setup in ("fabric", "own", "stateful"):
        runs = {f"{setup}/straight": ("fabric", "-1"), f"{setup}/killed": ("fabric", "11")}
        run_and_compare(tmp_path, shm, runs, env={"ELASTIC_FABRIC_LOADER": setup})
        out = tmp_path / setup
        assert "attempt 1" in (out / "killed" / "steps.rank1").read_text(), setup
        for rank in (0, 1):
            assert len(done_twice(out / "killed", rank)) <= 1, (setup, rank)
        assert same_weights(out / "killed" / "final.pt", out / "straight" / "final.pt"), setup


def _killed_mid_epoch_is_bit_equal(
    tmp_path: Path, shm: Path, family: str, env: dict[str, str], *, fabric: bool = False
) -> None:
    """Under ``env``, the Trainer fit with a plain and a stateful loader (and the Fabric
    loop), rank 1 SIGKILLed once 11 steps are done, each bit-equal to its run uninterrupted,
    with at most one step done twice."""
    straight = {"trainer": "straight", "stateful": "straight"}
    runs = {f"{family}/straight": ("trainer", "-1")}
    runs |= {f"{family}/{mode}": (mode, "11") for mode in straight}
    if fabric:
        straight["fabric"] = "fabric_straight"
        runs |= {
            f"{family}/fabric_straight": ("fabric", "-1"),
            f"{family}/fabric": ("fabric", "11"),
        }
    run_and_compare(tmp_path, shm, runs, env=env)
    out = tmp_path / family
    for name, reference in straight.items():
        assert "attempt 1" in (out / name / "steps.rank1").read_text(), f"{name} did not restart"
        for rank in (0, 1):
            assert len(done_twice(out / name, rank)) <= 1, (family, name, rank)
        assert same_weights(out / name / "final.pt", out / reference / "final.pt"), (family, name)
