"""BatchedMuon (dflash_pipeline.muon) against torch.optim.Muon: the same steps, state and checkpoints; and the
trainer with ``train.optimizer: muon`` on the tiny store of tests/train_helpers.py: Muon is what steps its matrices."""

import copy

import pandas as pd
import pytest
import torch
from train_helpers import BASE, make_store, make_tiny_target, paths

from dflash_pipeline.muon import BatchedMuon
from dflash_pipeline.train import TrainConfig, Trainer, train

# square, wide and tall matrices, several of a shape (the drafter's q/o, k/v, gate/up, down and fc kinds)
SHAPES = [(48, 48)] * 3 + [(16, 48)] * 2 + [(80, 48)] * 2 + [(48, 80)] * 2 + [(48, 144)]


def parameters(seed: int = 1) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g) * 0.05) for shape in SHAPES]


def relative(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> float:
    return float((a - b).detach().norm() / scale.detach().norm())


@pytest.mark.parametrize("options", [dict(), dict(nesterov=False), dict(adjust_lr_fn="match_rms_adamw"),
                                     dict(momentum=0.5, ns_steps=3)])
def test_batched_muon_steps_equal_torch_muon(options):
    """Each step from the same weights and momentum moves every matrix as torch's Muon does. The weight decay is
    large so that a wrong one shows; one matrix without a gradient stays as it is in both."""
    ours, theirs = parameters(), parameters()
    kwargs = dict(lr=0.02, weight_decay=2.0, **options)
    batched, reference = BatchedMuon(ours, **kwargs), torch.optim.Muon(theirs, **kwargs)
    for step in range(4):
        g = torch.Generator().manual_seed(100 + step)
        before = [p.detach().clone() for p in theirs]
        for i, (p, q) in enumerate(zip(ours, theirs)):
            grad = None if i == 4 else torch.randn(p.shape, generator=g)
            p.grad, q.grad = grad, None if grad is None else grad.clone()
        batched.step()
        reference.step()
        for i, (p, q, b) in enumerate(zip(ours, theirs, before)):
            if i == 4:
                assert torch.equal(p, b) and torch.equal(q, b)
                continue
            # equal on the CPUs tried; bf16 matmuls batched may round differently elsewhere: Muon's bf16
            # Newton-Schulz turns a last-bit difference into ~1 % of the update
            assert relative(p, q, q - b) <= 0.03, (step, i)
            assert relative(batched.state[p]["momentum_buffer"], reference.state[q]["momentum_buffer"],
                            reference.state[q]["momentum_buffer"]) <= 1e-6
        with torch.no_grad():  # the next step from the same point: each step's own difference
            for p, q in zip(ours, theirs):
                p.copy_(q)
                if q in reference.state:
                    batched.state[p]["momentum_buffer"].copy_(reference.state[q]["momentum_buffer"])


def test_batched_muon_takes_torch_muons_checkpoint():
    ours, theirs = parameters(), parameters()
    batched, reference = BatchedMuon(ours, lr=0.02), torch.optim.Muon(theirs, lr=0.02)
    for p, q in zip(ours, theirs):
        q.grad = torch.randn_like(q)
    reference.step()
    batched.load_state_dict(copy.deepcopy(reference.state_dict()))  # as a checkpoint file holds it: not shared
    with torch.no_grad():
        for p, q in zip(ours, theirs):
            p.copy_(q)
    before = [q.detach().clone() for q in theirs]
    for p, q in zip(ours, theirs):
        p.grad = q.grad = torch.randn_like(q)
    batched.step()
    reference.step()
    for p, q, b in zip(ours, theirs, before):
        assert relative(p, q, q - b) <= 0.03
    assert reference.state_dict()["state"].keys() == batched.state_dict()["state"].keys()


# ---- sharded across ranks (gloo, CPU processes) ----
def _sharded_steps(rank: int, world: int, init_file: str, shapes: list, steps: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        params = parameters_of(shapes)
        optimizer = BatchedMuon(params, lr=0.02, weight_decay=0.5, process_group=dist.group.WORLD)
        for step in range(steps):
            for p, grad in zip(params, gradients(shapes, step)):
                p.grad = grad
            optimizer.step()
        torch.save({"params": [p.detach() for p in params], "state": optimizer.state_dict()}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def parameters_of(shapes, seed: int = 1) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g) * 0.05) for shape in shapes]


def gradients(shapes, step: int) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(100 + step)
    return [None if i == 4 else torch.randn(shape, generator=g) for i, shape in enumerate(shapes)]


