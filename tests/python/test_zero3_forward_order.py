"""ZeRO-3 with forwards that run before earlier forwards' backwards
(zcore.zero3.pending_backwards): one step spans them all, so nothing gathered in
a later backward outlives the optimizer's update. Each loop matches a
single-process torch AdamW run over the same global batches, and leaves
nothing gathered."""

import gc

import torch
import torch.distributed as dist

import zcore
from distributed import run_ranks
from models import global_batch, loss_of, make_model
from training import ON_DEMAND, TIGHT, assert_matches, rows, train_reference, zcore_config
from zcore.zero3.pending_backwards import PendingBackwards

STEPS = 8
BATCH = 8
WORLD = 2
TOLERANCE = 1e-5


def interleaved(engine, parts):
    """F0 F1 B0 step B1 step: accumulation over micro-batches whose forwards come first."""
    losses = [engine_loss(engine, x, y) for x, y in parts]
    for loss in losses:
        engine.backward(loss)
        engine.step()
    return losses


def reversed_backwards(engine, parts):
    """F0 F1 B1 step B0 step."""
    losses = [engine_loss(engine, x, y) for x, y in parts]
    for loss in reversed(losses):
        engine.backward(loss)
        engine.step()
    return losses


def one_backward(engine, parts):
    """F0 F1 and one backward of their mean (a contrastive-style loop), accumulation 1."""
    losses = [engine_loss(engine, x, y) for x, y in parts]
    engine.backward(sum(losses) / len(losses))
    engine.step()
    return losses


KEPT = []


def kept_output(engine, parts):
    """A forward with grad whose output is kept but never back-propagated,
    before each micro-batch's ordinary forward and backward."""
    x, _ = parts[0]
    KEPT.append(engine(x))
    return interleaved_one_by_one(engine, parts)


def interleaved_one_by_one(engine, parts):
    losses = []
    for x, y in parts:
        losses.append(engine_loss(engine, x, y))
        engine.backward(losses[-1])
        engine.step()
    return losses


def engine_loss(engine, x, y):
    return loss_of("gpt", engine(x), y)


# (label, loop, accumulation in the config, stage-3 keys)
LOOPS = [
    ("interleaved", interleaved, 2, ON_DEMAND),
    ("interleaved, tight", interleaved, 2, TIGHT),
    ("interleaved, persistent", interleaved, 2, {}),
    ("reversed", reversed_backwards, 2, ON_DEMAND),
    ("one backward", one_backward, 1, ON_DEMAND),
    ("kept output", kept_output, 2, ON_DEMAND),
]


def train(rank, world):
    out = {}
    for label, loop, gas, keys in LOOPS:
        config = zcore_config(3, gas, 0.0, zero=keys, train_batch_size=BATCH)
        engine, *_ = zcore.initialize(model=make_model("gpt"), config=config)
        losses = []
        for step in range(STEPS):
            x, y = global_batch("gpt", step, BATCH)
            # This rank's two micro-batches, as the reference's parts m * world + rank.
            parts = [(x[rows(m * world + rank, 2 * world, BATCH)], y[rows(m * world + rank, 2 * world, BATCH)])
                     for m in range(2)]
            total = sum(loss.detach() for loss in loop(engine, parts))
            dist.all_reduce(total)
            losses.append(total.item() / (2 * world))
        KEPT.clear()
        gc.collect()
        stats = engine.gather_stats()
        with zcore.GatheredParameters(list(engine.module.parameters())):
            params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
        out[label] = {
            "losses": losses,
            "params": params,
            "left_gathered": stats.gathered_bytes - stats.persistent_bytes,
            "in_step": engine.residency.coordinator.in_step,
            "global_steps": engine.global_steps,
        }
        engine.destroy()
    return out


def test_forwards_before_earlier_backwards_train_as_single_process():
    results = run_ranks(train, WORLD, timeout=600)
    reference = train_reference("gpt", 0.0, STEPS, WORLD, 2, batch=BATCH)
    assert reference["losses"][0] > reference["losses"][-1]
    for label, *_ in LOOPS:
        for rank, result in enumerate(results):
            got = result[label]
            tag = f"{label}, rank {rank}"
            assert got["global_steps"] == STEPS, tag
            assert_matches(got, reference, TOLERANCE, tag)
            assert got["left_gathered"] == 0 and not got["in_step"], tag


def test_a_forward_is_pending_until_its_backward_runs_or_its_graph_is_freed():
    w = torch.randn(3, requires_grad=True)
    pending = PendingBackwards()
    first = (w * 2).sum()
    pending.add({"loss": first, "aux": [w.detach()]})
    assert pending.any()
    second = (w * 3).sum()
    pending.add((second, None))
    first.backward()
    assert pending.any()  # the second forward's backward has not run
    del second
    gc.collect()
    assert not pending.any()  # its graph is gone: no backward can come
    pending.add(w.detach())  # no graph: nothing awaits a backward
    assert not pending.any()
    third = torch.stack([w * 4, w * 5])
    pending.add([third[0], third[1]])  # two outputs of one node: one pass
    (third[1].sum()).backward()
    assert not pending.any()


def test_a_kept_output_does_not_hold_the_step_past_the_update():
    results = run_ranks(kept_forever, 1, launcher=False, timeout=300)
    assert results[0] == (0, False)


def kept_forever(rank, world):
    config = zcore_config(3, 1, 0.0, zero=ON_DEMAND, train_batch_size=4)
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=config)
    kept = []
    for step in range(3):
        x, y = global_batch("gpt", step, 4)
        kept.append(engine(x))  # kept with its graph, never back-propagated
        engine.backward(engine_loss(engine, x, y))
        engine.step()
    stats = engine.gather_stats()
    result = (stats.gathered_bytes - stats.persistent_bytes, engine.residency.coordinator.in_step)
    engine.destroy()
    return result

