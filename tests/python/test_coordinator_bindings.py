"""The native ZeRO-3 coordinator driven from Python: plans, errors, notices.

The exhaustive checks are in C++ (tests/cpp/test_coordinator*.cpp); these
check that the bindings carry the protocol across intact.
"""

import random

import pytest

import zcore
from zcore import _C

G, W, R = _C.Action.GATHER, _C.Action.WAIT, _C.Action.RELEASE
S = 1_000_000  # a layer-sized group, above the persistence threshold


def chain(n, **config):
    c = _C.ParamCoordinator(_C.CoordinatorConfig(**config))
    modules = [c.register_module([c.register_group(S, 2)]) for _ in range(n)]
    return c, modules


def step(c, modules, key=0):
    plans = []
    c.begin_step(key)
    for m in modules:
        plans.append(c.before_module(m))
        plans.append(c.after_module(m))
    plans.append(c.end_step())
    return plans


def test_first_step_records_and_the_next_one_prefetches():
    c, modules = chain(4, prefetch_bucket_elements=2 * S, max_reuse_distance=0)
    assert step(c, modules)[:2] == [[(G, 0), (W, 0)], [(R, 0)]]
    assert c.trace() == [0, 1, 2, 3]
    assert step(c, modules) == [
        [(G, 0), (G, 1), (G, 2), (W, 0)],  # own group, then the bucket's prefetch
        [(R, 0)],
        [(G, 3), (W, 1)],
        [(R, 1)],
        [(W, 2)],
        [(R, 2)],
        [(W, 3)],
        [(R, 3)],
        [],
    ]
    s = c.stats()
    assert (s.steps, s.prefetch_hits, s.prefetch_misses, s.gathers) == (2, 3, 5, 8)
    assert s.bytes_gathered == 8 * 2 * S
    assert s.peak_live_elements == 3 * S and s.live_elements == 0
    assert c.state(0) is _C.GroupState.SHARDED


def test_protocol_misuse_raises_zcore_exceptions_with_details():
    with pytest.raises(zcore.InvalidArgumentError, match="max_live_elements") as info:
        _C.ParamCoordinator(_C.CoordinatorConfig(max_live_elements=-1))
    assert info.value.key == "max_live_elements" and info.value.value == -1
    c, modules = chain(2)
    with pytest.raises(zcore.InvalidStateError) as info:
        c.after_module(modules[0])
    assert (info.value.module, info.value.group, info.value.state) == (0, 0, "sharded")
    with pytest.raises(zcore.InvalidHandleError):
        c.before_module(7)
    with pytest.raises(zcore.InvalidArgumentError, match="listed twice"):
        c.register_module([1, 1])
    c.begin_step()
    c.before_module(modules[1])
    with pytest.raises(zcore.InvalidStateError, match="abort_step"):
        c.end_step()
    assert c.abort_step() == [(R, 1)]
    assert not c.in_step and c.stats().aborted_steps == 1


def test_a_departure_is_notified_once_and_the_step_stays_correct():
    c, modules = chain(3, prefetch_bucket_elements=S, max_reuse_distance=0)
    step(c, modules)
    notices = []
    for i in range(6):
        plans = step(c, modules[::2] if i % 2 == 0 else modules)
        notices.append(c.take_departure_notice())
        assert plans[-1] in ([], [(W, 1), (R, 1)]), "an unused prefetch is waited, then released"
    first = notices[0]
    assert (first.expected, first.actual, first.position, first.step) == (1, 2, 1, 1)
    assert notices[1:] == [None] * 5
    assert c.stats().trace_departures == 6


def test_persistent_groups_stay_gathered_until_release_all():
    c = _C.ParamCoordinator(_C.CoordinatorConfig(persistence_threshold=1000))
    small, big = c.register_group(10, 4), c.register_group(5000, 4)
    m = c.register_module([small, big])
    assert c.persistent(small) and not c.persistent(big)
    c.begin_step(0)
    c.before_module(m)
    c.after_module(m)
    c.end_step()
    assert c.state(small) is _C.GroupState.GATHERED
    assert c.state(big) is _C.GroupState.SHARDED
    assert c.release_all() == [(R, small)]