@pytest.mark.parametrize("world, shapes", [(2, SHAPES), (4, [(48, 48), (48, 48), (16, 48)])])
def test_sharded_newton_schulz_equals_the_unsharded_update(tmp_path, world, shapes):
    """Every rank orthogonalises its share of the matrices and gets the others' by an all-gather: after three steps
    every rank holds exactly (bitwise) the parameters and momentum of one unsharded BatchedMuon. Bitwise because
    each matrix's Newton-Schulz is the same computation in a batch of any size on the CPU, and the bf16 results
    travel as they are. With 4 ranks and 3 matrices one rank has nothing to compute and still takes part."""
    import torch.multiprocessing as mp

    from dflash_pipeline.muon import shard_assignment

    steps = 3
    mp.spawn(_sharded_steps, args=(world, str(tmp_path / "init"), shapes, steps, str(tmp_path / "out")), nprocs=world)
    params = parameters_of(shapes)
    reference = BatchedMuon(params, lr=0.02, weight_decay=0.5)
    for step in range(steps):
        for p, grad in zip(params, gradients(shapes, step)):
            p.grad = grad
        reference.step()
    owners = shard_assignment(shapes, world)
    assert len(set(owners)) == min(world, len(shapes))  # the work is shared
    for rank in range(world):
        result = torch.load(tmp_path / f"out.{rank}", weights_only=True)
        assert all(torch.equal(a, b) for a, b in zip(result["params"], params)), rank
        for index, p in enumerate(params):
            if index == 4:  # no gradient: untouched, no state
                assert index not in result["state"]["state"]
                continue
            assert torch.equal(result["state"]["state"][index]["momentum_buffer"],
                               reference.state[p]["momentum_buffer"])


def test_shard_assignment_balances_newton_schulz_flops():
    """The 27B drafter's 36 matrices over 8 ranks: no rank gets more than the largest matrix above an even share."""
    from dflash_pipeline.muon import newton_schulz_cost, shard_assignment

    layer = [(4096, 5120), (1024, 5120), (1024, 5120), (5120, 4096), (17408, 5120), (17408, 5120), (5120, 17408)]
    shapes = layer * 5 + [(5120, 25600)]
    owners = shard_assignment(shapes, 8)
    loads = [sum(newton_schulz_cost(s) for s, o in zip(shapes, owners) if o == r) for r in range(8)]
    total, largest = sum(loads), max(newton_schulz_cost(s) for s in shapes)
    assert max(loads) <= total / 8 + largest and min(loads) > 0
    assert shard_assignment(shapes, 8) == owners and shard_assignment(shapes, 1) == [0] * len(shapes)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny")
    target = make_tiny_target(tmp / "target")
    return {"target": target, "store": make_store(tmp, target)}


def first_step(tiny, tmp_path, optimizer: str) -> tuple[Trainer, dict[str, torch.Tensor], float]:
    """A trainer of ``optimizer`` (no warm-up: the first step has the full rate), how its first step moved each
    weight, and the Muon group's rate of that step (the first scheduler's)."""
    cfg = TrainConfig(**{**BASE, "optimizer": optimizer, "muon_lr": 0.02, "warmup_ratio": 0.0})
    trainer = Trainer(cfg, str(tiny["store"]), str(tiny["target"]), str(tmp_path / optimizer))
    before = {name: p.detach().clone() for name, p in trainer.drafter.named_parameters() if p.requires_grad}
    _, _, lr = trainer.train_step(next(trainer.epoch_steps(0, 0)))
    moved = {name: p.detach() - before[name] for name, p in trainer.drafter.named_parameters() if p.requires_grad}
    return trainer, moved, lr


def test_muon_trains(tiny, tmp_path):
    muon, muon_moved, lr = first_step(tiny, tmp_path, "muon")
    adamw, adamw_moved, _ = first_step(tiny, tmp_path, "adamw")
    assert [type(o) for o in muon.optimizers] == [BatchedMuon, torch.optim.AdamW]
    assert [type(o) for o in adamw.optimizers] == [torch.optim.AdamW]
    named = dict(muon.drafter.named_parameters())
    names = {id(p): name for name, p in named.items()}
    matrices = {names[id(p)] for p in muon.optimizers[0].param_groups[0]["params"]}
    assert matrices == {name for name, p in named.items()
                        if p.requires_grad and p.ndim == 2 and name.startswith(("layers.", "fc."))}
    assert {names[id(p)] for p in muon.optimizers[1].param_groups[0]["params"]} == set(muon_moved) - matrices
    # Same weights, same batch, one step: each matrix moved as torch's Muon moves it from the step's (clipped)
    # gradient, which is not how AdamW moved it.
    assert all(torch.equal(muon.initial_weights[k], adamw.initial_weights[k]) for k in muon.initial_weights)
    assert lr == pytest.approx(0.02)
    for name in matrices:
        weight = torch.nn.Parameter(muon.initial_weights[name].clone())
        weight.grad = named[name].grad.clone()
        torch.optim.Muon([weight], lr=lr, weight_decay=BASE.get("weight_decay", 0.0)).step()
        expected = weight.detach() - muon.initial_weights[name]
        assert relative(muon_moved[name], expected, expected) < 1e-4, name
        assert relative(adamw_moved[name], muon_moved[name], muon_moved[name]) > 0.1, name
    metrics = train({**BASE, "epochs": 3, "optimizer": "muon", "muon_lr": 0.02}, **paths(tiny, tmp_path / "run"))
    log = pd.read_csv(tmp_path / "run" / "log.csv")
    assert metrics["val_loss"] < 0.5 * log.val_loss.iloc[0]
