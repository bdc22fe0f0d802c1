"""ZeRO-3 through arena compaction: when the gather arena has room in total
but no free range fits a group, it moves the gathered blocks together;
parameters, saved views and all-gathers in flight must follow. Revisits
(groups of mixed sizes, layers run twice, gathered ahead and kept for
reuse) fragments the arena so that it compacts on most steps; training
still matches single-process AdamW, with every group inside the arena."""

from distributed import run_ranks
from training import assert_matches, train_reference, train_zcore, zcore_config

STEPS = 10
TOLERANCE = 1e-5
FRAGMENTING = {
    "stage3_param_persistence_threshold": 0,
    "stage3_max_live_parameters": 12000,
    "stage3_prefetch_bucket_size": 1000,
    "stage3_max_reuse_distance": 10000,
}


def train_fragmenting(rank, world):
    return train_zcore(rank, world, "revisits", zcore_config(3, 1, 0.0, zero=FRAGMENTING), STEPS)


def test_training_through_arena_compactions_matches_single_process():
    results = run_ranks(train_fragmenting, 2, timeout=300)
    ref = train_reference("revisits", 0.0, STEPS, 2, 1)
    for rank, got in enumerate(results):
        assert_matches(got, ref, TOLERANCE, f"rank {rank}")
        stats = got["gather_stats"]
        assert stats.compactions >= STEPS // 2, stats  # blocks really moved, on most steps
        assert stats.arena_fallbacks == 0, stats  # compaction, not plain tensors, made room
        assert stats.prefetch_gathers > 0, stats  # with all-gathers started ahead of use