def test_a_caller_executing_the_plans_sees_the_guarantees():
    """A small random model played in Python: modules run only on arrived
    groups, nothing in use or in flight is released, live stays in budget."""
    rng = random.Random(5)
    sizes = [rng.randrange(1, 4) * S for _ in range(8)]
    budget = 5 * S
    c = _C.ParamCoordinator(
        _C.CoordinatorConfig(prefetch_bucket_elements=3 * S, max_live_elements=budget, max_reuse_distance=2 * S)
    )
    groups = [c.register_group(n, 2) for n in sizes]
    for g in groups:
        c.register_module([g])
    where = {g: "sharded" for g in groups}
    users = dict.fromkeys(groups, 0)

    def execute(plan, needed=()):
        for action, g in plan:
            if action is G:
                assert where[g] == "sharded"
                where[g] = "in flight"
            elif action is W:
                assert where[g] == "in flight"
                where[g] = "arrived"
            else:
                assert where[g] == "arrived" and users[g] == 0
                where[g] = "sharded"
            live = sum(sizes[h] for h in groups if where[h] != "sharded")
            mandatory = sum(sizes[h] for h in groups if users[h] or h in needed)
            assert live <= max(budget, mandatory)

    order = [rng.randrange(8) for _ in range(12)]
    for key in (0, 0, 0, 0):
        c.begin_step(key)
        for m in order + order[::-1]:
            g = c.module_groups(m)[0]
            execute(c.before_module(m), needed=(g,))
            assert where[g] == "arrived"
            users[g] += 1  # the module runs
            users[g] -= 1
            execute(c.after_module(m))
        execute(c.end_step())
        assert set(where.values()) == {"sharded"}
        if rng.random() < 0.5:
            order[rng.randrange(len(order))] = rng.randrange(8)
    assert c.stats().prefetch_hits > 0


def test_recording_and_unforeseen_uses_are_visible():
    c, modules = chain(3)
    assert not c.recording and not c.unforeseen(modules[0])  # outside a step
    c.begin_step(0)
    assert c.recording and c.unforeseen(modules[0])
    c.abort_step()
    step(c, modules)
    c.begin_step(0)
    assert not c.recording
    assert not c.unforeseen(modules[0]) and c.unforeseen(modules[1])
    c.abort_step()


def test_offloaded_shards_are_fetched_dropped_and_stored_through_plans():
    F, Y, D = _C.Action.FETCH_SHARD, _C.Action.SHARD_READY, _C.Action.DROP_SHARD
    ST, SD = _C.Action.STORE_SHARD, _C.Action.SHARD_STORED
    shard = S // 4 * 2  # bytes of a rank's shard at world size 4
    with pytest.raises(zcore.InvalidArgumentError, match="staging_bytes") as info:
        _C.ParamCoordinator(_C.CoordinatorConfig()).register_group(S, 2, shard_numel=S // 4, tier=_C.ShardTier.NVME)
    assert (info.value.key, info.value.value, info.value.needed) == ("staging_bytes", 0, shard)
    config = _C.CoordinatorConfig(prefetch_bucket_elements=S, staging_bytes=4 * shard, fetch_horizon_uses=2)
    assert (config.staging_bytes, config.fetch_horizon_uses) == (4 * shard, 2)
    c = _C.ParamCoordinator(config)
    tiers = [_C.ShardTier.NVME, _C.ShardTier.HOST, _C.ShardTier.DEVICE]
    modules = [c.register_module([c.register_group(S, 2, shard_numel=S // 4, tier=t)]) for t in tiers]
    assert [c.shard_tier(g) for g in range(3)] == tiers
    assert c.shard_state(0) is _C.ShardState.STORED and c.shard_state(2) is _C.ShardState.RESIDENT
    assert step(c, modules)[0] == [(F, 0), (Y, 0), (G, 0), (W, 0), (D, 0)]  # recording: on demand
    c.begin_step(0)
    # Following: both shards read first, the prefetch all-gathers the one fetched ahead.
    assert c.before_module(modules[0]) == [(F, 0), (F, 1), (Y, 0), (G, 0), (Y, 1), (G, 1), (W, 0), (D, 0)]
    assert c.shard_state(1) is _C.ShardState.FETCHED
    c.after_module(modules[0])
    c.end_step()
    with pytest.raises(zcore.InvalidStateError):
        c.begin_step(0)
        c.store_shards([0])
    c.abort_step()
    assert c.store_shards([0, 1, 2]) == [(ST, 0)]  # host and device shards change in place
    assert c.shard_state(0) is _C.ShardState.STORING
    assert c.finish_stores() == [(SD, 0)]
    s = c.stats()
    assert (s.shard_fetches, s.shard_fetches_ahead, s.shard_stores) == (4, 1, 1)
    assert (s.shard_bytes_fetched, s.shard_bytes_stored) == (4 * shard, shard)
    assert (s.staged_bytes, s.peak_staged_bytes, s.shard_fetches_unused) == (0, 2 * shard, 0)


def test_device_tier_is_the_default_and_plans_hold_no_shard_actions():
    c, modules = chain(3, prefetch_bucket_elements=S)
    assert all(c.shard_tier(g) is _C.ShardTier.DEVICE for g in range(3))
    actions = {a for p in step(c, modules) + step(c, modules) for a, _ in p}
    assert actions == {G, W, R}
    assert c.store_shards([0, 1, 2]) == [] and c.finish_stores() == []
